"""LRP's modified graph: the layers' forward (models/layers) read through `LRPGraph`, the hooks
of `models.layers.common.Graph` that hold LRP's constants, mark its sums, and replace the
recurrences and norms by their rules (docs/explain.md#the-method).

Every quantity a rule holds constant is detached, so what remains is linear in the embeddings
and the norms' biases, and the relevance of any tensor x is x ⊙ ∂logit/∂x: the composed ε-rule.
The recurrences' rules are derived here (`wkv4_lrp`, `wkv7_lrp`); rules.py runs the same rules
as explicit relevance splits, the reference the gradient form is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from rwkvx_cli.models.layers.common import Graph
from rwkvx_cli.ops import wkv4, wkv7
from rwkvx_cli.ops.wkv4 import FRESH_PP


def lrp_eps(z: torch.Tensor, eps: float) -> torch.Tensor:
    """LRP's ε-rule at a sum node z = Σ_i c_i, as a gradient scale (docs/explain.md#the-method).

    The value is z; the gradient through it is multiplied by s = z / (z + ε·sign z) (sign 0 = +1).
    With relevance carried as R = x ⊙ ∂f/∂x, the ε-rule's split R(c_i) = c_i R(z) / (z + ε·sign z)
    is then exactly what autograd computes; ε = 0 is the z-rule (the identity here)."""
    if eps == 0:
        return z
    s = (z / (z + eps * torch.where(z >= 0, 1.0, -1.0).to(z.dtype))).detach()
    return z * s + (z * (1 - s)).detach()


def layer_norm_lrp(ln: nn.LayerNorm, x: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """LayerNorm with LRP's usual rule: the normaliser 1/sqrt(var + eps_ln) is a constant, so the
    map is linear in x (the centring) plus the bias, which keeps the relevance it is sent."""
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + ln.eps).detach()
    return lrp_eps((x - x.mean(-1, keepdim=True)) * rstd * ln.weight + ln.bias, eps)



def group_norm_lrp(gn: nn.GroupNorm, x: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """GroupNorm over [.., C] with LayerNorm's LRP rule per group: the normaliser is a constant."""
    shape = x.shape
    xg = x.reshape(*shape[:-1], gn.num_groups, -1)
    rstd = torch.rsqrt(xg.var(-1, unbiased=False, keepdim=True) + gn.eps).detach()
    y = ((xg - xg.mean(-1, keepdim=True)) * rstd).reshape(shape)
    return lrp_eps(y * gn.weight + gn.bias, eps)



