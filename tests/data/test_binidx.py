import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rwkvx_cli.data import BinIdx, BinIdxWriter, DataError, RawTokens, dtype_for_vocab, open_tokens, write_binidx
from rwkvx_cli.data.binidx import MAGIC, binidx_paths


def _docs(rng, high, sizes=(5, 1, 17, 0, 9)):
    return [rng.integers(0, high, size=n) for n in sizes]


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65536), (np.int32, 2**31 - 1)])
def test_round_trip_exact(tmp_path, dtype, high):
    docs = _docs(np.random.default_rng(1), high)
    sizes = write_binidx(tmp_path / "x", docs, dtype)
    assert sizes.tolist() == [5, 1, 17, 0, 9]
    data = BinIdx(tmp_path / "x")
    assert data.dtype == np.dtype(dtype)
    assert data.doc_sizes.tolist() == [5, 1, 17, 0, 9]
    assert len(data) == 32 and data.n_docs == 5
    np.testing.assert_array_equal(data.tokens, np.concatenate(docs))
    assert data.tokens.dtype == np.dtype(dtype)
    # The same pair opens from either file name, and through open_tokens.
    np.testing.assert_array_equal(BinIdx(tmp_path / "x.bin").tokens, data.tokens)
    np.testing.assert_array_equal(open_tokens(tmp_path / "x.idx").tokens, data.tokens)
    np.testing.assert_array_equal(open_tokens(tmp_path / "x").tokens, data.tokens)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin", "x.idx"]  # no temp files left


def test_layout_matches_megatron_spec(tmp_path):
    docs = [np.array([3, 1, 4, 0]), np.array([1, 5, 0]), np.array([9, 2, 6, 5, 0])]
    write_binidx(tmp_path / "d", docs, np.uint16)
    idx = (tmp_path / "d.idx").read_bytes()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, n, m = struct.unpack_from("<QBQQ", idx, 9)
    assert (version, code, n, m) == (1, 8, 3, 4)
    off = 9 + 8 + 1 + 8 + 8
    assert struct.unpack_from("<3i", idx, off) == (4, 3, 5)
    assert struct.unpack_from("<3q", idx, off + 12) == (0, 8, 14)  # byte pointers
    assert struct.unpack_from("<4q", idx, off + 36) == (0, 1, 2, 3)
    assert len(idx) == off + 36 + 32
    assert (tmp_path / "d.bin").read_bytes() == struct.pack("<12H", 3, 1, 4, 0, 1, 5, 0, 9, 2, 6, 5, 0)

    write_binidx(tmp_path / "w", docs, np.int32)
    assert struct.unpack_from("<B", (tmp_path / "w.idx").read_bytes(), 17) == (4,)
    assert struct.unpack_from("<3q", (tmp_path / "w.idx").read_bytes(), off + 12) == (0, 16, 28)


def test_dtype_for_vocab():
    assert dtype_for_vocab(257) == np.uint16
    assert dtype_for_vocab(65536) == np.uint16  # ids 0..65535, RWKV World
    assert dtype_for_vocab(65537) == np.int32


def test_write_rejects_tokens_that_do_not_fit(tmp_path):
    with pytest.raises(DataError, match="document 0 has token id 70000, which does not fit uint16"):
        write_binidx(tmp_path / "x", [np.array([1, 70000])], np.uint16)
    assert list(tmp_path.iterdir()) == []


def test_empty_dataset(tmp_path):
    write_binidx(tmp_path / "e", [], np.uint16)
    data = BinIdx(tmp_path / "e")
    assert len(data) == 0 and data.n_docs == 0


def _valid(tmp_path):
    write_binidx(tmp_path / "x", [np.arange(1, 11), np.arange(20, 25)], np.uint16)
    return binidx_paths(tmp_path / "x")


def _patch(path, offset, data):
    b = bytearray(path.read_bytes())
    b[offset : offset + len(data)] = data
    path.write_bytes(bytes(b))


def test_missing_files(tmp_path):
    with pytest.raises(DataError, match=r"binidx index not found: .*nope\.idx"):
        BinIdx(tmp_path / "nope")
    bin_path, idx_path = _valid(tmp_path)
    bin_path.unlink()
    with pytest.raises(DataError, match=r"binidx token file not found: .*x\.bin"):
        BinIdx(tmp_path / "x")


