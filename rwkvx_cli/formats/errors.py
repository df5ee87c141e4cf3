"""The errors the format conversions raise: each is one line the CLI prints as it is."""

from rwkvx_cli.errors import CheckpointError, UsageError


class FormatError(CheckpointError):
    """Weights that a format cannot hold, or a file that is not what its format says."""


class SizeMismatchError(FormatError):
    """Tensors whose shapes disagree with sizes the user wrote (or with each other); the message names each."""


class OutputExistsError(UsageError):
    """An export target that already holds something rwkvx must not replace."""
