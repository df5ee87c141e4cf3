"""Chunked full BPTT (`train.chunk_len`): the loss of a window of T tokens, run as consecutive
chunks of `chunk_len` tokens, each starting from the state the previous chunk ended with, its
gradient included.

    loss = Σ_k (T_k / T) · loss_k          loss_k: the mean over chunk k's B · T_k tokens

which is the window's mean over all its tokens, so the loss and every gradient are the unchunked
window's (tests/models/test_chunked.py: fp64 to 1e-10, fp32 to 1e-5). Each chunk runs under
torch.utils.checkpoint (non-reentrant): its forward keeps only what it was given (its token ids,
targets and input state) and what it returns (its loss and final state, copied out of the
activations it views: `compact`); the backward, walking
the chunks last to first, recomputes one chunk's activations at a time from those. A step's
memory is one chunk's activations plus one state per chunk boundary, whatever T, for a purely
recurrent stack; a MoBA block's state is the keys and values it has read (layers/moba.py), which
grow with T. The cost is one more forward per step, as with `train.grad_cp`; `grad_cp` inside a
chunk still recomputes block by block (a third forward) and divides one chunk's activations by
about the number of blocks.

The chunked loss head forms its gradient in its forward; under the recomputation it does so only
in the recompute, and hands it to the first run's backward (losses.RecomputeSlot). Its L2Wrap
term is scaled by 1 / (B · T_k) and the chunk's loss by T_k / T: 1 / (B · T), as unchunked.
With per-target weights (loss masks) each chunk's loss is its weighted sum, and the window's their
sum: the weights already say what each target weighs.

The loop runs inside the model's forward, so DDP and FSDP2 see one forward and one backward per
micro-batch (each parameter's gradient is summed over the chunks before their hooks fire).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from rwkvx_cli.models.losses import RecomputeSlot, head_loss


def chunk_bounds(T: int, chunk_len: int) -> list[tuple[int, int]]:
    """[lo, hi) of each chunk of a window of T tokens: chunk_len each, the last one shorter."""
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
    return [(lo, min(lo + chunk_len, T)) for lo in range(0, T, chunk_len)]


def chunked_loss(
    model,
    idx,
    targets,
    state=None,
    *,
    chunk_len: int,
    head: str = "chunked",
    l2wrap: bool = False,
    starts=None,
    weights=None,
):
    """The mean loss of the window `idx` [B, T] against `targets` [B, T], from `state` (None: zeros),
    and the state after it, in chunks of `chunk_len` tokens (see the module docstring). `model` is
    the LM itself (models/model.py), `head` train.head, `l2wrap` whether L2Wrap applies, `starts`
    the window's document starts (bool [B, T] or None), each chunk given its own slice; `weights`
    ([B, T] or None): the weighted sum of the targets' losses instead of their mean."""
    T = idx.shape[1]
    recompute = torch.is_grad_enabled()
    total = None
    for lo, hi in chunk_bounds(T, chunk_len):
        args = (model, idx[:, lo:hi], targets[:, lo:hi], state, head, l2wrap)
        piece = None if starts is None else starts[:, lo:hi]
        part_w = None if weights is None else weights[:, lo:hi]
        if recompute:
            slot = RecomputeSlot() if head == "chunked" else None
            loss, state = checkpoint(
                _chunk, *args, slot, piece, part_w, use_reentrant=False, preserve_rng_state=False,
                determinism_check="none",
            )
        else:
            loss, state = _chunk(*args, None, piece, part_w)
        part = loss * ((hi - lo) / T) if weights is None else loss
        total = part if total is None else total + part
    return total, state


def _chunk(model, x, y, state, head: str, l2wrap: bool, slot: RecomputeSlot | None, starts=None, weights=None):
    h, new_state = model.hidden(x, state, starts)
    return head_loss(h, model.head, y, head, l2wrap, slot, weights), compact(new_state)


def compact(state: list) -> list:
    """The state with every tensor in storage of its own size. A token shift is the chunk's last
    input, `x[:, -1]`: a view that keeps the whole [B, T, C] activation it points into alive, at
    every chunk boundary (measured: 4 KB a token for the tiny RWKV-7, the step's memory growing
    with the window). A copy holds only the state."""

    def own(t):
        if isinstance(t, tuple):
            return tuple(own(x) for x in t)
        return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t

    return [None if s is None else {k: own(v) for k, v in s.items()} for s in state]
