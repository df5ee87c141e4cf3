"""WKV7 `recurrent` backend: a step loop vectorised over batch x heads, with a
hand-written, checkpointed backward.

Forward keeps the fp32 (or fp64) state in one [B*H, N, N] buffer and saves a
copy of it every `CHUNK` steps. Backward walks the chunks last to first: it
recomputes the chunk's states from its snapshot, then runs the reverse scan
(see `reference.py` for the forward math):

    dS   += dy_t r_tᵀ
    dr_t  = S_tᵀ dy_t
    dk_t  = dSᵀ v_t ;  dv_t = dS k_t ;  db_t = dSᵀ sa_t
    dsa   = dS b_t  ;  da_t = S_{t-1}ᵀ dsa
    dw_t  = colsum(dS ⊙ S_{t-1}) ⊙ w_t          (w is log-decay)
    dS    = dS diag(w_t) + dsa a_tᵀ             (carried to step t-1)

Saved memory is O(B*H*(T/CHUNK)*N² + B*T*H*N); no step divides by w, so any
decay in (0, 1] is exact.
"""

from __future__ import annotations

import torch

CHUNK = 16


def _time_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, N] -> contiguous [T, B*H, N] in the compute dtype."""
    B, T, H, N = x.shape
    return x.to(dtype).permute(1, 0, 2, 3).reshape(T, B * H, N).contiguous()


def _batch_major(x: torch.Tensor, B: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    T, _, N = x.shape
    return x.reshape(T, B, H, N).permute(1, 0, 2, 3).to(dtype)


def _step(S: torch.Tensor, w_t, k_t, v_t, a_t, b_t) -> torch.Tensor:
    """Advance S in place by one step; returns sa = S_{t-1} a_t as [BH, N, 1]."""
    sa = torch.bmm(S, a_t.unsqueeze(-1))
    S.mul_(w_t.unsqueeze(1))
    S.baddbmm_(sa, b_t.unsqueeze(1))
    S.baddbmm_(v_t.unsqueeze(-1), k_t.unsqueeze(1))
    return sa


class _WKV7Recurrent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, w, k, v, a, b, state):
        B, T, H, N = r.shape
        cdt = torch.float64 if r.dtype == torch.float64 else torch.float32
        r_, w_, k_, v_, a_, b_ = (_time_major(x, cdt) for x in (r, w, k, v, a, b))
        decay = torch.exp(w_)
        S = state.to(cdt).reshape(B * H, N, N).clone()
        n_chunks = (T + CHUNK - 1) // CHUNK
        snaps = S.new_empty(n_chunks, B * H, N, N)
        y = r_.new_empty(T, B * H, N)
        for t in range(T):
            if t % CHUNK == 0:
                snaps[t // CHUNK].copy_(S)
            _step(S, decay[t], k_[t], v_[t], a_[t], b_[t])
            torch.bmm(S, r_[t].unsqueeze(-1), out=y[t].unsqueeze(-1))
        ctx.save_for_backward(r_, decay, k_, v_, a_, b_, snaps)
        ctx.shape = (B, T, H, N)
        ctx.in_dtype = r.dtype
        ctx.state_dtype = state.dtype
        return _batch_major(y, B, H, r.dtype), S.reshape(B, H, N, N)

    @staticmethod
    def backward(ctx, dy, dstate_out):
        r_, decay, k_, v_, a_, b_, snaps = ctx.saved_tensors
        B, T, H, N = ctx.shape
        BH, cdt = B * H, r_.dtype
        dy_ = _time_major(dy, cdt)
        dS = dstate_out.to(cdt).reshape(BH, N, N).clone()
        grads = {name: torch.empty_like(r_) for name in ("r", "w", "k", "v", "a", "b")}
        states = snaps.new_empty(CHUNK + 1, BH, N, N)
        sas = snaps.new_empty(CHUNK, BH, N, 1)
        vsa = r_.new_empty(BH, N, 2)  # columns [v_t, sa_t]: one bmm gives dk and db
        kb = r_.new_empty(BH, N, 2)  # columns [k_t, b_t]: one bmm gives dv and dsa
        for c in reversed(range(snaps.shape[0])):
            t0 = c * CHUNK
            L = min(CHUNK, T - t0)
            states[0].copy_(snaps[c])
            for i in range(L):
                states[i + 1].copy_(states[i])
                sas[i].copy_(_step(states[i + 1], decay[t0 + i], k_[t0 + i], v_[t0 + i], a_[t0 + i], b_[t0 + i]))
            for i in reversed(range(L)):
                t = t0 + i
                S_prev, S_t = states[i], states[i + 1]
                dS.baddbmm_(dy_[t].unsqueeze(-1), r_[t].unsqueeze(1))
                torch.bmm(S_t.transpose(1, 2), dy_[t].unsqueeze(-1), out=grads["r"][t].unsqueeze(-1))
                vsa[:, :, 0] = v_[t]
                vsa[:, :, 1:] = sas[i]
                kb[:, :, 0] = k_[t]
                kb[:, :, 1] = b_[t]
                dk_db = torch.bmm(dS.transpose(1, 2), vsa)
                dv_dsa = torch.bmm(dS, kb)
                grads["k"][t] = dk_db[:, :, 0]
                grads["b"][t] = dk_db[:, :, 1]
                grads["v"][t] = dv_dsa[:, :, 0]
                dsa = dv_dsa[:, :, 1:]
                grads["w"][t] = (dS * S_prev).sum(1) * decay[t]
                torch.bmm(S_prev.transpose(1, 2), dsa, out=grads["a"][t].unsqueeze(-1))
                dS.mul_(decay[t].unsqueeze(1))
                dS.baddbmm_(dsa, a_[t].unsqueeze(1))
        out = tuple(_batch_major(grads[n], B, H, ctx.in_dtype) for n in ("r", "w", "k", "v", "a", "b"))
        return (*out, dS.reshape(B, H, N, N).to(ctx.state_dtype))


def wkv7_recurrent(r, w, k, v, a, b, state):
    return _WKV7Recurrent.apply(r, w, k, v, a, b, state)
