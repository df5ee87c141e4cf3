"""rwkvx's safetensors reader against the format's own library (issue 36), by property: valid files,
then mutated headers (types, offsets, overlaps, gaps, duplicate names, dtypes, shapes, metadata, raw
JSON). rwkvx's reader (tensors.SafetensorsFiles, which parses the header itself) accepts exactly what
`safetensors.safe_open` accepts, and returns the same names, dtypes, shapes, bytes and metadata, but
for two refusals on purpose: a key written twice in one object (safetensors keeps the last silently)
and the dtypes rwkvx does not read (8-bit floats, wide unsigned integers). Every refusal is a
one-line FormatError, never another exception. (config.json against fla: test_differential_config.py.)

`make test` runs a few hundred examples; `make test-slow` (CI) thousands.
"""

import json
import math
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from rwkvx_cli.formats.errors import FormatError
from rwkvx_cli.formats.tensors import ST_OTHER_DTYPES, SafetensorsFiles

FAST = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))

# -- safetensors ---------------------------------------------------------------------------------

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
NAMES = st.text(alphabet=st.sampled_from("abc.0_é🙂"), min_size=0, max_size=6)


@st.composite
def valid_file(draw):
    """(header object, data bytes) of a valid safetensors file, its header order shuffled."""
    names = draw(st.lists(NAMES.filter(lambda n: n != "__metadata__"), max_size=5, unique=True))
    tensors = []
    for name in names:
        dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        n = math.prod(shape) * ITEMSIZE[dtype]
        tensors.append((name, dtype, shape, draw(st.binary(min_size=n, max_size=n))))
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    order = draw(st.permutations(list(header)))
    header = {k: header[k] for k in order}
    if draw(st.booleans()):
        header = {"__metadata__": draw(st.dictionaries(NAMES, NAMES, max_size=3)), **header}
    return header, data


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.lists(st.integers(-3, 10), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@st.composite
def mutated_file(draw):
    """(raw header bytes, data) after 0-3 mutations of a valid file."""
    header, data = draw(valid_file())
    names = [k for k in header if k != "__metadata__"]
    raw_edits = []
    for _ in range(draw(st.integers(0, 3))):
        if not isinstance(header, dict):  # replaced by a non-object: nothing left to edit
            break
        kind = draw(
            st.sampled_from(
                [
                    "field",
                    "offsets",
                    "overlap",
                    "gap",
                    "trailing",
                    "truncate",
                    "dtype",
                    "shape",
                    "metadata",
                    "entry",
                    "extra",
                    "delete",
                    "duplicate",
                    "raw",
                    "not-object",
                ]
            )
        )
        per_name = ("field", "offsets", "overlap", "dtype", "shape", "entry", "extra", "delete", "duplicate")
        if kind in per_name and not names:
            continue
        name = draw(st.sampled_from(names)) if names else None
        entry = header.get(name) if name is not None else None
        if kind in ("field", "offsets", "overlap", "dtype", "shape", "extra", "delete") and not isinstance(entry, dict):
            continue
        if kind == "field":
            entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(JUNK)
        elif kind == "offsets":
            was = entry.get("data_offsets")
            b, e = (was + [0, 0])[:2] if isinstance(was, list) else (0, 0)
            b, e = (b if isinstance(b, int) else 0), (e if isinstance(e, int) else 0)
            d = draw(st.integers(-9, 9))
            entry["data_offsets"] = draw(st.sampled_from([[b + d, e + d], [b, e + d], [e, b], [b], [b, e, e]]))
        elif kind == "overlap":
            other = header.get(draw(st.sampled_from(names)))
            if isinstance(other, dict):
                entry["data_offsets"] = other.get("data_offsets")
        elif kind == "gap":
            k = draw(st.integers(1, 9))
            for n in names:
                info = header.get(n)
                if isinstance(info, dict) and isinstance(info.get("data_offsets"), list):
                    info["data_offsets"] = [x + k if isinstance(x, int) else x for x in info["data_offsets"]]
            data = bytes(k) + data
        elif kind == "trailing":
            data += draw(st.binary(min_size=1, max_size=5))
        elif kind == "truncate":
            data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
        elif kind == "dtype":
            entry["dtype"] = draw(st.sampled_from([*ITEMSIZE, *ST_OTHER_DTYPES, "f32", "F128", "", "BF8"]))
        elif kind == "shape":
            entry["shape"] = draw(
                st.one_of(
                    st.lists(st.integers(-2, 5), max_size=3),
                    st.lists(st.sampled_from([2**64 - 1, 2**64, 2**63 - 1, 2**63, 2**62, 2**32, 4, 0]), max_size=3),
                    st.lists(st.sampled_from([1.0, True, "2", None]), min_size=1, max_size=2),
                )
            )
        elif kind == "metadata":
            header["__metadata__"] = draw(
                st.one_of(JUNK, st.dictionaries(NAMES, st.one_of(NAMES, st.integers(), st.none()), max_size=2))
            )
        elif kind == "entry":
            header[name] = draw(JUNK)
        elif kind == "extra":
            entry[draw(st.text(max_size=3))] = draw(JUNK)
        elif kind == "delete":
            del entry[draw(st.sampled_from(sorted(entry)))]
        elif kind == "duplicate":
            raw_edits.append(("duplicate", name, draw(st.sampled_from(names))))
        elif kind == "raw":
            raw_edits.append(("raw", draw(st.sampled_from(["NaN", "Infinity", '"\\ud800"', "1e400", "-0"])), None))
        elif kind == "not-object":
            header = draw(st.sampled_from([[], "x", 3, None]))
    text = json.dumps(header, ensure_ascii=draw(st.booleans()))
    for what, a, b in raw_edits:
        if not text.endswith("}") or text == "{}":
            continue
        if what == "duplicate":  # a second entry under name a, with b's entry
            other = header.get(b) if isinstance(header, dict) else None
            text = text[:-1] + f", {json.dumps(a)}: {json.dumps(other)}}}"
        elif what == "raw":  # a token Python's json takes and serde_json does not (or does)
            text = text[:-1] + f', "zz": {{"dtype": "F32", "shape": [], "data_offsets": [0, {a}]}}}}'
    raw = text.encode("utf-8", errors="surrogatepass") + b" " * draw(st.integers(0, 7))
    return raw, data


def _write(path, raw: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _theirs(path):
    try:
        with safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception:  # noqa: BLE001 - any refusal of the library's is a refusal
        return None


def _ours(path):
    try:
        source = SafetensorsFiles([path])
    except FormatError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)
        return None
    with source:
        return {k: source.get(k).clone() for k in source.names()}, source.metadata


def _duplicate_key(raw: bytes) -> bool:
    found = []

    def hook(pairs):
        keys = [k for k, _ in pairs]
        found.append(len(keys) != len(set(keys)))
        return dict(pairs)

    try:
        json.loads(raw.decode("utf-8"), object_pairs_hook=hook)
    except (ValueError, RecursionError):
        return False
    return any(found)


def _other_dtype(raw: bytes) -> bool:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return False
    return isinstance(header, dict) and any(
        isinstance(v, dict) and v.get("dtype") in ST_OTHER_DTYPES for k, v in header.items() if k != "__metadata__"
    )


def _bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bool:  # a copy may store any non-zero byte as 1
        t = t.view(torch.uint8) != 0
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_same_as_safetensors(path, raw: bytes, data: bytes) -> None:
    _write(path, raw, data)
    ours, theirs = _ours(path), _theirs(path)
    if ours is None:
        if theirs is not None:  # refused on purpose only: duplicate keys, dtypes rwkvx does not read
            assert _duplicate_key(raw) or _other_dtype(raw), raw
        return
    assert theirs is not None, raw  # never accept what safetensors refuses
    (mine, meta), (lib, lib_meta) = ours, theirs
    assert mine.keys() == lib.keys() and meta == lib_meta
    for name, t in mine.items():
        assert (t.dtype, t.shape) == (lib[name].dtype, lib[name].shape), name
        assert _bytes(t) == _bytes(lib[name]), name
    assert set(mine) == {k for k in json.loads(raw) if k != "__metadata__"}


@FAST
@given(mutated_file())
def test_safetensors_reader_accepts_what_safetensors_accepts(tmp_path_factory, case):
    check_same_as_safetensors(tmp_path_factory.mktemp("st") / "f.safetensors", *case)


@pytest.mark.slow
@SLOW
@given(mutated_file())
def test_safetensors_reader_accepts_what_safetensors_accepts_long(tmp_path_factory, case):
    check_same_as_safetensors(tmp_path_factory.mktemp("st") / "f.safetensors", *case)


@settings(FAST, max_examples=60)
@given(valid_file())
def test_every_valid_file_reads_as_safetensors_reads_it(tmp_path_factory, case):
    """The unmutated files: both accept (not vacuous: the property above could pass by refusing all)."""
    header, data = case
    path = tmp_path_factory.mktemp("st") / "f.safetensors"
    raw = json.dumps(header).encode()
    check_same_as_safetensors(path, raw, data)
    assert _ours(path) is not None and _theirs(path) is not None


def test_the_divergences_are_the_two_on_purpose(tmp_path):
    """safetensors reads these; rwkvx refuses them in one line."""
    path = tmp_path / "f.safetensors"
    one = '"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    _write(path, ("{" + one + ", " + one + "}").encode(), bytes(4))
    assert _theirs(path) is not None and _ours(path) is None
    _write(path, b'{"a": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}}', bytes(4))
    assert _theirs(path) is not None and _ours(path) is None
    with pytest.raises(FormatError, match="dtype 'F8_E4M3' is a safetensors dtype rwkvx does not read"):
        SafetensorsFiles([path])



@pytest.mark.parametrize(
    "shape,ok",
    [
        ([0, 2**63], False),
        ([0, 2**64 - 1], False),
        ([2**62, 4, 0], False),
        ([2**32, 2**32, 0], False),
        ([0, 2**63 - 1, 2], False),
        ([2**63 - 1, 2, 0], True),
        ([0, 2**62, 2, 2], True),
    ],
)
def test_zero_size_shapes_at_64_bits_read_as_safetensors_reads_them(tmp_path, shape, ok):
    """Sizes past torch's int64 or a running product past 64 bits: safetensors refuses them, at the
    header or when it makes the tensor; rwkvx when the file is opened, never when a tensor is read."""
    path = tmp_path / "f.safetensors"
    _write(path, json.dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode(), b"")
    assert (_theirs(path) is not None) == ok
    if ok:
        check_same_as_safetensors(path, path.read_bytes()[8:], b"")
    else:
        with pytest.raises(FormatError, match="overflows 64-bit sizes"):
            SafetensorsFiles([path])
