"""The trainer's optimizers (`train.optimizer`).

`adamw`: AdamW over RWKV-LM's parameter groups (models.parameter_groups), run by torch's fused
kernel, one pass over each tensor, where it can: the for-loop form torch picks by default on the
CPU dispatches some 15 small ops per parameter tensor (25 ms of a 190 ms tiny RWKV-7 step on the
2-core development VM against 2 ms fused; docs/benchmarks.md). Under FSDP2, whose parameters are
sharded DTensors, the multi-tensor (foreach) form. The same math either way; the rounding differs
by the order of operations.

`muon`: Muon (Keller Jordan, 2024) for the hidden matrices and the same AdamW for every other
tensor, as one torch optimizer (`MuonAdamW`), so that a checkpoint, FSDP2's state dicts and a
resume see one state dict, as they do for AdamW. The Muon update of a matrix W (m x n), from its
gradient G and a momentum buffer B (torch.optim.Muon's form):

    B <- mu B + (1 - mu) G;   U = (1 - mu) G + mu B   (Nesterov)
    O = NS5(U)                                        (Newton-Schulz: O ~ the orthogonal factor of U)
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) O     (Moonshot's scale: the update's RMS is AdamW's)

With that scale one learning rate, one schedule and one weight decay serve both halves
(Moonshot AI, "Muon is Scalable for LLM Training", arXiv 2502.16982). NS5 runs in fp32 on the CPU
(this machine's bf16 matmul is emulated) and in bf16 on CUDA, as everyone runs it there.

Under data parallelism each matrix is orthogonalised whole, once, by one rank (its owner: the
matrices are dealt out by cost), and the results are exchanged: under DDP (every rank holds the
whole update) one all-gather of the orthogonalised matrices; under FSDP2 (each rank holds rows of
each matrix) one all-to-all sends each owner the rows of its matrices and a second sends each rank
its rows of the results. Per step that moves each Muon matrix's size once over the network (DDP:
to every rank; FSDP2: twice, a rank's share each way), against FSDP2's own 3x per step; the
results equal one process's (tests/train/test_muon.py)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.optim.adam import adam

# How torch computes the update, not what it computes: a checkpoint's saved groups carry them, but
# the process that loads the state keeps its own (checkpoints/full.py's load_full_state), and a resume
# never compares them (checkpoints/manager.py's check_optimizer_state).
IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})

# Keller Jordan's quintic Newton-Schulz coefficients (as torch.optim.Muon), and its step count.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def adamw(groups: list[dict], lr: float, betas, eps: float, sharded: bool = False) -> torch.optim.AdamW:
    impl = {"foreach": True} if sharded else {"fused": True}
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **impl)


def build(groups: list[dict], train, sharded: bool = False) -> torch.optim.Optimizer:
    """The optimizer `train.optimizer` names, over `groups` (models.parameter_groups, with
    `muon=True` for Muon)."""
    if train.optimizer == "muon":
        return MuonAdamW(groups, train.lr, train.betas, train.eps, train.muon_momentum, train.muon_ns_steps, sharded)
    return adamw(groups, train.lr, train.betas, train.eps, sharded)


def implementation(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each group's implementation flags, to put back after a load_state_dict overwrote them."""
    return [{k: g[k] for k in IMPLEMENTATION if k in g} for g in optimizer.param_groups]


