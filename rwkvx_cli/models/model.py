"""The language model: a stack of blocks of any layer kind (`model.layers`):
RWKV-7, MoBA sparse attention (RWKV-X), RWKV-4, Gated DeltaNet, KDA and the
normalized "rwkv8" recurrence (docs/model.md). Each kind's time mix, and its
init, is in `layers/`."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models.chunked import chunked_loss, compact
from rwkvx_cli.models.layers import PLAIN, TIME_MIXES, ChannelMix, Graph, State, orthogonal_scaled_
from rwkvx_cli.models.losses import linear_cross_entropy


def block_kinds(n_rwkv: int, n_attn: int) -> list[str]:
    """RWKV-X's rule: `[rwkv7 x interval, moba]` repeated n_attn times, then the leftover RWKV-7 blocks."""
    if n_attn == 0:
        return ["rwkv7"] * n_rwkv
    interval = n_rwkv // n_attn
    kinds = (["rwkv7"] * interval + ["moba"]) * n_attn
    return kinds + ["rwkv7"] * (n_rwkv - interval * n_attn)


def layer_kinds(cfg: ModelConfig) -> list[str]:
    """The stack: `model.layers` when given, else RWKV-X's rule on n_layer and n_attn."""
    return list(cfg.layers) if cfg.layers else block_kinds(cfg.n_layer, cfg.n_attn)


def block_depth(kinds: list[str], pos: int) -> tuple[int, int]:
    """(layer, n_layer) of the block at `pos`, for its init ratios and RWKV-7's layer id.
    RWKV-7 blocks count among the RWKV-7 blocks (RWKV-LM); a MoBA block takes the depth of
    the RWKV-7 block below it (RWKV-X); the other kinds count their place in the whole stack."""
    if kinds[pos] not in ("rwkv7", "moba"):
        return pos, len(kinds)
    below = kinds[:pos].count("rwkv7")
    return (below if kinds[pos] == "rwkv7" else max(below - 1, 0)), max(kinds.count("rwkv7"), 1)


class Block(nn.Module):
    """x = ln0(x) in the first block only (the embedding is normalised once);
    x += att(ln1 x); x += ffn(ln2 x). `att` is the kind's time mix (layers/); the
    channel mix is RWKV's in every kind. The state is the time mix's dict plus the
    channel mix's token-shift vector (MoBA's: the keys and values read so far, with no
    fixed-size zero state: `empty_state` is None)."""

    def __init__(self, kind: str, cfg: ModelConfig, layer_id: int, has_ln0: bool):
        super().__init__()
        if kind not in TIME_MIXES:
            raise ValueError(f"unknown layer kind {kind!r}; known: {', '.join(TIME_MIXES)}")
        C = cfg.n_embd
        # ln0 is registered first in an RWKV-7 block and last in the other kinds. RWKV-LM registers
        # it after ln1 and ln2; the names, not the order, are what its files and ours share, and
        # parameter order keys the optimizer state that rwkvx checkpoints hold, so it stays.
        ln0_first = has_ln0 and kind == "rwkv7"
        if ln0_first:
            self.ln0 = nn.LayerNorm(C)
        self.ln1 = nn.LayerNorm(C)
        self.ln2 = nn.LayerNorm(C)
        self.att = TIME_MIXES[kind].from_config(cfg, layer_id)
        # RWKV-4 blocks keep v4neo's key init (gain sqrt(4C / C) = 2); the others take model.ffn_key_gain.
        self.ffn = ChannelMix(C, key_gain=None if kind == "rwkv4" else cfg.ffn_key_gain)
        self.fused = cfg.fused
        if has_ln0 and not ln0_first:
            self.ln0 = nn.LayerNorm(C)

    def empty_state(self, B: int, device) -> State | None:
        att = self.att.empty_state(B, device)
        if att is None:
            return None
        return {**att, "ffn_shift": torch.zeros(B, self.ln2.normalized_shape[0], device=device)}

    def forward(self, x, v_first, state: State | None = None, graph: Graph = PLAIN, starts=None):
        """`graph`: PLAIN, or LRP's modified graph (explain/), for which the residual adds are sums
        and the norms take LayerNorm's rule. With `fused` (model.fused) and the plain graph, the
        same block through the fused block ops (`_fused`). `starts` (bool [B, T]): document starts,
        where every token shift and recurrence begins from zeros (docs/operators.md#document-starts)."""
        if hasattr(self, "ln0"):
            x = graph.layer_norm(self.ln0, x)
        if self.fused and graph is PLAIN:
            return self._fused(x, v_first, state, starts)
        att, v_first, att_state = self.att(graph.layer_norm(self.ln1, x), v_first, state, graph, starts)
        x = graph.sum(x + att)
        shift = state.get("ffn_shift") if state else None
        ffn, ffn_shift = self.ffn(graph.layer_norm(self.ln2, x), shift, graph, starts)
        return graph.sum(x + ffn), v_first, None if att_state is None else {**att_state, "ffn_shift": ffn_shift}

    def _fused(self, x, v_first, state: State | None, starts=None):
        """A time mix with a fused form (RWKV-7's) takes ln1 and the residual sum into it; every
        kind's channel mix runs as the channel_mix op, ln2 and the residual sum included."""
        if hasattr(self.att, "fused_forward"):
            x, v_first, att_state = self.att.fused_forward(x, self.ln1, v_first, state, starts)
        else:
            att, v_first, att_state = self.att(self.ln1(x), v_first, state, starts=starts)
            x = x + att
        x, ffn_shift = self.ffn.fused_forward(x, self.ln2, state.get("ffn_shift") if state else None, starts)
        return x, v_first, None if att_state is None else {**att_state, "ffn_shift": ffn_shift}

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator, layer: int, n_layer: int) -> None:
        for ln in (getattr(self, "ln0", None), self.ln1, self.ln2):
            if ln is not None:
                ln.reset_parameters()
        self.ffn.reset_parameters(gen, layer, n_layer)
        self.att.reset_parameters(gen, layer, n_layer)


