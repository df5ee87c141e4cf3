"""Chunked full BPTT (models/chunked.py): the loss and every parameter gradient of a window run in
chunks equal the unchunked window's (fp64 to 1e-10, fp32 to 1e-5, norm-wise per tensor), for every
layer kind and a hybrid, chunk lengths that do and do not divide the window, from a zero or a
carried state; and a step's memory does not grow with the window."""

import copy
import functools

import pytest
import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models import build_model
from rwkvx_cli.models.chunked import chunk_bounds
from rwkvx_cli.models.losses import micro_batch_loss
from rwkvx_cli.runs.runtime import autocast

V, T = 41, 24
STACKS = {
    "rwkv7": ["rwkv7", "rwkv7"],
    "rwkv4": ["rwkv4"],
    "gdn": ["gdn"],
    "kda": ["kda"],
    "rwkv8": ["rwkv8"],
    # RWKV-X: MoBA attends the keys and values of earlier chunks through its state (chunks of 4
    # tokens, the top 1 earlier chunk: the BPTT chunks of 7 end inside MoBA chunks).
    "hybrid": ["rwkv7", "moba", "rwkv7"],
}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


@functools.cache
def _model(stack: str):
    """A tiny model of the stack, its weights perturbed (init zeroes the output projections, which
    would make every block the identity) by a draw in fp64, so fp32 and fp64 hold the same model."""
    layers = STACKS[stack]
    cfg = ModelConfig(vocab_size=V, n_embd=32, head_size=16, layers=layers, moba_chunk=4, moba_top_k=1)
    model = build_model(cfg, 0).double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def model_of(stack, dtype):
    return copy.deepcopy(_model(stack)).to(dtype)


def batch(B=2, length=T, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, length), generator=gen), torch.randint(0, V, (B, length), generator=gen)


def loss_and_grads(model, x, y, chunk_len, head="chunked", l2wrap=True, state=None):
    model.zero_grad(set_to_none=True)
    loss, new_state = micro_batch_loss(model, x, y, state, head, l2wrap, chunk_len)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, new_state


def worst_error(got, want) -> float:
    """The largest norm-wise relative difference ‖got − want‖ / ‖want‖ over the tensors (a tensor
    whose reference is exactly 0 counts ‖got‖ itself)."""
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).norm() / (want[n].norm() if want[n].norm() > 0 else 1.0)).item() for n in want)


def assert_same(got, want, dtype):
    (loss, grads, _), (ref_loss, ref_grads, _) = got, want
    assert abs(loss - ref_loss).item() <= TOLERANCE[dtype] * abs(ref_loss).item()
    # Nearly every parameter gets a real gradient (not a vacuous comparison of zeros).
    assert sum(g.norm() > 0 for g in ref_grads.values()) >= 0.9 * len(ref_grads) > 0
    err = worst_error(grads, ref_grads)
    assert err <= TOLERANCE[dtype], err
    return err