def restore_implementation(optimizer: torch.optim.Optimizer, flags: list[dict]) -> None:
    for g, f in zip(optimizer.param_groups, flags, strict=True):
        g.update(f)


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration: a matrix whose singular vectors are g's and whose singular
    values lie near 1 (roughly in [0.7, 1.2]; Keller Jordan's coefficients trade exactness for speed)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / x.norm().clamp(min=eps)  # the spectral norm is at most the Frobenius norm: now <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).to(g.dtype)


def update_scale(shape) -> float:
    """Moonshot's scale of an orthogonalised update of a (m, n) matrix: RMS 0.2, AdamW's typical RMS."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


def owners(shapes: list[tuple[int, int]], world: int) -> list[int]:
    """Deal matrices out to ranks by the cost of orthogonalising each (largest first, to the least
    loaded rank): the same on every rank and at every step, so a resume orthogonalises alike."""
    load = [0] * world
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-_ns_cost(shapes[i]), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += _ns_cost(shapes[i])
    return owner


def _ns_cost(shape) -> int:
    m, n = sorted(shape)
    return m * m * n


class MuonAdamW(torch.optim.AdamW):
    """AdamW whose groups marked `"muon": True` take Muon's update instead (the module docstring).
    Muon state per matrix: `momentum_buffer` and `step`; every other tensor has AdamW's state."""

    def __init__(self, groups, lr, betas, eps, momentum: float = 0.95, ns_steps: int = NS_STEPS, sharded=False):
        impl = {"foreach": True} if sharded else {"fused": True}
        super().__init__(groups, lr=lr, betas=tuple(betas), eps=eps, **impl)
        for group in self.param_groups:
            group.setdefault("muon", False)
            if group["muon"]:
                group.setdefault("momentum", momentum)
                group.setdefault("ns_steps", ns_steps)
                for p in group["params"]:
                    if p.dim() != 2:
                        raise ValueError(f"Muon takes matrices; a parameter of shape {tuple(p.shape)} was given")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw_group(group)
        self._muon_step([g for g in self.param_groups if g["muon"]])
        return loss

    def _adamw_group(self, group: dict) -> None:
        """torch's AdamW step of one group (Adam.step's body, decoupled decay)."""
        params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_sqs,
            steps,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            decoupled_weight_decay=True,
        )

    def _muon_step(self, groups: list[dict]) -> None:
        todo = []  # (group, parameter, Nesterov update)
        for group in groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                state["step"] += 1
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                todo.append((group, p, p.grad.lerp(buf, mu)))
        if not todo:
            return
        ortho = orthogonalize_all([u for _, _, u in todo], [g["ns_steps"] for g, _, _ in todo])
        for (group, p, _), o in zip(todo, ortho, strict=True):
            lr = group["lr"]
            local = _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(o, alpha=-lr * update_scale(p.shape))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own rows (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def orthogonalize_all(updates: list[torch.Tensor], steps: list[int]) -> list[torch.Tensor]:
    """NS5 of each update, each orthogonalised whole by one rank and exchanged (the module docstring).
    Returns plain tensors: whole matrices, or under FSDP2 this rank's rows of each."""
    if hasattr(updates[0], "device_mesh"):
        return _orthogonalize_sharded(updates, steps)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [newton_schulz(u, s) for u, s in zip(updates, steps, strict=True)]
    return _orthogonalize_replicated(updates, steps)


def _orthogonalize_replicated(updates: list[torch.Tensor], steps: list[int]) -> list[torch.Tensor]:
    """DDP: every rank holds every whole update. Each orthogonalises its own matrices; one all-gather
    of their flattened results (padded to the largest rank's) gives every rank every matrix."""
    world, rank = dist.get_world_size(), dist.get_rank()
    owner = owners([tuple(u.shape) for u in updates], world)
    mine = [newton_schulz(u, s).flatten() for u, s, o in zip(updates, steps, owner, strict=True) if o == rank]
    sizes = [sum(u.numel() for u, o in zip(updates, owner, strict=True) if o == r) for r in range(world)]
    ref = updates[0]
    flat = torch.zeros(max(sizes), dtype=ref.dtype, device=ref.device)
    if mine:
        joined = torch.cat(mine)
        flat[: joined.numel()] = joined
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    offsets = [0] * world
    out = []
    for u, o in zip(updates, owner, strict=True):
        out.append(gathered[o][offsets[o] : offsets[o] + u.numel()].view_as(u))
        offsets[o] += u.numel()
    return out


def _row_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """The rows each rank holds of a dim-0 sharded DTensor (torch.chunk's split: ceil(rows / world) each,
    the last ranks fewer or none)."""
    chunk = -(-rows // world)
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(world)]


def _orthogonalize_sharded(updates, steps: list[int]) -> list[torch.Tensor]:
    """FSDP2: each rank holds rows of every update. An all-to-all brings each owner the rows of its
    matrices from every rank; it orthogonalises them whole; a second all-to-all returns each rank its
    rows of every result."""
    from torch.distributed.tensor import Shard

    mesh = updates[0].device_mesh
    for u in updates:
        if u.device_mesh != mesh or tuple(u.placements) != (Shard(0),):
            raise ValueError(f"Muon under FSDP2 expects parameters sharded by rows on one mesh; got {u.placements}")
    group, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    shapes = [tuple(u.shape) for u in updates]
    owner = owners(shapes, world)
    ranges = [_row_ranges(s[0], world) for s in shapes]
    local = [u.to_local() for u in updates]
    ref = local[0]

    def rows_of(i: int, r: int) -> int:
        return ranges[i][r][1] - ranges[i][r][0]

    def exchange(send_parts: list[list[torch.Tensor]], recv_sizes: list[int]) -> list[torch.Tensor]:
        send = torch.cat([t.reshape(-1) for part in send_parts for t in part] or [ref.new_zeros(0)])
        recv = ref.new_empty(sum(recv_sizes))
        in_sizes = [sum(t.numel() for t in part) for part in send_parts]
        dist.all_to_all_single(recv, send.contiguous(), recv_sizes, in_sizes, group=group)
        return list(recv.split(recv_sizes))

    mine = [i for i in range(len(updates)) if owner[i] == rank]
    # 1. each rank sends every owner its rows of the owner's matrices
    got = exchange(
        [[local[i] for i in range(len(updates)) if owner[i] == d] for d in range(world)],
        [sum(rows_of(i, r) * shapes[i][1] for i in mine) for r in range(world)],
    )
    whole = {i: ref.new_empty(shapes[i]) for i in mine}
    for r in range(world):
        at = 0
        for i in mine:
            n = rows_of(i, r) * shapes[i][1]
            whole[i][ranges[i][r][0] : ranges[i][r][1]] = got[r][at : at + n].view(rows_of(i, r), shapes[i][1])
            at += n
    done = {i: newton_schulz(whole[i], steps[i]) for i in mine}
    # 2. each owner sends every rank that rank's rows of its results
    back = exchange(
        [[done[i][ranges[i][d][0] : ranges[i][d][1]] for i in mine] for d in range(world)],
        [sum(rows_of(i, rank) * shapes[i][1] for i in range(len(updates)) if owner[i] == d) for d in range(world)],
    )
    out: list[torch.Tensor | None] = [None] * len(updates)
    for d in range(world):
        at = 0
        for i in range(len(updates)):
            if owner[i] == d:
                n = rows_of(i, rank) * shapes[i][1]
                out[i] = back[d][at : at + n].view(rows_of(i, rank), shapes[i][1])
                at += n
    return out
