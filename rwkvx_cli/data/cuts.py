"""Where a document may be cut so that encoding its pieces one by one gives the ids of encoding it whole.

Long documents are cut into pieces of about PIECE_CHARS characters (memory stays bounded, and a single document can
be split into training and validation at a piece end). A cut point is safe for a tokenizer when no token, and no
pre-token its pre-tokenizer makes, crosses it, and when a piece starting there gets nothing the whole text would not
(SentencePiece-style tokenizers prepend a space to every input they are given). Three kinds:

- "line": right after a newline that a non-space character follows. No GPT-2-style byte-level BPE pre-token, no
  whitespace or BERT pre-token and no World token crosses it. Not safe for tokenizers that prepend a space to each
  input (Metaspace with prepend_scheme "always"/"first", a `Prepend` normaliser, ByteLevel with add_prefix_space):
  the piece after the cut would get one, and their vocabularies hold tokens such as "\\nW".
- "space": right before a single space between two non-space characters. Safe for all of those: a piece that starts
  with a space gets no prefix, and each of those pre-tokenizers starts a pre-token at such a space.
- "any": anywhere (the byte tokenizer).

`rule_for(tokenizer)` reads which kinds can apply from the tokenizer itself (its normaliser, pre-tokenizer and added
tokens), then checks each on a probe text cut at every point of that kind: the pieces must encode to the ids of the
whole text, or that kind is dropped. With no kind left, documents are encoded whole. A document with no safe point
in MAX_PIECE_CHARS characters is cut there anyway (a "forced" cut, counted: near it the ids may differ from whole-
document encoding); the cut is never recorded as safe.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

PIECE_CHARS = 8192
MAX_PIECE_CHARS = 1 << 24

LINE = re.compile(r"\n(?=\S)")  # the cut is at the match's end
SPACE = re.compile(r"(?<=\S) (?=\S)")  # the cut is at the match's start (the space begins the next piece)


@dataclass(frozen=True)
class CutRule:
    """The kinds of cut point that are safe for one tokenizer."""

    line: bool
    space: bool
    anywhere: bool = False

    @property
    def name(self) -> str:
        if self.anywhere:
            return "any"
        kinds = [k for k, on in (("line", self.line), ("space", self.space)) if on]
        return "+".join(kinds) or "none"

    @classmethod
    def from_name(cls, name: str) -> CutRule:
        if name == "any":
            return cls(True, True, True)
        kinds = set(name.split("+")) - {"none"}
        return cls("line" in kinds, "space" in kinds)


LINES_ONLY = CutRule(line=True, space=False)  # what rwkvx cut at before tokenizer families were told apart


def cut_text(
    text: str, rule: CutRule, size: int = PIECE_CHARS, max_chars: int = MAX_PIECE_CHARS, final: bool = True
) -> tuple[list[tuple[int, str]], int]:
    """The piece ends decided in `text`: (offsets, each with its kind "line", "space", "any" or "forced"), and where
    the undecided rest starts.

    From each piece start p: the last line cut in [p + 2, p + size], else the first one up to p + max_chars (a piece
    longer than `size`), else the last space cut in (p, p + size], else the first up to p + max_chars, else a forced
    cut at p + max_chars. (A line cut at p + 1 would make a piece of a lone newline.) Each decision reads at most
    max_chars + 1 characters past p, so with `final` False (more text follows) the cuts are the same as the whole
    text's, whatever the text was read in: the rest (never longer than max_chars + size) waits for more text. With
    `final`, the rest is the document's last piece. The forward searches remember what they found, so a long run
    without a cut point is scanned once, not once per piece.
    """
    n = len(text)
    size = max(1, min(size, max_chars))
    lines = _Next(LINE, text, 1) if rule.line else None
    spaces = _Next(SPACE, text, 0) if rule.space else None
    cuts: list[tuple[int, str]] = []
    p = 0
    while n - p > size:
        cut = kind = None
        if lines is not None:
            first = lines.at_or_after(p + 2)
            if first is not None and first <= p + size:
                cut, kind = _last_line_cut(text, p + 2, p + size), "line"
            elif first is not None and first <= p + max_chars:
                cut, kind = first, "line"
        if cut is None:
            if not final and n <= p + max_chars + 1:
                break  # a line or space cut may still come within max_chars
            cut, kind = _fine_cut(text, p, size, max_chars, rule, spaces)
            if kind == "forced" and cut >= n:
                break  # the rest fits in one piece
        cuts.append((cut, kind))
        p = cut
    return cuts, (len(text) if final else p)


class _Next:
    """The first match of `pattern` (its cut: the match's end when `at_end`, else its start) at or after a position,
    for positions that only grow: one scan of the text in all."""

    def __init__(self, pattern: re.Pattern, text: str, at_end: int):
        self.pattern, self.text, self.at_end = pattern, text, at_end
        self.since = 0  # `found` is the first cut at or after `since` (None: there is none)
        self.found: int | None = None
        self.valid = False

    def at_or_after(self, pos: int) -> int | None:
        if self.valid and self.since <= pos and (self.found is None or self.found >= pos):
            return self.found
        # A line cut c has its newline at c - 1; a space cut is the space itself.
        m = self.pattern.search(self.text, max(0, pos - self.at_end))
        self.since, self.valid = pos, True
        self.found = (m.end() if self.at_end else m.start()) if m is not None else None
        return self.found


def _last_line_cut(text: str, lo: int, hi: int) -> int:
    """The last line cut in [lo, hi] (the caller knows there is one)."""
    i = text.rfind("\n", lo - 1, hi)
    while not (i + 1 < len(text) and not text[i + 1].isspace()):
        i = text.rfind("\n", lo - 1, i)
    return i + 1


def _fine_cut(text: str, p: int, size: int, max_chars: int, rule: CutRule, spaces: _Next | None) -> tuple[int, str]:
    """A cut where no line cut is within max_chars of p (the caller has the text to p + max_chars + 1, or all)."""
    if rule.anywhere:
        return p + size, "any"
    if spaces is not None:
        first = spaces.at_or_after(p + 1)
        if first is not None and first <= p + size:
            i = text.rfind(" ", p + 1, p + size + 1)
            while not (not text[i - 1].isspace() and i + 1 < len(text) and not text[i + 1].isspace()):
                i = text.rfind(" ", p + 1, i)
            return i, "space"
        if first is not None and first <= p + max_chars:
            return first, "space"
    return p + max_chars, "forced"


def split_pieces(text: str, size: int | None = None, rule: CutRule = LINES_ONLY) -> list[str]:
    """`text` cut at `rule`'s safe points into pieces of about `size` characters (longer where there is none)."""
    cuts, _ = cut_text(text, rule, size or PIECE_CHARS)
    bounds = [0, *(c for c, _ in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


# -- deciding the rule of a tokenizer --------------------------------------------------------------------------------

_PROBE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
    "  indented line\n\tTabbed line\r\nWindows line end\r\n"
    "Numbers 12345 67 8.9, 1,000,000 and 2024-01-02.\n"
    "Punctuation!\nQuestion?\n(Parenthesis) [bracket] {brace} \"quote\" 'single' it's we'll.\n"
    "def f(x):\n    return x ** 2  # comment\nif a == b: print('yes')\n"
    "東京は日本の首都です。\n中文，标点。\n…\nNext line after ellipsis\n"
    "Emoji 🚀 rocket 🙂 smile\nnaïve café ünïcödé — dash – en\n"
    "URL https://example.com/a?b=c&d=e and e-mail a.b@c.de\n"
    "Wide  double  spaces and   triple,\nWord\nW\nLine ending with space \nnext\n"
    "▁ a metaspace mark ▁word and ▁▁ two\n<|eod|> <s> </s> [CLS] literal specials\n"
    "ALL CAPS LINE\nMixedCase camelCase snake_case kebab-case\n"
    "Ellipsis… and fullwidth　space here\nLast line without newline"
)
PROBE_TEXT = (_PROBE + "\n") * 3 + "The end."


def rule_for(tokenizer) -> CutRule:
    """The safe cut kinds of `tokenizer` (a ByteTokenizer, WorldTokenizer or BPETokenizer): from its structure,
    then each kind checked on PROBE_TEXT (see the module docstring)."""
    kind = getattr(tokenizer, "kind", None)
    if kind == "byte":
        return CutRule(True, True, True)
    line, space = True, True
    if kind == "bpe":
        line, space = _hf_candidates(json.loads(tokenizer.to_json()))
    return CutRule(line and _safe_on_probe(tokenizer, LINE, "end"), space and _safe_on_probe(tokenizer, SPACE, "start"))


def _hf_candidates(spec: dict) -> tuple[bool, bool]:
    """(line, space) cuts that a HuggingFace tokenizer.json's normaliser, pre-tokenizer and added tokens allow."""
    prefix = _prepends(spec.get("normalizer")) or _prepends(spec.get("pre_tokenizer"))
    line, space = not prefix, True
    for added in spec.get("added_tokens") or []:
        content = added.get("content", "") if isinstance(added, dict) else ""
        line = line and LINE.search(content) is None  # an added token is matched across any cut point
        space = space and SPACE.search(content) is None
    return line, space


def _prepends(part) -> bool:
    """Whether a normaliser or pre-tokenizer adds something at the start of every input (a SentencePiece prefix)."""
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    if kind == "Sequence":
        items = part.get("normalizers") or part.get("pretokenizers") or []
        return any(_prepends(p) for p in items)
    if kind == "Prepend":
        return bool(part.get("prepend"))
    if kind == "Metaspace":
        scheme = part.get("prepend_scheme")
        return scheme in ("always", "first") if scheme is not None else bool(part.get("add_prefix_space", True))
    if kind == "ByteLevel":
        return bool(part.get("add_prefix_space"))
    return False


def _safe_on_probe(tokenizer, pattern: re.Pattern, where: str) -> bool:
    """The probe text cut at every `pattern` point encodes piece by piece to the whole text's ids."""
    cuts = [m.end() if where == "end" else m.start() for m in pattern.finditer(PROBE_TEXT)]
    bounds = [0, *cuts, len(PROBE_TEXT)]
    pieces = [PROBE_TEXT[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = tokenizer.encode_arrays([PROBE_TEXT])[0].tolist()
    parts = [i for a in tokenizer.encode_arrays(pieces) for i in a.tolist()]
    return parts == whole
