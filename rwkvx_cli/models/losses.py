"""The language-model loss without materialising the logits: the head's matmul,
cross-entropy and RWKV-LM's L2Wrap over chunks of rows.

For hidden states h [M, C], head weight W [V, C] and targets y [M]:

    z = h Wᵀ (per chunk, fp32)      loss = mean_i (logsumexp(z_i) - z_i[y_i])

The gradient is formed chunk by chunk in the forward pass (so no [M, V] tensor
outlives its chunk): dz = (softmax(z) - onehot(y)) / M, dh = dz W, dW = dzᵀ h.

L2Wrap (RWKV-LM): a small extra gradient on each row's largest logit,
dz_i[argmax z_i] += 1e-4 · max z_i / M, that pulls logits back towards 0. It
adds nothing to the loss value. It is scaled with the loss's own gradient, as
RWKV-LM train_temp's fused cross-entropy op does (rwkv7_l2wrap_ce: 1e-4 · max ·
grad_loss / rows; its older autograd L2Wrap, now commented out there, added it
unscaled), so that a step's gradient does not depend on how the batch is split
into micro-batches or ranks, or on loss scaling.

Loss masks (conversations: only some targets carry loss) come as per-target
weights w_i (0 for a target without loss; the training loop gives the others
1 / the step's count of them, docs/training.md#loss-masks):

    loss = Σ_i w_i (logsumexp(z_i) - z_i[y_i])     dz_i = w_i (softmax(z_i) - onehot(y_i))

and L2Wrap's term takes the same weight, dz_i[argmax z_i] += 1e-4 · max z_i · w_i:
each target weighs in L2Wrap as in the loss, as without masks (w_i = 1 / M).
Without weights the code is the unweighted one, unchanged.
"""

from __future__ import annotations

import torch

L2WRAP_FACTOR = 1e-4
# Rows per chunk are chosen so that one chunk's fp32 logits take about this many bytes.
CHUNK_BYTES = 64 * 2**20


