"""The data layer's error type."""

from rwkvx_cli.errors import RwkvxError


class DataError(RwkvxError):
    """A corpus, token file or tokenizer that cannot be used as it is (exit code 1)."""

    exit_code = 1
