"""Developer tools run as `python -m rwkvx_cli.tools.NAME` (benchmarks): not part of the `rwkvx` command."""
