"""The model with document starts (LM.forward(..., starts=...)): a window of packed documents gives
the logits, the loss and every parameter's gradient that the documents give run one by one, each
from the zero state, for every layer kind and hybrids with MoBA, fused and unfused, with grad_cp and
chunked BPTT, and read in pieces with the state carried; in fp64 to 1e-10."""

from dataclasses import replace

import pytest
import torch

from rwkvx_cli.config import LAYER_KINDS, ModelConfig
from rwkvx_cli.models import build_model

BASE = ModelConfig(vocab_size=97, n_layer=2, n_embd=32, head_size=16)
KINDS = {  # every layer kind, and hybrids (test_every_layer_kind_is_checked)
    "rwkv7": {},
    "rwkv7_unfused": {"fused": False},
    "gdn_kda": {"layers": ["gdn", "kda"]},
    "hybrid": {"layers": ["rwkv7", "moba", "rwkv7"], "moba_chunk": 4, "moba_top_k": 1},
    "hybrid_top0": {"layers": ["moba", "rwkv7", "moba"], "moba_chunk": 3, "moba_top_k": 0, "fused": False},
    "rwkv8_rwkv7": {"layers": ["rwkv8", "rwkv7"]},
    "rwkv4": {"layers": ["rwkv4"]},
    "rwkv4_unfused": {"layers": ["rwkv4"], "fused": False},
}
B, T = 2, 29
STARTS = ((0, 5, 6, 13, 28), (11,))  # row 0: first token, back to back, last token; row 1: one start


def _model(kind: str):
    model = build_model(replace(BASE, **KINDS[kind]), 0).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the init zeroes the output projections: perturb, so every block acts
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _starts() -> torch.Tensor:
    mask = torch.zeros(B, T, dtype=torch.bool)
    for row, times in enumerate(STARTS):
        mask[row, list(times)] = True
    return mask


def _documents(row: int) -> list[tuple[int, int]]:
    cuts = sorted({0, *STARTS[row], T})
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _packed_and_apart(model, idx, targets, **options):
    """(loss, logits, grads) of the packed window with starts, and of its documents run apart."""
    starts = _starts()
    if options.get("chunk_len"):
        loss, _ = model(idx, targets=targets, starts=starts, **options)
        logits = None
    else:
        logits, _ = model(idx, starts=starts)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    packed = (loss.detach(), None if logits is None else logits.detach(), _grads(model))

    total = 0.0
    pieces = torch.zeros_like(packed[1]) if logits is not None else None
    for row in range(B):
        for lo, hi in _documents(row):
            lg, _ = model(idx[row : row + 1, lo:hi])
            part = torch.nn.functional.cross_entropy(
                lg.reshape(-1, lg.shape[-1]), targets[row, lo:hi], reduction="sum"
            ) / (B * T)
            part.backward()
            total += part.detach()
            if pieces is not None:
                pieces[row : row + 1, lo:hi] = lg.detach()
    return packed, (total, pieces, _grads(model))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["plain", "grad_cp", "chunked"])
def test_packed_documents_train_as_documents_apart(kind, mode):
    model = _model(kind)
    model.grad_checkpointing = mode == "grad_cp"
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 97, (B, T), generator=gen)
    targets = torch.randint(0, 97, (B, T), generator=gen)
    options = {"chunk_len": 8} if mode == "chunked" else {}
    (loss, logits, grads), (loss_apart, logits_apart, grads_apart) = _packed_and_apart(model, idx, targets, **options)
    torch.testing.assert_close(loss, torch.as_tensor(loss_apart, dtype=loss.dtype), rtol=1e-10, atol=1e-10)
    if logits is not None:
        torch.testing.assert_close(logits, logits_apart, rtol=1e-10, atol=1e-10)
    assert grads.keys() == grads_apart.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_apart[name], rtol=1e-10, atol=1e-10, msg=name)


def test_every_layer_kind_is_checked():
    checked = {k for spec in KINDS.values() for k in spec.get("layers", ["rwkv7"])}
    assert checked == set(LAYER_KINDS)


def test_without_starts_the_documents_leak_into_each_other():
    """The check above can fail: run packed without starts, the same window differs."""
    model = _model("rwkv7")
    idx = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with_starts, _ = model(idx, starts=_starts())
        without, _ = model(idx)
    assert (with_starts[1, 11:] - without[1, 11:]).abs().max() > 1e-3
    torch.testing.assert_close(with_starts[1, :11], without[1, :11])  # before row 1's only start: the same


@pytest.mark.parametrize("kind", ["gdn_kda", "hybrid"])
def test_a_state_carried_into_the_window_is_dropped_at_its_first_start(kind):
    model = _model(kind)
    gen = torch.Generator().manual_seed(4)
    first, second = (torch.randint(0, 97, (B, T), generator=gen) for _ in range(2))
    with torch.no_grad():
        _, state = model(first)
        starts = torch.zeros(B, T, dtype=torch.bool)
        starts[:, 0] = True
        carried, _ = model(second, state, starts=starts)
        fresh, _ = model(second)
    torch.testing.assert_close(carried, fresh, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_top0"])
@pytest.mark.parametrize("grad", [False, True])
def test_pieces_with_the_state_carried_equal_the_whole_window(kind, grad):
    """The window with starts, read in pieces (the state carried, MoBA's cache and its starts with
    it), gives the logits of one whole read: pieces ending inside documents and on starts."""
    model = _model(kind)
    idx = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(5))
    with torch.set_grad_enabled(grad):
        whole, _ = model(idx, starts=_starts())
        for cuts in ([6, 13], [1, 2, 3, 9, 20, 27], list(range(1, T))):
            pieces, state, lo = [], None, 0
            for hi in [*cuts, T]:
                lg, state = model(idx[:, lo:hi], state, starts=_starts()[:, lo:hi])
                pieces.append(lg)
                lo = hi
            torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-10, atol=1e-10)


def test_pieces_without_starts_then_with():
    """A state read without starts gets its cache's starts (none) when a later piece has some."""
    model = _model("hybrid")
    idx = torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(6))
    starts = _starts()
    starts[:, :10] = False
    with torch.no_grad():
        whole, _ = model(idx, starts=starts)
        first, state = model(idx[:, :10])
        second, _ = model(idx[:, 10:], state, starts=starts[:, 10:])
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-10, atol=1e-10)
