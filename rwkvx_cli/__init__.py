"""rwkvx: pretraining tool for RWKV-family recurrent language models."""

import os
import signal
import sys

__version__ = "0.1.0"


def _started_as_command() -> bool:
    """This process is the `rwkvx` command (its console script, or `python -m rwkvx_cli`) or one of its
    tools (`python -m rwkvx_cli.tools.bench_sharded`, whose entry.run_main hands Ctrl-C back), not a
    program that imports the package (a library user keeps Python's own Ctrl-C)."""
    if sys.argv and os.path.basename(sys.argv[0]) in ("rwkvx", "rwkvx.exe"):
        return True
    argv = list(getattr(sys, "orig_argv", ()))[1:]  # the interpreter's own options, then what it runs
    while argv:
        arg = argv.pop(0)
        if arg.startswith("-m"):
            module = arg[2:] or (argv[0] if argv else "")
            return module == "rwkvx_cli" or module.startswith("rwkvx_cli.")
        if arg in ("-X", "-W", "--check-hash-based-pycs"):  # an option with a separate value
            argv = argv[1:]
        elif arg.startswith("-c") or arg in ("-", "--") or not arg.startswith("-"):  # a command, stdin, a script
            return False
    return False


def _interrupted_while_starting(signum, frame) -> None:
    # Importing typer, rich and torch takes a while; Python's default handler would print a
    # KeyboardInterrupt traceback from deep inside an import. Nothing has been written yet.
    os.write(2, b"interrupted\n")
    raise SystemExit(130)


# Installed as early as the package allows; cli.main() hands Ctrl-C back to Python (KeyboardInterrupt,
# rendered by the commands) once the command line is imported.
if _started_as_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
