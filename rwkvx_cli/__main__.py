from rwkvx_cli.cli import main

main()
