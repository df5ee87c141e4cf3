"""The chunked linear + cross-entropy head against the materialised one, with and without L2Wrap."""

import pytest
import torch
import torch.nn.functional as F

from rwkvx_cli.models.losses import L2Wrap, chunk_rows, linear_cross_entropy


def _direct(h, w, y, l2wrap):
    logits = h @ w.t()
    loss = F.cross_entropy(logits.float().flatten(0, -2), y.flatten())
    return L2Wrap.apply(loss, logits) if l2wrap else loss


def _grads(fn, h, w, y, l2wrap, scale=1.0):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    loss = fn(h, w, y, l2wrap)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("l2wrap", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_matches_materialised_loss_and_grads_fp32(l2wrap, rows):
    gen = torch.Generator().manual_seed(0)
    B, T, C, V = 3, 11, 16, 50
    h = torch.randn(B, T, C, generator=gen)
    w = torch.randn(V, C, generator=gen)
    y = torch.randint(0, V, (B, T), generator=gen)
    want = _grads(_direct, h, w, y, l2wrap, scale=0.7)
    got = _grads(lambda *a: linear_cross_entropy(*a[:3], l2wrap=a[3], rows=rows), h, w, y, l2wrap, scale=0.7)
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_l2wrap_adds_gradient_at_the_max_logit_only():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(20, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 20, (5,), generator=gen)
    _, gh0, gw0 = _grads(_direct, h, w, y, False)
    _, gh1, gw1 = _grads(_direct, h, w, y, True)
    logits = h @ w.t()
    zmax, ids = logits.max(-1)
    gz = torch.zeros_like(logits)
    gz[torch.arange(5), ids] = 1e-4 * zmax / 5  # RWKV-LM: 1e-4 / (B*T) * max at the argmax
    torch.testing.assert_close(gh1 - gh0, gz @ w)
    torch.testing.assert_close(gw1 - gw0, gz.t() @ h)
    assert (gh1 - gh0).abs().max() > 0


def test_bf16_inputs_give_fp32_accumulated_loss():
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(2, 9, 16, generator=gen)
    w = torch.randn(30, 16, generator=gen)
    y = torch.randint(0, 30, (2, 9), generator=gen)
    ref = _direct(h.bfloat16(), w.bfloat16(), y, False)
    got = linear_cross_entropy(h.bfloat16(), w.bfloat16(), y, rows=4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


def test_chunk_rows_bounds_the_logits_chunk():
    assert chunk_rows(65536) == 256
    assert chunk_rows(10**9) == 1


def test_row_count_mismatch_is_refused():
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(torch.zeros(4, 3), torch.zeros(5, 3), torch.zeros(3, dtype=torch.long))


def _tiny_lm(**over):
    from rwkvx_cli.config import ModelConfig
    from rwkvx_cli.models import build_model

    cfg = ModelConfig(**{"n_layer": 2, "n_embd": 32, "head_size": 16, "vocab_size": 40, **over})
    return build_model(cfg, seed=0)


@pytest.mark.parametrize("layers", [[], ["rwkv7", "moba", "gdn"]])
def test_model_chunked_loss_and_grad_checkpointing_match_the_plain_path(layers):
    torch.manual_seed(0)
    model = _tiny_lm(layers=layers).double()
    with torch.no_grad():  # the init zeroes output projections: perturb so every weight gets a gradient
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 40, (2, 24))
    y = torch.randint(0, 40, (2, 24))

    def run(fused, recompute):
        model.zero_grad()
        model.grad_checkpointing = recompute
        if fused:
            loss, _ = model(idx, targets=y)
        else:
            logits, _ = model(idx)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    base_loss, base = run(False, False)
    for fused, recompute in ((True, False), (False, True), (True, True)):
        loss, grads = run(fused, recompute)
        torch.testing.assert_close(loss, base_loss, rtol=1e-10, atol=1e-12)
        assert grads.keys() == base.keys()
        for n in base:
            torch.testing.assert_close(grads[n], base[n], rtol=1e-8, atol=1e-12, msg=n)


def _masked_reference(h, w, y, weights, l2wrap):
    """Σ_i w_i CE_i from materialised logits, with L2Wrap's term at each row's argmax weighted by w_i
    (written out, not through losses.L2Wrap)."""
    logits = h @ w.t()
    each = F.cross_entropy(logits.flatten(0, -2), y.flatten(), reduction="none")
    loss = (each * weights.flatten()).sum()
    if not l2wrap:
        return loss
    z = logits.detach().flatten(0, -2)
    zmax, ids = z.max(-1)
    target = torch.zeros_like(z)
    target[torch.arange(len(z)), ids] = 1e-4 * zmax * weights.flatten()
    return loss + (logits.flatten(0, -2) * target).sum() - (logits.flatten(0, -2) * target).sum().detach()


@pytest.mark.parametrize("l2wrap", [False, True])
@pytest.mark.parametrize("head", ["chunked", "full"])
def test_masked_loss_is_the_weighted_sum_by_hand(head, l2wrap):
    """With a mask, the loss of every target that carries it over their count: the chunked head
    and the full head's L2Wrap give the hand computation's value and gradients (fp64)."""
    from rwkvx_cli.models.losses import head_loss

    gen = torch.Generator().manual_seed(3)
    B, T, C, V = 3, 10, 8, 30
    h = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    w = torch.randn(V, C, generator=gen, dtype=torch.float64)
    y = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) < 0.4
    weights = mask.double() / mask.sum()
    head_module = torch.nn.Linear(C, V, bias=False).double()
    head_module.weight.data.copy_(w)

    def ours(h_, w_, y_, l2):
        head_module.weight = torch.nn.Parameter(w_)  # the head reads w_ (its gradient goes to w_)
        return head_loss(h_, head_module, y_, head, l2, weights=weights)

    want = _grads(lambda *a: _masked_reference(*a[:3], weights, a[3]), h, w, y, l2wrap)
    got_loss, got_h, _ = _grads(ours, h, w, y, l2wrap)
    got_w = head_module.weight.grad
    hand = sum(F.cross_entropy((h[b, t] @ w.t())[None], y[b, t][None]).item()
               for b in range(B) for t in range(T) if mask[b, t]) / int(mask.sum())
    assert abs(got_loss.item() - hand) < 1e-12
    torch.testing.assert_close(got_loss, want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_h, want[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_w, want[2], rtol=1e-10, atol=1e-12)
    assert got_h[~mask].abs().max() == 0  # a target without loss sends nothing back, L2Wrap's term neither


def test_masked_l2wrap_weighs_each_row_as_its_loss_and_equals_the_mean_when_all_carry_it():
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(20, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 20, (6,), generator=gen)
    ones = torch.full((6,), 1 / 6, dtype=torch.float64)
    for l2wrap in (False, True):
        mean = _grads(lambda *a: linear_cross_entropy(*a[:3], l2wrap=a[3]), h, w, y, l2wrap)
        weighted = _grads(lambda *a: linear_cross_entropy(*a[:3], l2wrap=a[3], weights=ones, rows=4), h, w, y, l2wrap)
        for g, e in zip(weighted, mean, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)
    weights = torch.tensor([0.5, 0.0, 0.25, 0.0, 0.25, 0.0], dtype=torch.float64)
    _, gh0, _ = _grads(lambda *a: linear_cross_entropy(*a[:3], l2wrap=False, weights=weights), h, w, y, False)
    _, gh1, _ = _grads(lambda *a: linear_cross_entropy(*a[:3], l2wrap=True, weights=weights), h, w, y, True)
    logits = h @ w.t()
    zmax, ids = logits.max(-1)
    gz = torch.zeros_like(logits)
    gz[torch.arange(6), ids] = 1e-4 * zmax * weights
    torch.testing.assert_close(gh1 - gh0, gz @ w)


def test_model_forward_takes_the_weights_on_every_head_path():
    from rwkvx_cli.models.losses import micro_batch_loss

    model = _tiny_lm().double()
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 40, (2, 12), generator=gen), torch.randint(0, 40, (2, 12), generator=gen)
    mask = torch.rand(2, 12, generator=gen) < 0.5
    weights = mask.double() / mask.sum()
    logits, _ = model(x)
    hand = (F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none") * weights.flatten()).sum()
    for head, chunk_len in (("chunked", 0), ("full", 0), ("chunked", 5), ("full", 5)):
        loss, _ = micro_batch_loss(model, x, y, None, head, True, chunk_len, weights=weights)
        torch.testing.assert_close(loss, hand, rtol=1e-12, atol=1e-12)