def test_bad_magic(tmp_path):
    _, idx = _valid(tmp_path)
    _patch(idx, 0, b"NOTIDX")
    with pytest.raises(DataError, match="not a binidx index .bad magic"):
        BinIdx(tmp_path / "x")


def test_bad_version(tmp_path):
    _, idx = _valid(tmp_path)
    _patch(idx, 9, struct.pack("<Q", 2))
    with pytest.raises(DataError, match="unsupported binidx version 2"):
        BinIdx(tmp_path / "x")


def test_unknown_dtype_code(tmp_path):
    _, idx = _valid(tmp_path)
    _patch(idx, 17, bytes([9]))
    with pytest.raises(DataError, match="unknown dtype code 9"):
        BinIdx(tmp_path / "x")


def test_truncated_idx(tmp_path):
    _, idx = _valid(tmp_path)
    full = idx.read_bytes()
    idx.write_bytes(full[:-5])
    with pytest.raises(DataError, match=r"truncated: 77 bytes, .* needs 82"):
        BinIdx(tmp_path / "x")
    idx.write_bytes(full[:20])
    with pytest.raises(DataError, match="truncated: 20 bytes, shorter than the 34-byte header"):
        BinIdx(tmp_path / "x")
    idx.write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        BinIdx(tmp_path / "x")


def test_truncated_bin(tmp_path):
    bin_path, _ = _valid(tmp_path)
    bin_path.write_bytes(bin_path.read_bytes()[:-4])
    with pytest.raises(DataError, match="truncated: 13 tokens, but .* claims 15"):
        BinIdx(tmp_path / "x")
    bin_path.write_bytes(bin_path.read_bytes()[:-1])
    with pytest.raises(DataError, match="not a multiple of the 2-byte uint16"):
        BinIdx(tmp_path / "x")


def test_bin_longer_than_index(tmp_path):
    bin_path, _ = _valid(tmp_path)
    bin_path.write_bytes(bin_path.read_bytes() + b"\x00\x00")
    with pytest.raises(DataError, match="more than the 15"):
        BinIdx(tmp_path / "x")


def test_inconsistent_pointers(tmp_path):
    _, idx = _valid(tmp_path)
    _patch(idx, 34 + 8 + 8, struct.pack("<q", 18))  # second pointer: should be 10 tokens * 2 bytes
    with pytest.raises(DataError, match="pointer 1 is 18, .* at byte 20"):
        BinIdx(tmp_path / "x")


def test_check_vocab(tmp_path):
    write_binidx(tmp_path / "x", [np.array([1, 2, 3]), np.array([4, 300, 5, 999])], np.uint16)
    data = BinIdx(tmp_path / "x")
    data.check_vocab(1000)
    with pytest.raises(DataError, match=r"token id 300 at position 4 .*size 257"):
        data.check_vocab(257)


def test_check_vocab_scans_in_chunks(tmp_path, monkeypatch):
    import rwkvx_cli.data.binidx as binidx

    monkeypatch.setattr(binidx, "_SCAN_CHUNK", 7)
    tokens = np.zeros(50, dtype=np.int32)
    tokens[37] = -3
    tokens[45] = 1000
    (tmp_path / "t.i32").write_bytes(tokens.tobytes())
    with pytest.raises(DataError, match="token id -3 at position 37"):
        open_tokens(tmp_path / "t.i32").check_vocab(100)


def test_raw_tokens(tmp_path):
    tokens = np.array([5, 0, 65535, 7], dtype=np.uint16)
    (tmp_path / "a.u16").write_bytes(tokens.tobytes())
    raw = open_tokens(tmp_path / "a.u16")
    assert isinstance(raw, RawTokens) and raw.dtype == np.uint16 and len(raw) == 4
    np.testing.assert_array_equal(raw.tokens, tokens)
    (tmp_path / "a.tok").write_bytes(tokens.tobytes())
    np.testing.assert_array_equal(RawTokens(tmp_path / "a.tok", np.int32).tokens, [5, 65535 + (7 << 16)])
    (tmp_path / "b.i32").write_bytes(b"\x01\x00\x00")
    with pytest.raises(DataError, match="not a multiple of the 4-byte int32"):
        open_tokens(tmp_path / "b.i32")
    with pytest.raises(DataError, match="cannot tell the dtype"):
        RawTokens(tmp_path / "a.tok")


