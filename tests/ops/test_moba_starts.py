"""moba with document starts and a cache: packed rows with cached tokens and their starts equal
the documents run from an empty cache, pieces carrying cache_starts equal one call, bad cache_starts
are one-line errors (the registry test tests/ops/test_doc_starts.py runs a case without a cache)."""

import pytest
import torch

from rwkvx_cli.ops import get_op
from rwkvx_cli.ops.moba import moba

SPEC = get_op("moba")
BACKENDS = ["reference", *(bk.name for bk in SPEC.production_backends())]


def _mask(rows, length):
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, times in enumerate(rows):
        mask[b, list(times)] = True
    return mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "T,P,c,top_k,starts,cache_starts",
    [
        (37, 13, 4, 2, [(0, 5, 13, 14, 36), (15, 32), ()], [(2,), (6,), ()]),
        (37, 13, 8, 1, [(5, 16, 17), (), (36,)], [(12,), (0,), (3, 7)]),  # a start at the cache's last token
        (40, 9, 3, 0, [(1, 2, 3, 20), (31,), (0,)], [(8,), (), ()]),  # every earlier chunk
        (1, 21, 4, 2, [(0,), (), ()], [(5,), (20,), ()]),  # one token (a generation step)
    ],
)
def test_packed_rows_with_a_cache_equal_their_documents_from_an_empty_cache(
    backend, T, P, c, top_k, starts, cache_starts
):
    """Each document of each row, run alone from an empty cache (the first one after the cache's live
    part, its own keys as a cache), gives the packed call's outputs and gradients: the cache's dead part
    gets none."""
    g = torch.Generator().manual_seed(0)
    B, H, N = 3, 2, 8
    q, k, v = (torch.randn(B, T, H, N, generator=g, dtype=torch.float64) for _ in range(3))
    kc, vc = (torch.randn(B, P, H, N, generator=g, dtype=torch.float64) for _ in range(2))
    cot = torch.randn(B, T, H, N, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, kc, vc)]
    y, _ = moba(
        *leaves[:3],
        tuple(leaves[3:]),
        chunk_size=c,
        top_k=top_k,
        starts=_mask(starts, T),
        cache_starts=_mask(cache_starts, P),
        backend=backend,
    )
    (y * cot).sum().backward()
    for b in range(B):
        keys, values = (torch.cat([x[b : b + 1], y_[b : b + 1]], 1) for x, y_ in ((kc, k), (vc, v)))
        cuts = sorted({0, *cache_starts[b], *(P + t for t in starts[b]), P + T})
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=False):
            if hi <= P:
                continue  # a document of the cache that ended before the window
            first = max(lo, P)
            doc = [
                t.clone().requires_grad_() for t in (q[b : b + 1, first - P : hi - P], keys[:, lo:hi], values[:, lo:hi])
            ]
            n = first - lo  # its tokens in the cache
            out, _ = moba(
                doc[0],
                doc[1][:, n:],
                doc[2][:, n:],
                (doc[1][:, :n], doc[2][:, :n]),
                chunk_size=c,
                top_k=top_k,
                backend=backend,
            )
            (out * cot[b : b + 1, first - P : hi - P]).sum().backward()
            torch.testing.assert_close(y[b : b + 1, first - P : hi - P].detach(), out.detach(), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(
                leaves[0].grad[b : b + 1, first - P : hi - P], doc[0].grad, rtol=1e-10, atol=1e-12
            )
            for whole, cache, grad in ((leaves[1], leaves[3], doc[1].grad), (leaves[2], leaves[4], doc[2].grad)):
                got = torch.cat([cache.grad[b : b + 1], whole.grad[b : b + 1]], 1)[:, lo:hi]
                torch.testing.assert_close(got, grad, rtol=1e-10, atol=1e-12)
        dead = P if 0 in starts[b] else max([0, *cache_starts[b]])  # the cached tokens no query reads
        assert not leaves[3].grad[b, :dead].any() and not leaves[4].grad[b, :dead].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c,top_k", [(4, 2), (5, 1), (3, 0)])
def test_pieces_with_the_cache_starts_carried_equal_one_call(backend, c, top_k):
    """A window with starts read in pieces, each given the starts read so far as `cache_starts`,
    gives the outputs and gradients of one call (pieces ending inside, at and after documents)."""
    g = torch.Generator().manual_seed(1)
    B, T, H, N = 3, 50, 2, 8
    x = [torch.randn(B, T, H, N, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]
    starts = _mask([(0, 7, 8, 20, 33, 49), (12, 16, 40), ()], T)
    cot = torch.randn(B, T, H, N, generator=g, dtype=torch.float64)
    whole, _ = moba(*x, chunk_size=c, top_k=top_k, starts=starts, backend=backend)
    want = torch.autograd.grad((whole * cot).sum(), x)
    for cuts in ([13], [7, 8, 9, 30], list(range(1, T))):
        pieces, state, lo = [], None, 0
        for hi in [*cuts, T]:
            part, state = moba(
                *(t[:, lo:hi] for t in x),
                state,
                chunk_size=c,
                top_k=top_k,
                starts=starts[:, lo:hi],
                cache_starts=starts[:, :lo],
                backend=backend,
            )
            pieces.append(part)
            lo = hi
        got = torch.autograd.grad((torch.cat(pieces, 1) * cot).sum(), x)
        torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-10, atol=1e-12)
        for name, a, b in zip("qkv", got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"d{name}")


def test_bad_cache_starts_raise_value_error():
    q, k, v = (torch.zeros(2, 4, 1, 2) for _ in range(3))
    cache = (torch.zeros(2, 3, 1, 2), torch.zeros(2, 3, 1, 2))
    for bad, message in (
        (torch.zeros(2, 3), "bool"),
        (torch.zeros(2, 4, dtype=torch.bool), r"shape \(2, 3\)"),
        ([[True]], "torch.Tensor"),
    ):
        with pytest.raises(ValueError, match=f"cache_starts.*{message}"):
            moba(q, k, v, cache, chunk_size=2, top_k=1, cache_starts=bad)
    with pytest.raises(ValueError, match=r"cache_starts must have shape \(2, 0\)"):
        moba(q, k, v, chunk_size=2, top_k=1, cache_starts=torch.zeros(2, 3, dtype=torch.bool))
