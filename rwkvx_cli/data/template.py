"""Chat templates as data: how `prepare` renders a conversation into text, and which of its tokens carry loss.

A template is a small YAML (or JSON) file (`templates/g1.yaml` ships, the RWKV-7 G1 format):

    name: g1
    roles:                       # role name -> the text before its turns, whether they carry loss, whether
      user: {prefix: "User:", loss: false, clean: true}            # its text is cleaned (G1's clean_txt)
      assistant: {prefix: "Assistant:", loss: true}
    text_prefix: " "             # between a role's prefix and its text (G1: the reply's first token has it)
    turn_end: "\\n\\n"             # after every turn, the last one too
    end: eod                     # a conversation ends with the tokenizer's end-of-document id
    prompt: user                 # the roles of a {"prompt", "response"} record
    response: assistant

A turn renders as `prefix`, then `text_prefix + text + turn_end`. The prefix never carries loss; the rest carries
it when the role does, and so does the end-of-document id when the conversation's last turn does. The rendered
text is a list of spans (text, carries loss), adjacent segments with the same flag joined, which `encode.py`
tokenizes one span at a time: the mask comes from the spans, never from looking for markers in the tokens. With the
World tokenizer the spans' ids are the ids of the whole text for any G1 conversation, since no World token holds
": " or a newline followed by anything but whitespace, the only two places a G1 span ends (tests/data).

JSONL records come in three shapes: `{"messages": [{"role", "content"}, ...]}` (a conversation), `{"prompt",
"response"}` (one turn of each template role), and `{TEXT_FIELD: "..."}` (a document whose every token carries loss,
as without a template). A record holding "messages" is a conversation; else one holding "prompt" or "response" a
pair; else a document. Each file holds one shape: that of its first record (`file_shape`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from rwkvx_cli.data.errors import DataError
from rwkvx_cli.errors import UsageError

TEMPLATES_DIR = Path(__file__).with_name("templates")
FORMAT = "rwkvx-template"
SHAPES = {"messages": 'a conversation ("messages")', "prompt": 'a prompt/response pair ("prompt", "response")',
          "text": "a document"}
_FILES_OF = {"messages": "conversations", "prompt": "prompt/response pairs", "text": "documents"}
_KEYS = ("format", "name", "roles", "text_prefix", "turn_end", "end", "prompt", "response")
_ROLE_KEYS = ("prefix", "loss", "clean")
_NEWLINES = re.compile(r"\n{2,}")


def clean(text: str) -> str:
    """G1's clean_txt: CRLF as LF, every run of newlines as one, stripped (so that no "\\n\\n" is left)."""
    if "\n\n" not in text and "\r\n" not in text:
        return text.strip()  # the usual text: nothing to collapse
    return _NEWLINES.sub("\n", text.replace("\r\n", "\n")).strip()


@dataclass(frozen=True)
class Role:
    prefix: str
    loss: bool
    clean: bool = False


@dataclass(frozen=True)
class Template:
    name: str
    roles: dict[str, Role]
    text_prefix: str
    turn_end: str
    prompt: str | None
    response: str | None

    def as_dict(self) -> dict:
        """The template with every field given: what identifies it (`sha256`) and what a worker rebuilds it from."""
        return {
            "format": FORMAT,
            "name": self.name,
            "roles": {r: {"prefix": v.prefix, "loss": v.loss, "clean": v.clean} for r, v in self.roles.items()},
            "text_prefix": self.text_prefix,
            "turn_end": self.turn_end,
            "end": "eod",
            "prompt": self.prompt,
            "response": self.response,
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True, ensure_ascii=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> Template:
        return parse_template(json.loads(text), "template")

    def spans(self, turns: list[tuple[str, str]]) -> list[tuple[str, bool]]:
        """(text, carries loss) of the rendered conversation `turns` ((role, text), roles known), adjacent
        segments with the same flag joined, empty ones left out."""
        texts: list[str] = []
        flags: list[bool] = []
        for role, text in turns:
            r = self.roles[role]
            body = self.text_prefix + (clean(text) if r.clean else text) + self.turn_end
            for part, loss in ((r.prefix, False), (body, r.loss)):
                if not part:
                    continue
                if flags and flags[-1] == loss:
                    texts[-1] += part
                else:
                    texts.append(part)
                    flags.append(loss)
        return list(zip(texts, flags, strict=True))

    def record_spans(self, obj: dict, shape: str, text_field: str) -> list[tuple[str, bool]]:
        """The spans of one JSONL record of its file's `shape`; ValueError saying what is wrong with it."""
        got = record_shape(obj, text_field)
        if got != shape:
            what = SHAPES[got] if got else f'a record without "messages", "prompt"/"response" or "{text_field}"'
            raise ValueError(f"{what}, in a file of {_FILES_OF[shape]} (its first record's shape): one shape per file")
        if shape == "text":
            return [(_string(obj[text_field], text_field), True)]
        if shape == "prompt":
            if self.prompt is None or self.response is None:
                raise ValueError(f"the template {self.name} names no prompt and response roles")
            pair = [(self.prompt, _string(obj.get("prompt"), "prompt")),
                    (self.response, _string(obj.get("response"), "response"))]
            return self.spans(pair)
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
        turns = []
        for k, m in enumerate(messages, 1):
            if not isinstance(m, dict):
                raise ValueError(f'message {k} is not a {{"role", "content"}} object')
            role = m.get("role")
            if role not in self.roles:
                known = ", ".join(self.roles)
                raise ValueError(f"message {k}: role {role!r} is not one of the template {self.name}'s ({known})")
            turns.append((role, _string(m.get("content"), f"message {k} content")))
        return self.spans(turns)


def _string(value, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f'"{what}" must be a string' if " " not in what else f"{what} must be a string")
    if value.isascii():  # a flag of the string: no surrogate in it
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} contains an unpaired surrogate \\u{ord(value[e.start]):04x}") from None
    return value