def test_open_tokens_unknown(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(DataError, match="unknown token file type"):
        open_tokens(tmp_path / "x.txt")
    with pytest.raises(DataError, match="token file not found"):
        open_tokens(tmp_path / "missing")


@pytest.fixture(scope="module")
def valid_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    write_binidx(d / "x", [np.arange(1, 8), np.arange(3), np.arange(100, 112)], np.uint16)
    return (d / "x.idx").read_bytes(), (d / "x.bin").read_bytes()


def _load_or_data_error(d, idx: bytes, bin_: bytes) -> None:
    (d / "f.idx").write_bytes(idx)
    (d / "f.bin").write_bytes(bin_)
    try:
        data = BinIdx(d / "f")
    except DataError as e:
        assert str(e) and "\n" not in str(e)
        return
    assert len(data.tokens) == int(data.doc_sizes.sum())
    try:
        data.check_vocab(50)
    except DataError:
        pass
    del data


_fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_fuzz
@given(idx=st.binary(max_size=200), bin_=st.binary(max_size=64), keep_magic=st.booleans())
def test_fuzz_random_bytes(tmp_path, idx, bin_, keep_magic):
    if keep_magic:
        idx = MAGIC + struct.pack("<QB", 1, 8) + idx
    _load_or_data_error(tmp_path, idx, bin_)


@_fuzz
@given(data=st.data())
def test_fuzz_mutated_valid_pair(tmp_path, valid_pair, data):
    idx, bin_ = bytearray(valid_pair[0]), bytearray(valid_pair[1])
    for _ in range(data.draw(st.integers(0, 4))):
        pos = data.draw(st.integers(0, len(idx) - 1))
        idx[pos] = data.draw(st.integers(0, 255))
    idx = idx[: data.draw(st.integers(0, len(idx)))]
    bin_ = bin_[: data.draw(st.integers(0, len(bin_)))]
    _load_or_data_error(tmp_path, bytes(idx), bytes(bin_))


def _write_like_rwkv_lm_make_data(prefix, docs: list[list[int]]) -> None:
    """The layout RWKV-LM's make_data.py writes (MMapIndexedDatasetBuilder: one item and end_document per document,
    each ending in 0, uint16), written here with struct, independently of write_binidx."""
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype="<u2").tobytes())
    sizes = [len(d) for d in docs]
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1] * 2]).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8))
        f.write(struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(sizes) + 1))
        f.write(np.asarray(sizes, dtype="<i4").tobytes() + pointers.tobytes())
        f.write(np.arange(len(sizes) + 1, dtype="<i8").tobytes())


def test_rwkv_lm_make_data_prefix_with_world_tokens(tmp_path):
    from rwkvx_cli.data import WorldTokenizer

    tok = WorldTokenizer()
    texts = ["Hello world.", "東京 🚀\n第二行", "x" * 300]
    _write_like_rwkv_lm_make_data(tmp_path / "minipile", [[*tok.encode(t), 0] for t in texts])
    data = open_tokens(tmp_path / "minipile")  # a bare prefix
    assert isinstance(data, BinIdx) and data.dtype == np.uint16 and data.n_docs == 3
    data.check_vocab(65536)
    with pytest.raises(DataError, match="outside the vocabulary \\(size 257\\)"):
        data.check_vocab(257)
    ends = np.cumsum(data.doc_sizes)
    assert [tok.decode(data.tokens[e - n : e]) for n, e in zip(data.doc_sizes, ends, strict=True)] == texts


def test_writer_streams_documents_and_aborts_cleanly(tmp_path):
    with BinIdxWriter(tmp_path / "w", np.uint16) as w:
        w.add(np.arange(10), [3, 0, 7])
        w.add_document(np.array([5, 6], dtype=np.int64))
        sizes = w.commit()
    assert sizes.tolist() == [3, 0, 7, 2]
    data = BinIdx(tmp_path / "w")
    assert data.tokens.tolist() == [*range(10), 5, 6] and data.doc_sizes.tolist() == [3, 0, 7, 2]
    with pytest.raises(DataError, match="document 2 has token id 70000, which does not fit uint16"):
        with BinIdxWriter(tmp_path / "x", np.uint16) as w:
            w.add(np.array([1, 2, 3, 4, 70000]), [2, 2, 1])
    with pytest.raises(ValueError, match="sum to 3, but 4 tokens"):
        with BinIdxWriter(tmp_path / "x", np.uint16) as w:
            w.add(np.arange(4), [1, 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin", "w.idx"]  # nothing half-written is left
