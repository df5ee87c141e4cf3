import numpy as np
import pytest
import torch

from rwkvx_cli.data import DataError, EpochSampler, MixtureSampler, WindowSampler, permute, sequential_windows


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


def test_permute_is_a_seeded_bijection():
    for n in (1, 2, 3, 7, 64, 65, 1000, 4099):
        for seed, epoch in ((0, 0), (5, 3)):
            p = permute(np.arange(n), n, seed, epoch)
            assert sorted(p.tolist()) == list(range(n))
    a = permute(np.arange(1000), 1000, 0, 0)
    assert not np.array_equal(a, permute(np.arange(1000), 1000, 0, 1))  # another epoch, another order
    assert not np.array_equal(a, permute(np.arange(1000), 1000, 1, 0))  # another seed, another order
    assert np.array_equal(a[[7, 3, 999]], permute(np.array([7, 3, 999]), 1000, 0, 0))  # pointwise: a pure function
    assert abs(np.corrcoef(np.arange(1000), a)[0, 1]) < 0.1  # not close to the identity
    with pytest.raises(ValueError, match="in \\[0, 10\\)"):
        permute([10], 10, 0, 0)


def _epoch_windows(sampler, world_size: int, steps: range) -> list[int]:
    """Window starts gathered from every rank's rows, in global row order."""
    rows = []
    for step in steps:
        per_rank = [sampler.batch(step, r, world_size)[0][:, 0] for r in range(world_size)]
        rows += torch.stack(per_rank, dim=1).reshape(-1).tolist()  # row j of the global batch from rank j % N
    return rows


def test_epoch_sampler_visits_every_window_once_per_epoch():
    ctx, batch = 8, 12
    tokens = np.arange(8 * 60 + 1, dtype=np.int32)  # 60 windows, no slack: token value = its position
    s = EpochSampler(tokens, ctx, batch, seed=3)
    assert s.n_windows == 60 and s.slack == 0
    steps_per_epoch = 60 // batch
    for world_size in (1, 2, 3, 4):
        starts = _epoch_windows(s, world_size, range(3 * steps_per_epoch))
        assert starts == [int(v) for step in range(3 * steps_per_epoch) for v in s.starts(step)]
        epochs = [starts[e * 60 : (e + 1) * 60] for e in range(3)]
        for e in epochs:
            assert sorted(e) == list(range(0, 480, 8))  # every full window exactly once
        assert epochs[0] != epochs[1] != epochs[2]  # a new order each epoch
    assert [s.epoch(k) for k in (0, 4, 5, 9, 10)] == [0, 0, 1, 1, 2]
    x, y = s.batch(7)
    assert torch.equal(y, x + 1)


def test_epoch_sampler_straddles_epochs_and_is_a_pure_function():
    tokens = np.random.default_rng(0).integers(0, 1000, size=10 * 37 + 6).astype(np.uint16)
    s = EpochSampler(tokens, 10, 8, seed=1)  # 37 windows, 5 tokens of slack, 8 rows: steps straddle epochs
    assert s.n_windows == 37 and s.slack == 5
    g = s.sample_starts(np.arange(4 * 37))
    for e in range(4):
        part = g[e * 37 : (e + 1) * 37]
        off = int(part.min()) % 10
        assert 0 <= off <= 5 and sorted(part.tolist()) == [off + 10 * k for k in range(37)]
    assert len({int(g[e * 37 : (e + 1) * 37].min()) for e in range(4)}) > 1  # the offset moves between epochs
    fresh = EpochSampler(tokens, 10, 8, seed=1)
    for step in (17, 3, 0, 9):  # any order, any instance
        assert np.array_equal(fresh.starts(step), g[step * 8 : step * 8 + 8])
    assert not np.array_equal(EpochSampler(tokens, 10, 8, seed=2).starts(0), s.starts(0))
    no_shift = EpochSampler(tokens, 10, 8, seed=1, shift=False)
    assert sorted(no_shift.sample_starts(np.arange(37 * 2, 37 * 3)).tolist()) == list(range(0, 370, 10))