def record_shape(obj: dict, text_field: str) -> str | None:
    if "messages" in obj:
        return "messages"
    if "prompt" in obj or "response" in obj:
        return "prompt"
    return "text" if text_field in obj else None


def names() -> list[str]:
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.yaml"))


def load_template(name_or_path: str | os.PathLike) -> Template:
    """A shipped template by name (`g1`), or a template file; UsageError naming what is wrong."""
    value = os.fspath(name_or_path)
    path = TEMPLATES_DIR / f"{value}.yaml" if value in names() else Path(value)
    if not path.is_file():
        raise UsageError(f"template {value!r} is neither a template name ({', '.join(names())}) nor a file")
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read the template {path}: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"the template {path} is not valid YAML or JSON ({first})") from None
    return parse_template(data, str(path))


def parse_template(data, where: str) -> Template:
    def bad(why: str) -> UsageError:
        return UsageError(f"{where}: {why}")

    if not isinstance(data, dict):
        raise bad("a template is a mapping (name, roles, text_prefix, turn_end, end, prompt, response)")
    for key in data:
        if key not in _KEYS:
            raise bad(f"unknown key {key!r} (a template has {', '.join(_KEYS)})")
    if data.get("format", FORMAT) != FORMAT:
        raise bad(f"format is {data['format']!r}, not {FORMAT!r}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise bad("name must be a non-empty string")
    roles_in = data.get("roles")
    if not isinstance(roles_in, dict) or not roles_in:
        raise bad("roles must map each role name to {prefix, loss, clean}")
    roles = {}
    for role, spec in roles_in.items():
        if not isinstance(role, str) or not role:
            raise bad(f"role name {role!r} is not a string")
        if not isinstance(spec, dict):
            raise bad(f"role {role}: expected {{prefix, loss, clean}}, got {spec!r}")
        for key in spec:
            if key not in _ROLE_KEYS:
                raise bad(f"role {role}: unknown key {key!r} (a role has {', '.join(_ROLE_KEYS)})")
        prefix, loss, cleaned = spec.get("prefix", ""), spec.get("loss"), spec.get("clean", False)
        if not isinstance(prefix, str):
            raise bad(f"role {role}: prefix must be a string")
        if not isinstance(loss, bool) or not isinstance(cleaned, bool):
            raise bad(f"role {role}: loss (required) and clean must be true or false")
        roles[role] = Role(prefix, loss, cleaned)
    if not any(r.loss for r in roles.values()):
        raise bad("no role carries loss (loss: true): nothing would be trained")
    strings = {}
    for key in ("text_prefix", "turn_end"):
        strings[key] = data.get(key, "")
        if not isinstance(strings[key], str):
            raise bad(f"{key} must be a string")
    if data.get("end", "eod") != "eod":
        raise bad(f"end is {data['end']!r}: a conversation ends with the end-of-document id (end: eod)")
    pair = {}
    for key in ("prompt", "response"):
        pair[key] = data.get(key)
        if pair[key] is not None and pair[key] not in roles:
            raise bad(f"{key} names the role {pair[key]!r}, which is not one of its roles ({', '.join(roles)})")
    return Template(name, roles, strings["text_prefix"], strings["turn_end"], pair["prompt"], pair["response"])


def parse_record(line: bytes) -> dict:
    """One JSONL record as a dict; ValueError saying what is wrong with the line (orjson, then json for what it
    refuses, as `corpus.record_field`)."""
    try:
        obj = orjson.loads(line)
    except ValueError:
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError("not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    return obj


def file_shape(path: Path, text_field: str) -> str:
    """The shape of a JSONL file's records: that of its first line holding a JSON object of a known shape ("text"
    when there is none: its bad lines are then reported where they are read). Any other input holds documents."""
    from rwkvx_cli.data import corpus

    fmt = corpus.input_format(path)
    if fmt is None or fmt.kind != "jsonl":
        return "text"
    try:
        for line in _lines(path, fmt.compression):
            if not line.strip():
                continue
            try:
                shape = record_shape(parse_record(line), text_field)
            except ValueError:
                continue
            if shape is not None:
                return shape
    except (OSError, ValueError, EOFError, DataError):  # a damaged file: reported where it is read
        pass
    return "text"


def _lines(path: Path, compression: str | None) -> Iterator[bytes]:
    from rwkvx_cli.data import corpus

    with open(path, "rb") as f:
        if compression is None:
            yield from f
            return
        rest = b""
        for block, _ in corpus.decompressed(f, compression, path, 1 << 16):
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            yield from lines
        if rest:
            yield rest
