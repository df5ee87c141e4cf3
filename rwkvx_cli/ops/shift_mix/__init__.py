"""shift_mix: LayerNorm, token shift and M lerps in one op: the inputs of RWKV's time mix (RWKV-7's
six, RWKV-4's three) and channel mix (docs/operators.md#shift_mix).

For x [B, T, C], with x̂ = LayerNorm(x) over C (weight, bias [C], `eps`) and x̂[-1] = state [B, C]
(the last x̂ of the previous segment; zeros when None), and mix one [M, C] tensor or M tensors of C
values each (a model's parameters as they are: no cat of them each step):

    y_m[t] = x̂[t] + (x̂[t-1] - x̂[t]) ⊙ mix[m]          m = 0 .. M-1, mix [M, C], 1 <= M <= 8

Returns ((y_0, ..., y_{M-1}), state_out): each y_m [B, T, C] in x's dtype, and state_out = x̂[T-1]
[B, C] in fp32 (fp64 for fp64 inputs), the next segment's state. Differentiable with respect to x,
weight, bias, mix and the state, and through state_out. weight, bias and mix may have another
floating dtype than x (fp32 parameters with bf16 activations); their gradients come back in their
own dtype. With `residual=True` it also returns x itself, last: the residual stream, for a block's
output sum `x + f(y_0, ...)`, so that x has one consumer and the kernels add the residual's gradient
into dx (one pass) where autograd would add the two gradients of a twice-used x (another).
With `starts` (bool [B, T]), x̂[t-1] is 0 where a document starts (docs/operators.md#document-starts).
The registry entry (backends, gradient-check sampler and cases) is spec.py.
"""

from __future__ import annotations

import torch

from rwkvx_cli.ops._checks import check_eps, check_rows, check_starts, check_state, per_channel
from rwkvx_cli.ops.registry import get_op, resolve_backend

INPUTS = ("x", "weight", "bias", "mix")
STATES = ("state",)
MAX_MIXES = 8  # the kernels take at most this many lerps


def mix_rows(mix: tuple[torch.Tensor, ...], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """A backend Function's M lerp weights for its kernels, detached, each [C] (in `dtype`, or their own):
    the rows of one [M, C] tensor, or M tensors of C values (the model's parameters as they are)."""
    if len(mix) == 1 and mix[0].dim() == 2:
        mix = mix[0].unbind(0)
    return [m.detach().to(dtype or m.dtype).reshape(-1) for m in mix]


def mix_grads(dmix: torch.Tensor, mix_like: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """The kernel's dmix [M, C] as the gradients of mix given as `mix_like` (shapes, dtypes): one [M, C]
    tensor, or a view of a row for each of M tensors."""
    if len(mix_like) == 1 and len(mix_like[0][0]) == 2:
        return [dmix.to(mix_like[0][1])]
    return [d.view(shape).to(dt) for d, (shape, dt) in zip(dmix, mix_like, strict=True)]


def _check_mix(mix, C: int, device: torch.device) -> None:
    """mix: one [M, C] tensor, or a list or tuple of M tensors of C values each (the model's
    parameters, [1, 1, C], as they are), 1 <= M <= MAX_MIXES, floating point, on x's device."""
    if isinstance(mix, torch.Tensor):
        if not mix.is_floating_point():
            raise ValueError(f"mix must be a floating-point torch.Tensor, got {mix.dtype}")
        if mix.dim() != 2 or mix.shape[1] != C or not 1 <= mix.shape[0] <= MAX_MIXES:
            raise ValueError(f"mix must have shape [M, {C}] with 1 <= M <= {MAX_MIXES}, got {tuple(mix.shape)}")
        parts = [mix]
    elif isinstance(mix, (list, tuple)) and 1 <= len(mix) <= MAX_MIXES:
        parts = list(mix)
        for i, m in enumerate(parts):
            if not isinstance(m, torch.Tensor) or not m.is_floating_point() or m.numel() != C:
                what = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
                raise ValueError(f"mix[{i}] must be a floating-point tensor of {C} values, got {what}")
    else:
        raise ValueError(
            f"mix must be an [M, {C}] tensor or a list of M tensors of {C} values, 1 <= M <= {MAX_MIXES}, "
            f"got {type(mix).__name__}" + (f" of {len(mix)}" if isinstance(mix, (list, tuple)) else "")
        )
    for m in parts:
        if m.device != device:
            raise ValueError(f"mix is on {m.device} but x is on {device}")


def shift_mix(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mix: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    residual: bool = False,
    starts: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor] | tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """LayerNorm(x), then its M token-shift lerps; returns ((y_0, ..., y_{M-1}), state_out), and x
    with `residual`."""
    check_rows("x", x, 3)
    B, T, C = x.shape
    weight = per_channel("weight", weight, C, x.device)
    bias = per_channel("bias", bias, C, x.device)
    _check_mix(mix, C, x.device)
    eps = check_eps(eps)
    if state is not None:
        check_state("state", state, (B, C), x.device)
    starts = check_starts(starts, B, T, x.device)
    spec = get_op("shift_mix")
    bk = resolve_backend(spec, backend, x.device)
    if x.dtype == torch.float64 and not bk.supports_fp64:
        raise ValueError(f"backend {bk.name!r} of shift_mix does not support float64 inputs")
    if state is None and not bk.optional_state:
        state_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        state = torch.zeros(B, C, dtype=state_dtype, device=x.device)
    _, extra = spec.with_starts(bk, {}, starts)
    return bk.fn(x, weight, bias, mix, state, eps=eps, **({"residual": True} if residual else {}), **extra)
