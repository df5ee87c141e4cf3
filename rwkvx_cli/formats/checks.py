"""Reading the JSON of files from elsewhere (a safetensors header, an HF config.json or shard index)
before any value in it is used: strict JSON, and values named in one short line.

`strict_json` reads JSON as the formats' own readers (serde_json in safetensors' Rust core) take
it, and stricter: UTF-8 only, no NaN / Infinity, no string that is not Unicode (a lone surrogate
escape), and no key twice in one object (Python's json keeps the last silently: two readers could
then read two different files); nesting past Python's stack is a damaged file too.

`show` spells a value for an error line without ever printing much of it (a forged file can hold
a list nested thousands deep or a megabyte of text, whose repr would be a traceback or a page).
"""

from __future__ import annotations

import json
import math

from rwkvx_cli.formats.errors import FormatError

U64_MAX = 2**64 - 1  # the formats' usize: the largest size or offset their readers take


class _Duplicate(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(raw: bytes, where: str) -> object:
    """The JSON value of `raw`, or FormatError naming `where` and what is wrong with it."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # every string Unicode (no lone surrogate)
    except _Duplicate as e:
        raise FormatError(f"{where} has the key {show(e.key)} twice in one object") from None
    except RecursionError:
        raise FormatError(f"{where} is not JSON (nested too deeply)") from None
    except UnicodeError:
        raise FormatError(f"{where} is not JSON (not UTF-8 text)") from None
    except ValueError as e:
        raise FormatError(f"{where} is not JSON ({str(e).splitlines()[0][:80]})") from None
    return value


def show(value: object, limit: int = 40) -> str:
    """A short spelling of a JSON value for an error line: scalars as they are (long text cut),
    a list or object by its type."""
    if isinstance(value, str):
        text = repr(value)
        return text if len(text) <= limit else text[: limit - 4] + "...'"
    if value is None or isinstance(value, (bool, int, float)):
        text = json.dumps(value) if not isinstance(value, int) or isinstance(value, bool) else str(value)
        return text if len(text) <= limit else f"an integer of {len(text)} digits"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def is_int(value: object) -> bool:
    """A JSON integer (Python's bool is an int; JSON's true is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite JSON number."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)
