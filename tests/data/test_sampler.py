import numpy as np
import pytest
import torch

from rwkvx_cli.data import DataError, WindowSampler, sequential_windows


def test_batch_shapes_and_shift():
    tokens = np.arange(1000, dtype=np.uint16)
    s = WindowSampler(tokens, ctx_len=16, batch_size=8, seed=3)
    x, y = s.batch(0)
    assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, x + 1)  # arange tokens: each window is contiguous
    assert int(x.min()) >= 0 and int(y.max()) <= 999


def test_reproducible_from_seed_and_step():
    tokens = np.random.default_rng(0).integers(0, 50000, size=5000).astype(np.uint16)
    a = WindowSampler(tokens, 32, 6, seed=7)
    b = WindowSampler(tokens, 32, 6, seed=7)
    for step in (0, 1, 123):
        assert torch.equal(a.batch(step)[0], b.batch(step)[0])
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])
    assert not torch.equal(a.batch(0)[0], WindowSampler(tokens, 32, 6, seed=8).batch(0)[0])
    # Order of calls does not matter: step 5 is the same whether drawn first or after others.
    assert torch.equal(WindowSampler(tokens, 32, 6, seed=7).batch(5)[0], a.batch(5)[0])


def test_ranks_interleave_the_global_batch():
    tokens = np.random.default_rng(1).integers(0, 1000, size=3000).astype(np.int32)
    s = WindowSampler(tokens, 8, 6, seed=0)
    x, y = s.batch(4)
    x0, y0 = s.batch(4, rank=0, world_size=2)
    x1, y1 = s.batch(4, rank=1, world_size=2)
    assert x0.shape == (3, 8)
    assert torch.equal(x[0::2], x0) and torch.equal(x[1::2], x1)
    assert torch.equal(y[0::2], y0) and torch.equal(y[1::2], y1)
    inter = torch.stack([x0, x1], dim=1).reshape(6, 8)
    assert torch.equal(inter, x)
    with pytest.raises(ValueError, match="not divisible"):
        s.batch(0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank 2"):
        s.batch(0, rank=2, world_size=2)


def test_windows_reach_both_ends():
    tokens = np.arange(12, dtype=np.uint16)
    s = WindowSampler(tokens, ctx_len=10, batch_size=64, seed=0)
    starts = s.starts(0)
    assert set(starts.tolist()) == {0, 1}  # the only full windows of 11 tokens


def test_corpus_too_short():
    with pytest.raises(DataError, match="has 16 tokens, fewer than one window of ctx_len \\+ 1 = 17"):
        WindowSampler(np.arange(16), ctx_len=16, batch_size=1)
    WindowSampler(np.arange(17), ctx_len=16, batch_size=1).batch(0)


def test_sequential_windows_cover_once():
    tokens = np.arange(23, dtype=np.uint16)
    wins = list(sequential_windows(tokens, 5))
    assert [tuple(x.shape) for x, _ in wins] == [(1, 5)] * 4 + [(1, 2)]
    xs = torch.cat([x[0] for x, _ in wins])
    ys = torch.cat([y[0] for _, y in wins])
    assert ys.tolist() == list(range(1, 23))  # every target exactly once
    assert torch.equal(xs + 1, ys)
    assert len(list(sequential_windows(np.arange(21), 5))) == 4  # 20 targets, no empty tail window
    with pytest.raises(DataError, match="at least 2"):
        list(sequential_windows(np.arange(1), 5))


def test_float_tokens_are_bad_data():
    with pytest.raises(DataError, match="token ids must be integers, got float32"):
        WindowSampler(np.zeros(100, dtype=np.float32), 8, 2)