def wkv4_lrp(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """WKV4 from a fresh state as LRP's modified graph: y [B, T, H, N], linear in v (seed 004's rule).

    With k, w, u constants (their forward values, detached), per channel, in the stabilised form
    the op runs (rwkvx_cli/ops/wkv4/reference.py):

        y_t  = (e1/den) aa_{t-1} + (e2/den) v_t,   den = e1 bb_{t-1} + e2
        aa_t = f1 aa_{t-1} + f2 v_t

    two weighted sums of the carried state and v_t (the weights of y_t sum to 1). The ε-rule
    splits each in proportion to its terms, and the relevance aa_t receives from y_{t+1} and
    aa_{t+1} is carried backward over time to v_t and aa_{t-1}, the way MambaLRP carries h_t.

    The running maximum pp changes no weight. aa = A e^{-pp} stands for the true numerator
    A = Σ_{i<=t} e^{(t-i)w + k_i} v_i (likewise bb for B), and q is a common exponent:
    (e1/den) aa = A_{t-1} / (B_{t-1} + e^{u+k_t}) and (e2/den) v_t = e^{u+k_t} v_t / (B_{t-1} + e^{u+k_t}),
    the unstabilised form's terms exactly, because e^{-q} and e^{-pp} cancel between numerator
    and denominator; and f1 aa_{t-1}, f2 v_t are the unstabilised terms e^w A_{t-1}, e^{k_t} v_t
    times the one positive constant e^{-pp_t}, which leaves every ratio term / sum, and so every
    relevance share, unchanged (only the absolute size ε is compared with differs).

    Relevance is R = x ⊙ ∂f/∂x on this graph: every node is linear in its inputs with the
    constants detached, so the ε-rule's splits are what autograd computes (lrp_eps), and the
    backward pass runs the state-relevance carry. explain/rules.py's `wkv4_relevance` runs the
    same rule explicitly; the tests check that the two agree.
    """
    k, w, u = k.detach(), w.detach().to(k.dtype), u.detach().to(k.dtype)
    B, T, H, N = k.shape
    aa = v.new_zeros(B, H, N)
    bb = k.new_zeros(B, H, N)
    pp = torch.full_like(bb, FRESH_PP)
    ys = []
    for t in range(T):
        k_t, v_t = k[:, t], v[:, t]
        q = torch.maximum(pp, u + k_t)
        e1, e2 = torch.exp(pp - q), torch.exp(u + k_t - q)
        den = e1 * bb + e2
        ys.append(lrp_eps(e1 / den * aa + e2 / den * v_t, eps))
        q = torch.maximum(pp + w, k_t)
        f1, f2 = torch.exp(pp + w - q), torch.exp(k_t - q)
        aa = lrp_eps(f1 * aa + f2 * v_t, eps)
        bb, pp = f1 * bb + f2, q
    return torch.stack(ys, dim=1)



def wkv7_lrp(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    eps: float = 0.0,
) -> torch.Tensor:
    """WKV7 from a zero state as LRP's modified graph: y [B, T, H, N], linear in v.

    `w` is the log decay, as the op takes it. With r, w, k, a, b constants (their forward values,
    detached), per (batch, head), with S the [N_v, N_k] state:

        S_t[i,j] = Σ_m S_{t-1}[i,m] M_t[m,j] + v_t[i] k_t[j],   M_t = diag(e^{w_t}) + a_t b_tᵀ
        y_t[i]   = Σ_j S_t[i,j] r_t[j]

    Both are sums of terms each linear in one S_{t-1}[i,m] or v_t[i]. The ε-rule (z ± ε: z + ε·sign z)
    splits each node's relevance over its terms:

        R(S_t[i,j])     = S_t[i,j] r_t[j] R(y_t[i]) / (y_t[i] ± ε)                     from the output
                        + Σ_l S_t[i,j] M_{t+1}[j,l] R(S_{t+1}[i,l]) / (S_{t+1}[i,l] ± ε)   the carry
        R(v_t[i])       = Σ_j v_t[i] k_t[j] R(S_t[i,j]) / (S_t[i,j] ± ε)

    run from t = T down to 1 (no carry into S_T; S_0 = 0 keeps none). The state-relevance carry
    R(S_t) plays MambaLRP's R(h_t); rows i (value channels) never mix, so relevance stays in its
    value channel until it reaches v. At ε = 0 every split hands on exactly what it receives, so
    Σ_t Σ_i R(v_t[i]) = Σ_t Σ_i R(y_t[i]).

    Relevance is R = x ⊙ ∂f/∂x on this graph: with the constants detached each node is linear in
    its inputs, and lrp_eps scales the gradient through each sum by z / (z ± ε), so the backward
    pass computes the splits above, the carry included. explain/rules.py's `wkv7_relevance` runs
    them explicitly; the tests check that the two agree.
    """
    r, k, a, b = (t.detach() for t in (r, k, a, b))
    decay = torch.exp(w.detach())
    B, T, H, N = r.shape
    S = v.new_zeros(B, H, N, N)
    ys = []
    for t in range(T):
        S = S * decay[:, t, :, None, :] + torch.einsum("bhij,bhj->bhi", S, a[:, t])[..., None] * b[:, t, :, None, :]
        S = lrp_eps(S + v[:, t, :, :, None] * k[:, t, :, None, :], eps)
        ys.append(lrp_eps(torch.einsum("bhij,bhj->bhi", S, r[:, t]), eps))
    return torch.stack(ys, dim=1)




class LRPGraph(Graph):
    """The hooks of LRP's modified graph with ε-rule stabiliser `eps` (0: the z-rule, which conserves).
    A layer's forward through it is that layer's rule; it reads a fresh sequence (no state)."""

    def __init__(self, eps: float = 0.0):
        self.eps = eps
        self._ops = {wkv7: self._wkv7, wkv4: self._wkv4}

    def const(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return lrp_eps(t, self.eps)

    def layer_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_lrp(norm, x, self.eps)

    def group_norm(self, norm: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
        return group_norm_lrp(norm, x, self.eps)

    def relu_square(self, z: torch.Tensor) -> torch.Tensor:
        # relu(z)·relu(z) with one factor a constant gate: the square's relevance goes whole to z
        # (the other factor would count it twice); relu passes it through where it is on.
        h = torch.relu(z)
        return h * h.detach()

    def op(self, fn):
        return self._ops[fn]

    def _wkv7(self, r, w, k, v, a, b, state=None):
        if state is not None:
            raise ValueError("LRP's modified graph reads a fresh sequence (no initial state)")
        return wkv7_lrp(r, w, k, v, a, b, self.eps), None

    def _wkv4(self, w, u, k, v, state=None):
        if state is not None:
            raise ValueError("LRP's modified graph reads a fresh sequence (no initial state)")
        return wkv4_lrp(w, u, k, v, self.eps), (None, None, None)
