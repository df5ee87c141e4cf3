"""The project's error types.

Library code raises these; the CLI renders them as one line and exits with
`exit_code`, never with a traceback.
"""


class RwkvxError(Exception):
    """Base class for every error the project reports to a user."""

    exit_code = 1


class UsageError(RwkvxError):
    """Bad command-line arguments or configuration (exit code 2)."""

    exit_code = 2


class CheckpointError(RwkvxError):
    """A checkpoint or weights file that cannot be written, read or used (checkpoints/; formats/'
    FormatError is one)."""