def test_mixture_sampler():
    a = np.full(10 * 50 + 1, 1, dtype=np.uint16)  # source 0: 50 windows of ones
    b = np.full(10 * 400 + 1, 2, dtype=np.uint16)  # source 1: 400 windows of twos
    c = np.full(10 * 30 + 1, 3, dtype=np.uint16)  # source 2: weight 0, never drawn
    m = MixtureSampler([a, b, c], [1, 3, 0], ctx_len=10, batch_size=16, seed=0, round_size=64)
    assert m.slots.tolist() == [16, 48, 0] and m.weights.tolist() == [0.25, 0.75, 0.0]
    x = torch.cat([m.batch(step)[0] for step in range(40)])  # 640 rows = 10 rounds
    assert (x[:, 0] == 1).sum() == 160 and (x[:, 0] == 2).sum() == 480 and (x[:, 0] == 3).sum() == 0
    # Source 0 is read one pass per its epoch: its 160 draws are its 50 windows 3.2 times, each at most 4 times.
    source, count = m.sample_sources(np.arange(640))
    assert sorted(count[source == 0].tolist()) == list(range(160))
    starts = np.concatenate([m.starts(step)[1][m.starts(step)[0] == 0] for step in range(40)])
    assert sorted(starts[:50].tolist()) != starts[:50].tolist()  # shuffled
    counts = np.bincount(starts, minlength=501)[0:500:10]
    assert counts.min() == 3 and counts.max() == 4
    # A pure function of (seed, step); ranks interleave as in WindowSampler.
    again = MixtureSampler([a, b, c], [1, 3, 0], ctx_len=10, batch_size=16, seed=0, round_size=64)
    assert torch.equal(again.batch(33)[0], m.batch(33)[0])
    x0, x1 = m.batch(5, 0, 2)[0], m.batch(5, 1, 2)[0]
    assert torch.equal(torch.stack([x0, x1], dim=1).reshape(16, 10), m.batch(5)[0])
    assert m.source_epochs(40) == [3.2, 1.2, 0.0] and m.epoch(40) == 1
    with pytest.raises(DataError, match="at least one source"):
        MixtureSampler([], [], 10, 4)
    with pytest.raises(DataError, match="not all 0"):
        MixtureSampler([a, b], [0, 0], 10, 4)
    with pytest.raises(DataError, match=">= 0"):
        MixtureSampler([a, b], [1, -1], 10, 4)
    with pytest.raises(DataError, match="fewer than one window"):
        MixtureSampler([a, np.arange(5)], [1, 1], 10, 4)
    tiny = MixtureSampler([a, b], [1e-9, 1], 10, 4, round_size=100)
    assert tiny.slots.tolist() == [1, 99]  # a positive weight is never rounded away


def _masked_tokens(n=3000, seed=0):
    """Tokens whose value says whether they carry loss (odd: yes), and that mask."""
    tokens = np.random.default_rng(seed).integers(0, 1000, size=n).astype(np.uint16)
    return tokens, (tokens % 2).astype(np.uint8)


@pytest.mark.parametrize("kind", ["random", "epoch", "stream"])
def test_every_sampler_gives_the_targets_masks_and_the_global_count(kind):
    from rwkvx_cli.data import StreamSampler

    tokens, mask = _masked_tokens()
    make = {"random": WindowSampler, "epoch": EpochSampler, "stream": StreamSampler}[kind]
    s = make(tokens, 24, 8, seed=5, masks=mask)
    for step in (0, 3, 400):  # the stream wraps around; the epoch sampler changes epoch
        x, y = s.batch(step)
        m, count = s.target_masks(step)
        assert m.dtype == torch.bool and m.shape == y.shape
        assert torch.equal(m, y % 2 == 1)  # the targets' mask, not the inputs'
        assert count == int(m.sum())
        rank_rows = [s.target_masks(step, r, 4) for r in range(4)]
        assert all(c == count for _, c in rank_rows)  # every rank knows the global count
        assert torch.equal(torch.stack([m for m, _ in rank_rows], 1).reshape(8, 24), m)
        assert torch.equal(rank_rows[1][0], s.batch(step, 1, 4)[1] % 2 == 1)
    assert make(tokens, 24, 8, seed=5).target_masks(0) is None
    with pytest.raises(DataError, match="a loss mask of 2999 bytes for 3000 tokens"):
        make(tokens, 24, 8, masks=mask[:-1])


def test_mixture_masks_follow_their_source():
    (a, ma), (b, _) = _masked_tokens(2000, 1), _masked_tokens(2500, 2)
    s = MixtureSampler([a, b], [1.0, 3.0], 16, 32, seed=2, round_size=64, masks=[ma, None])
    for step in (0, 7):
        source, _ = s.starts(step)
        _, y = s.batch(step)
        m, count = s.target_masks(step)
        from_a = torch.from_numpy(source == 0)
        assert from_a.any() and (~from_a).any()
        assert torch.equal(m[from_a], y[from_a] % 2 == 1)
        assert m[~from_a].all()  # a source without a mask: every target carries loss
        assert count == int(m.sum())


def test_sequential_windows_with_masks():
    tokens, mask = _masked_tokens(100)
    seen = []
    for _, y, m in sequential_windows(tokens, 16, mask):
        assert torch.equal(m, y % 2 == 1)
        seen.append(m)
    assert sum(s.numel() for s in seen) == 99