class LM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.n_embd
        self.kinds = layer_kinds(cfg)
        self.emb = nn.Embedding(cfg.vocab_size, C)
        self.blocks = nn.ModuleList(
            Block(kind, cfg, block_depth(self.kinds, pos)[0], has_ln0=pos == 0) for pos, kind in enumerate(self.kinds)
        )
        self.ln_out = nn.LayerNorm(C)
        self.head = nn.Linear(C, cfg.vocab_size, bias=False)
        self.grad_checkpointing = False  # set by the trainer (train.grad_cp)

    @property
    def recurrent(self) -> bool:
        """True when every block is recurrent (no attention): O(1) state per token."""
        return "moba" not in self.kinds

    def empty_state(self, B: int, device) -> list:
        return [blk.empty_state(B, device) for blk in self.blocks]

    def carried(self, state: list) -> list:
        """The state truncated BPTT carries into the next step: detached, without the states that
        grow with the tokens read (MoBA's keys and values), which start afresh each step; copied
        out of the activations a token shift views (chunked.compact), which would stay alive."""
        kept = [
            None if s is None or getattr(blk.att, "grows", False) else {k: v.detach() for k, v in s.items()}
            for blk, s in zip(self.blocks, state, strict=True)
        ]
        return compact(kept)

    def forward(
        self,
        idx: torch.Tensor,
        state: list | None = None,
        targets: torch.Tensor | None = None,
        l2wrap=False,
        *,
        head: str = "chunked",
        chunk_len: int = 0,
        starts: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ):
        """Logits [B, T, V] and the state after the last token (for TBPTT / generation); with
        `targets`, the mean cross-entropy instead of the logits, computed in chunks of rows so that
        the [B, T, V] fp32 logits never exist whole (models/losses.py), with RWKV-LM's L2Wrap
        gradient when `l2wrap`. With `targets` and `chunk_len`: chunked full BPTT over chunks of
        that many tokens (models/chunked.py), with the loss head `head` (train.head). `starts`
        (bool [B, T]): where a document starts, every layer's state is the zero state
        (docs/operators.md#document-starts). `weights` [B, T] (loss masks, with `targets`): the
        weighted sum of the targets' losses instead of their mean (models/losses.py)."""
        if targets is not None and chunk_len:
            return chunked_loss(
                self, idx, targets, state, chunk_len=chunk_len, head=head, l2wrap=l2wrap, starts=starts,
                weights=weights,
            )
        x, new_state = self.hidden(idx, state, starts)
        if targets is None:
            return self.head(x), new_state
        return linear_cross_entropy(x, self.head.weight, targets, l2wrap=l2wrap, weights=weights), new_state

    def hidden(self, idx: torch.Tensor, state: list | None = None, starts: torch.Tensor | None = None):
        """The normalised hidden states [B, T, C] that the head reads, and the new state. With
        `grad_checkpointing` on, each block's activations are recomputed in the backward pass
        instead of kept (torch.utils.checkpoint, non-reentrant). `starts`: as in `forward`."""
        x = self.emb(idx)
        v_first = None
        new_state = []
        recompute = self.grad_checkpointing and torch.is_grad_enabled()
        for i, blk in enumerate(self.blocks):
            s = state[i] if state is not None else None
            if recompute:
                x, v_first, s = checkpoint(blk, x, v_first, s, PLAIN, starts, use_reentrant=False)
            else:
                x, v_first, s = blk(x, v_first, s, starts=starts)
            new_state.append(s)
        return self.ln_out(x), new_state

    def loss(self, idx, targets, state=None, starts=None):
        logits, new_state = self(idx, state, starts=starts)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1)), new_state