def test_chunk_bounds():
    assert chunk_bounds(24, 8) == [(0, 8), (8, 16), (16, 24)]
    assert chunk_bounds(24, 7) == [(0, 7), (7, 14), (14, 21), (21, 24)]
    assert chunk_bounds(5, 9) == [(0, 5)]
    with pytest.raises(ValueError, match="chunk_len"):
        chunk_bounds(5, 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_len", [8, 7])  # divides the window of 24 / does not (7, 7, 7, 3)
@pytest.mark.parametrize("stack", list(STACKS))
def test_chunked_window_equals_the_whole_window(stack, chunk_len, dtype):
    model = model_of(stack, dtype)
    x, y = batch()
    want = loss_and_grads(model, x, y, 0)
    got = loss_and_grads(model, x, y, chunk_len)
    assert_same(got, want, dtype)
    # The state after the window is the same too (what TBPTT carries on).
    for a, b in zip(model.carried(got[2]), model.carried(want[2]), strict=True):
        for name in b or {}:
            torch.testing.assert_close(a[name], b[name], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("stack", ["rwkv7", "gdn", "rwkv8", "hybrid"])
def test_from_a_carried_state(stack):
    """TBPTT and chunking together: the window starts from the state an earlier window left."""
    model = model_of(stack, torch.float64)
    x0, _ = batch(seed=5)
    with torch.no_grad():
        _, state = model(x0)
    state = model.carried(state)  # as TBPTT carries it (MoBA's keys and values start afresh)
    x, y = batch()
    want = loss_and_grads(model, x, y, 0, state=state)
    got = loss_and_grads(model, x, y, 5, state=state)
    assert_same(got, want, torch.float64)
    no_state = loss_and_grads(model, x, y, 5)
    assert abs(no_state[0] - want[0]) > 1e-6  # the carried state matters


def test_gradient_reaches_the_initial_state():
    """The chunks pass the state on with its gradient: d loss / d initial state agrees too."""
    model = model_of("rwkv7", torch.float64)
    x, y = batch()
    grads = []
    for chunk_len in (0, 5):
        state = [{k: v.double().requires_grad_() for k, v in s.items()} for s in model.empty_state(2, "cpu")]
        loss, _ = micro_batch_loss(model, x, y, state, "chunked", True, chunk_len)
        loss.backward()
        grads.append({f"{i}.{k}": v.grad for i, s in enumerate(state) for k, v in s.items()})
    assert worst_error(grads[1], grads[0]) <= 1e-10
    assert all(g.norm() > 0 for g in grads[0].values())


@pytest.mark.parametrize("head,l2wrap", [("full", True), ("chunked", False), ("full", False)])
def test_both_heads_with_and_without_l2wrap(head, l2wrap):
    model = model_of("rwkv7", torch.float64)
    x, y = batch()
    want = loss_and_grads(model, x, y, 0, head, l2wrap)
    assert_same(loss_and_grads(model, x, y, 7, head, l2wrap), want, torch.float64)


def test_l2wrap_is_scaled_like_the_whole_window():
    """L2Wrap adds nothing to the loss; its gradient must be the unchunked window's, not a chunk's
    (a 1 / (B T_k) instead of 1 / (B T) would show up here)."""
    model = model_of("rwkv7", torch.float64)
    x, y = batch()
    plain = loss_and_grads(model, x, y, 7, l2wrap=False)[1]
    wrapped = loss_and_grads(model, x, y, 7, l2wrap=True)[1]
    want_plain = loss_and_grads(model, x, y, 0, l2wrap=False)[1]
    want_wrapped = loss_and_grads(model, x, y, 0, l2wrap=True)[1]
    diff = {n: wrapped[n] - plain[n] for n in plain}
    want_diff = {n: want_wrapped[n] - want_plain[n] for n in want_plain}
    assert want_diff["head.weight"].norm() > 1e-8
    assert worst_error({"head.weight": diff["head.weight"]}, {"head.weight": want_diff["head.weight"]}) < 1e-8


def test_grad_cp_inside_the_chunks():
    model = model_of("rwkv7", torch.float64)
    x, y = batch()
    want = loss_and_grads(model, x, y, 0)
    model.grad_checkpointing = True
    try:
        assert_same(loss_and_grads(model, x, y, 7), want, torch.float64)
    finally:
        model.grad_checkpointing = False


def test_bf16_mixed_is_close():
    """Under bf16 autocast both runs round alike; the chunked one stays within bf16's resolution."""
    model = model_of("rwkv7", torch.float32)
    x, y = batch()
    results = []
    for chunk_len in (0, 8):
        with autocast("bf16-mixed", torch.device("cpu")):
            model.zero_grad(set_to_none=True)
            loss, _ = micro_batch_loss(model, x, y, None, "chunked", True, chunk_len)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss0, g0), (loss1, g1) = results
    assert abs(loss1 - loss0) <= 1e-2 * abs(loss0)
    assert worst_error(g1, g0) <= 5e-2


def test_validation_under_no_grad_needs_no_recompute():
    model = model_of("rwkv7", torch.float64)
    x, y = batch()
    with torch.no_grad():
        whole, _ = model(x, None, y)
        chunked, _ = model(x, None, y, chunk_len=5)
    assert abs(whole - chunked).item() <= 1e-12


def test_step_memory_does_not_grow_with_the_window():
    """The profiler's peak of one training step (tools/bench_model.py, as `rwkvx bench --model`
    measures it): chunked at 4x the window it stays within 1.25x; unchunked it grows ~4x."""
    from rwkvx_cli.tools.bench_model import step_memory

    cfg = ModelConfig(vocab_size=V, n_layer=2, n_embd=32, head_size=16)
    model = build_model(cfg, 0)

    def activations(length, chunk_len):
        x, y = batch(B=1, length=length)

        def step():
            loss, _ = micro_batch_loss(model, x, y, None, "chunked", True, chunk_len)
            loss.backward()
            model.zero_grad(set_to_none=True)

        return step_memory(step, model, torch.device("cpu"))["activation_mb"]

    short, long = activations(256, 256), activations(1024, 256)
    assert long <= 1.25 * short, (short, long)
    assert activations(1024, 0) >= 3 * short


def _net_bytes(fn) -> tuple[int, object]:
    """Bytes allocated and not freed while `fn` runs (the profiler's record of every allocation and
    free), and what it returns."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return sum(e.self_cpu_memory_usage for e in prof.events()), out


@pytest.mark.parametrize("stack", ["rwkv7", "gdn"])
def test_the_forward_keeps_only_the_boundary_states(stack):
    """What a chunked window's forward leaves for the backward: the ids, the chunks' losses and one
    state per boundary, whatever the window. A token shift kept as a view of its chunk's activations
    would keep those alive too (4 KB a token for the tiny RWKV-7 before chunked.compact)."""
    model = model_of(stack, torch.float32)

    def kept(length):
        x, y = batch(B=1, length=length)
        nbytes, (loss, _) = _net_bytes(lambda: micro_batch_loss(model, x, y, None, "chunked", True, 256))
        loss.backward()
        model.zero_grad(set_to_none=True)
        return nbytes

    short, long = kept(1024), kept(4096)
    state = sum(t.numel() * 4 for s in model.empty_state(1, "cpu") for t in s.values())
    assert long - short <= 12 * state + 64 * 1024, (short, long, state)  # 12 more boundaries, a little slack


def test_the_tbptt_carry_holds_only_the_state():
    """LM.carried copies the token shifts out of the activations they view (which would otherwise
    stay alive until the next step) and leaves MoBA's keys and values behind."""
    for stack in ("rwkv7", "gdn", "hybrid"):
        model = model_of(stack, torch.float32)
        _, state = model(batch(B=1, length=64)[0])
        for kind, s in zip(model.kinds, model.carried(state), strict=True):
            if kind == "moba":
                assert s is None
                continue
            for name, t in s.items():
                assert not t.requires_grad and t.untyped_storage().nbytes() == t.numel() * t.element_size(), name


@pytest.mark.parametrize("head", ["chunked", "full"])
def test_masked_weights_chunked_equal_the_whole_window(head):
    """Loss masks (per-target weights) go through the chunks: each chunk's weighted sum, added up,
    is the window's, and so is every gradient (L2Wrap's term included)."""
    model = model_of("rwkv7", torch.float64)
    x, y = batch()
    gen = torch.Generator().manual_seed(9)
    mask = torch.rand(x.shape, generator=gen) < 0.3
    weights = mask.double() / mask.sum()

    def run(chunk_len):
        model.zero_grad(set_to_none=True)
        loss, state = micro_batch_loss(model, x, y, None, head, True, chunk_len, weights=weights)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, state

    assert_same(run(7), run(0), torch.float64)
