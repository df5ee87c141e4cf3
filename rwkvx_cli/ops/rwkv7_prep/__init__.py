"""rwkv7_prep: everything RWKV-7's time mix computes between its matmuls and the recurrence, in
one op (docs/operators.md#rwkv7_prep): the decay, the in-context learning rate, the value residual,
kk, the key update and the bonus term.

Inputs [B, T, H, N] (C = H·N channels): the projections r, k, v; the low-rank outputs
w_lora = tanh(x_w W1) W2, a_lora = (x_a A1) A2 and v_lora = (x_v V1) V2; the first layer's
value v_first; the per-channel parameters w0, a0, v0, k_k, k_a (C values each) and r_k [H, N].
With σ the logistic function and kk normalised over each head's N channels (F.normalize):

    w     = -e^{-1/2} σ(w0 + w_lora)                 log of the decay, in (-0.607, 0)
    ag    = σ(a0 + a_lora)                           in-context learning rate
    v'    = v + (v_first - v) ⊙ σ(v0 + v_lora)       value residual (v' = v when v_first is None)
    kk    = normalize(k ⊙ k_k)
    k'    = k ⊙ (1 + (ag - 1) ⊙ k_a)
    a, b  = -kk, kk ⊙ ag                             the recurrence's rank-1 correction
    bonus = (Σ_N r ⊙ k' ⊙ r_k) v'                    the current token's direct term

Returns (w, k', v', a, b, bonus), each [B, T, H, N] in the inputs' dtype (computed in fp32, or
fp64 for fp64 inputs): w, r, k', v', a, b are wkv7's inputs, bonus is rwkv7_out's. With
`pass_r=True` it also returns r itself, last, for wkv7: then r has one consumer (this op), and the
backward kernel adds r's gradient from wkv7 into dr in the pass that forms dr, where autograd would
add the gradients of a twice-used r in another. The first
layer passes v_first = v_lora = None (and v0 unused); then v' is v itself. Differentiable with
respect to every input; the parameters may have another floating dtype than the activations (fp32
parameters with bf16 activations) and get their gradients in their own dtype. The registry entry
is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_same_layout, per_channel
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("r", "k", "v", "w_lora", "a_lora", "v_first", "v_lora", "w0", "a0", "v0", "k_k", "k_a", "r_k")
OUTPUTS = ("w", "k_out", "v_out", "a", "b", "bonus")
SEQUENCE = INPUTS[:7]  # [B, T, H, N]
PARAMETERS = INPUTS[7:]  # per channel


def prep_outputs(outs: tuple, residual: bool, v, pass_r: bool) -> tuple:
    """A backend Function's outputs as the op returns them, (w, k', v', a, b, bonus) and r with
    `pass_r`: the Functions leave v' out in the first layer (no value residual), where it is v itself."""
    r = (outs[-1],) if pass_r else ()
    outs = outs[:-1] if pass_r else outs
    if residual:
        return (*outs, *r)
    w, k_out, a, b, bonus = outs
    return (w, k_out, v, a, b, bonus, *r)


def rwkv7_prep(
    r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k, *, pass_r: bool = False, backend: str = "auto"
):
    """The recurrence's inputs and the bonus term; returns (w, k', v', a, b, bonus), and r itself last with
    `pass_r` (for wkv7: r then has one consumer, whose gradient the backward kernel adds into dr)."""
    residual = v_first is not None
    if residual != (v_lora is not None):
        raise ValueError("v_first and v_lora go together: both tensors (a later layer) or both None (the first)")
    names = ("r", "k", "v", "w_lora", "a_lora", *(("v_first", "v_lora") if residual else ()))
    seq = (r, k, v, w_lora, a_lora, *((v_first, v_lora) if residual else ()))
    check_same_layout(names, seq, ndim=4)
    B, T, H, N = r.shape
    if min(B, T, H, N) < 1:
        raise ValueError(f"rwkv7_prep needs every dimension >= 1, got [B, T, H, N] = {list(r.shape)}")
    C = H * N
    w0, a0, k_k, k_a = (per_channel(n, p, C, r.device) for n, p in (("w0", w0), ("a0", a0), ("k_k", k_k), ("k_a", k_a)))
    v0 = per_channel("v0", v0, C, r.device) if residual else None
    r_k = per_channel("r_k", r_k, C, r.device)
    bk = resolve_backend(get_op("rwkv7_prep"), backend, r.device)
    if r.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of rwkv7_prep does not support float64 inputs")
    if pass_r:
        return bk.fn(r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k, pass_r=True)
    return bk.fn(r, k, v, w_lora, a_lora, v_first, v_lora, w0, a0, v0, k_k, k_a, r_k)