def document_starts(idx: torch.Tensor, eod_id: int | None) -> torch.Tensor | None:
    """The document starts of token ids `idx` for a model trained with data.reset_at_eod (its
    tokenizer's `eod_id`; None: no resets, None back). A document starts at each end-of-document
    token, which ends the one before it in the data and begins the next in the model, as a
    start-of-document token would: its own prediction is the next document's first token."""
    return None if eod_id is None else idx == eod_id


@torch.no_grad()
def init_weights(model: LM, seed: int) -> None:
    """RWKV-LM train_temp's "better rwkv7 init" and each other kind's own
    (docs/model.md#initialisation), from one seeded generator: the embedding, the
    head, then each block bottom to top (its norms, channel mix, time mix)."""
    gen = torch.Generator().manual_seed(seed)
    model.emb.weight.uniform_(-1e-4, 1e-4, generator=gen)
    orthogonal_scaled_(model.head.weight, 0.5, gen)  # 0.5 sqrt(V / C) when V > C, as train_temp
    for pos, blk in enumerate(model.blocks):
        blk.reset_parameters(gen, *block_depth(model.kinds, pos))
    model.ln_out.reset_parameters()


def build_model(cfg: ModelConfig, seed: int) -> LM:
    model = LM(cfg)
    init_weights(model, seed)
    return model


# The low-rank factors of the per-channel mixes: RWKV-7's w/a/v/g LoRAs (raw parameters) and KDA's
# f and g LoRAs (linear layers). Muon takes them only with train.muon_lora (docs/training.md#muon).
LORA_FACTOR = re.compile(r"\.att\.(?:[wavg][12]|[fg]_[ab]\.weight)$")


def muon_matrices(model: LM, lora: bool = False) -> list[str]:
    """The hidden matrices Muon orthogonalises: every linear layer's weight inside the blocks (time
    and channel mix projections), and the LoRA factors when `lora`; never the embedding or the head,
    which are looked up or read out a row at a time rather than mixing a hidden state."""
    linear = {f"{m}.weight" for m, mod in model.blocks.named_modules() if isinstance(mod, nn.Linear)}
    names = []
    for name, p in model.blocks.named_parameters():
        is_lora = bool(LORA_FACTOR.search("." + name))
        if p.dim() == 2 and (lora if is_lora else name in linear):
            names.append(f"blocks.{name}")
    return names


def parameter_groups(
    model: LM, lr: float, weight_decay: float, muon: bool = False, muon_lora: bool = False
) -> list[dict]:
    """RWKV-LM's optimizer groups: att.w0 at 2x LR without decay; 2-D `.weight`
    matrices with weight decay; everything else at 1x LR without decay. With `muon`, a fourth group
    (`"muon": True`, decayed) takes the hidden matrices (muon_matrices) out of the other three."""
    taken = set(muon_matrices(model, muon_lora)) if muon else set()
    decay, w0, rest, matrices = [], [], [], []
    for name, p in model.named_parameters():
        if name in taken:
            matrices.append(p)
        elif name.endswith("att.w0"):
            w0.append(p)
        elif p.squeeze().dim() >= 2 and name.endswith(".weight") and weight_decay > 0:
            decay.append(p)
        else:
            rest.append(p)
    groups = [
        {"params": rest, "lr_scale": 1.0, "weight_decay": 0.0, "name": "1x"},
        {"params": w0, "lr_scale": 2.0, "weight_decay": 0.0, "name": "w0_2x"},
        {"params": decay, "lr_scale": 1.0, "weight_decay": weight_decay, "name": "decay"},
    ]
    if muon:
        groups = [{**g, "muon": False} for g in groups]
        groups.append({"params": matrices, "lr_scale": 1.0, "weight_decay": weight_decay, "name": "muon", "muon": True})
    return groups