def chunk_rows(vocab: int, budget: int = CHUNK_BYTES) -> int:
    return max(1, budget // (4 * vocab))


class RecomputeSlot:
    """Where the chunked head leaves its gradient when its chunk is recomputed (chunked BPTT,
    models/chunked.py). torch.utils.checkpoint runs a chunk twice: the forward, whose graph the
    backward walks, and in the backward the recompute, which only refills the tensors that graph
    saved. The head's gradient, formed in its forward and kept on `ctx` rather than saved, would
    outlive the chunk if the first run formed it; so the first run computes the loss alone, the
    recompute (the same call, with the same slot) the loss and the gradient, and the first run's
    backward takes the gradient from here."""

    def __init__(self):
        self.calls = 0
        self.grads: tuple | None = None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, l2wrap, rows_per_chunk, slot, row_weights=None):
        M = h.shape[0]
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32  # fp32 accumulation at least
        # Under chunked BPTT the chunk's first run (slot.calls == 0) needs the loss only.
        grads = slot is None or slot.calls > 0
        w = weight.to(h.dtype)
        w_acc = weight.to(acc)
        dh = torch.empty(h.shape, dtype=acc, device=h.device) if grads else None
        dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if grads and ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=acc, device=h.device)
        rw = None if row_weights is None else row_weights.to(acc)
        for lo in range(0, M, rows_per_chunk):
            hc, yc = h[lo : lo + rows_per_chunk], targets[lo : lo + rows_per_chunk]
            z = (hc @ w.t()).to(acc)
            lse = torch.logsumexp(z, dim=-1)
            if rw is None:
                total += (lse - z.gather(1, yc[:, None]).squeeze(1)).sum()
            else:
                total += ((lse - z.gather(1, yc[:, None]).squeeze(1)) * rw[lo : lo + rows_per_chunk]).sum()
            if not grads:
                continue
            zmax, ids = z.max(dim=-1, keepdim=True) if l2wrap else (None, None)
            dz = z.sub_(lse[:, None]).exp_()  # softmax, in z's storage
            dz.scatter_add_(1, yc[:, None], torch.full_like(lse[:, None], -1.0))
            if l2wrap:
                dz.scatter_add_(1, ids, L2WRAP_FACTOR * zmax)
            if rw is None:
                dz /= M
            else:
                dz *= rw[lo : lo + rows_per_chunk, None]
            dh[lo : lo + rows_per_chunk] = dz @ w_acc
            if dw is not None:
                dw.addmm_(dz.t(), hc.to(acc))
        ctx.dtypes = (h.dtype, weight.dtype)
        ctx.slot = slot
        if slot is None:
            # Kept on ctx rather than saved: backward scales them in place and hands them on as the
            # gradients, so the head never holds a second [V, C] buffer (one backward per forward).
            ctx.grads = (dh, dw)
        else:
            if grads:
                slot.grads = (dh, dw)
            slot.calls += 1
            # Saved so that the backward's unpacking of it sets off the chunk's recompute, which
            # leaves the gradient in the slot (the same tensors in both runs, as checkpoint requires).
            ctx.save_for_backward(targets)
        return total / M if rw is None else total

    @staticmethod
    def backward(ctx, grad):
        if ctx.slot is None:
            grads, ctx.grads = ctx.grads, None
        else:
            ctx.saved_tensors  # noqa: B018 - under checkpoint: recomputes the chunk, filling the slot
            grads, ctx.slot.grads = ctx.slot.grads, None
        if grads is None:
            raise RuntimeError(
                "the chunked loss head supports one backward pass per forward (no retain_graph), and a "
                "RecomputeSlot only inside torch.utils.checkpoint"
            )
        dh, dw = grads
        h_dtype, w_dtype = ctx.dtypes
        gh = dh.mul_(grad).to(h_dtype) if ctx.needs_input_grad[0] else None
        gw = dw.mul_(grad).to(w_dtype) if dw is not None else None
        return gh, gw, None, None, None, None, None


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    l2wrap: bool = False,
    rows: int | None = None,
    slot: RecomputeSlot | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `h @ weight.T` against `targets` (h [..., C], weight [V, C], targets [...]),
    computed in chunks of `rows` rows (default: ~64 MiB of fp32 logits each), with RWKV-LM's L2Wrap
    gradient when `l2wrap`. The peak extra memory is one chunk of logits plus fp32 gradients of h and W
    (which become the gradients: fp32 parameters get no second copy). `slot`: inside a chunk that
    torch.utils.checkpoint recomputes (chunked BPTT), a fresh RecomputeSlot per chunk. `weights` (the
    shape of `targets`): the weighted sum Σ w_i CE_i instead of the mean (loss masks; see the module)."""
    h2 = h.reshape(-1, h.shape[-1])
    y = targets.reshape(-1).to(torch.int64)
    if h2.shape[0] != y.shape[0]:
        raise ValueError(f"{h2.shape[0]} rows of hidden states but {y.shape[0]} targets")
    rw = None if weights is None else weights.reshape(-1)
    return _LinearCrossEntropy.apply(h2, weight, y, l2wrap, rows or chunk_rows(weight.shape[0]), slot, rw)


class L2Wrap(torch.autograd.Function):
    """RWKV-LM's L2Wrap on materialised logits [..., V]: passes the loss through and adds
    1e-4 · max / rows at each row's argmax to the logits' gradient, scaled like the loss; with
    `weights` (one per row), 1e-4 · max · w_i instead (loss masks: as the weighted loss weighs row i)."""

    @staticmethod
    def forward(ctx, loss, logits, weights=None):
        ctx.save_for_backward(logits, weights)
        return loss

    @staticmethod
    def backward(ctx, grad):
        logits, weights = ctx.saved_tensors
        z = logits.reshape(-1, logits.shape[-1])
        zmax, ids = z.max(dim=-1, keepdim=True)
        if weights is None:
            gz = torch.zeros_like(z).scatter_(-1, ids, zmax * (L2WRAP_FACTOR / z.shape[0]))
        else:
            scale = weights.reshape(-1, 1).to(zmax.dtype)
            gz = torch.zeros_like(z).scatter_(-1, ids, zmax * L2WRAP_FACTOR * scale)
        return grad, (gz * grad).reshape(logits.shape), None


def uses_l2wrap(setting: bool | None, kinds: list[str]) -> bool:
    """train.l2wrap, or by default (None) on for stacks with RWKV-7 blocks, as RWKV-LM trains them."""
    return "rwkv7" in kinds if setting is None else setting


def head_loss(
    h, head: torch.nn.Linear, targets, kind: str, l2wrap: bool, slot: RecomputeSlot | None = None, weights=None
):
    """The mean cross-entropy of hidden states `h` [B, T, C] through `head`: the chunked head, or
    full logits (train.head), with RWKV-LM's L2Wrap when `l2wrap`; with `weights` [B, T], the
    weighted sum (loss masks)."""
    if kind == "chunked":
        return linear_cross_entropy(h, head.weight, targets, l2wrap=l2wrap, slot=slot, weights=weights)
    return _full_loss(head(h), targets, l2wrap, weights)


def _full_loss(logits, targets, l2wrap: bool, weights=None):
    """The loss of materialised logits [B, T, V]: the mean cross-entropy, or the `weights`-weighted sum."""
    flat = _at_least_fp32(logits).flatten(0, 1)
    if weights is None:
        loss = torch.nn.functional.cross_entropy(flat, targets.flatten())
        return L2Wrap.apply(loss, logits) if l2wrap else loss
    w = weights.flatten().to(flat.dtype)
    loss = (torch.nn.functional.cross_entropy(flat, targets.flatten(), reduction="none") * w).sum()
    return L2Wrap.apply(loss, logits, w) if l2wrap else loss


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype == torch.float64 else logits.float()


def micro_batch_loss(forward, x, y, state, head: str, l2wrap: bool, chunk_len: int = 0, starts=None, weights=None):
    """Mean cross-entropy of one micro-batch and the state after it: the chunked head, or full
    logits (train.head), with RWKV-LM's L2Wrap when `l2wrap`; with `chunk_len` shorter than the
    window, chunked full BPTT (train.chunk_len, models/chunked.py). `forward` is the (wrapped) model;
    `starts` the window's document starts (bool [B, T], data.reset_at_eod) or None. `weights`
    ([B, T], loss masks): the weighted sum Σ w_i CE_i instead of the mean, L2Wrap weighted alike."""
    extra = {} if starts is None else {"starts": starts}
    if weights is not None:
        extra["weights"] = weights
    if 0 < chunk_len < x.shape[1]:
        return forward(x, state, y, l2wrap=l2wrap, head=head, chunk_len=chunk_len, **extra)
    if head == "chunked":
        return forward(x, state, y, l2wrap=l2wrap, **extra)
    extra.pop("weights", None)
    logits, new_state = forward(x, state, **extra)
    return _full_loss(logits, y, l2wrap, weights), new_state
