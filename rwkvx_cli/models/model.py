"""The language model: a stack of blocks of any layer kind (`model.layers`):
RWKV-7, MoBA sparse attention (RWKV-X), RWKV-4, Gated DeltaNet, KDA and the
normalized "rwkv8" recurrence, plus RWKV-LM's "better rwkv7 init"."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rwkvx_cli.config import LAYER_KINDS, ModelConfig
from rwkvx_cli.models.layers import DeltaMix, RWKV4TimeMix, RWKV8Mix
from rwkvx_cli.models.rwkv7 import Block, ChannelMix
from rwkvx_cli.ops.moba import moba

assert set(LAYER_KINDS) == {"rwkv7", "moba", "rwkv4", "gdn", "kda", "rwkv8"}


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


class MobaAttention(nn.Module):
    def __init__(self, C: int, head_size: int, chunk: int, top_k: int):
        super().__init__()
        self.n_head, self.head_size, self.chunk, self.top_k = C // head_size, head_size, chunk, top_k
        self.receptance = nn.Linear(C, C, bias=False)  # q
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, self.head_size) for p in (self.receptance, self.key, self.value))
        y = moba(q, k, v, chunk_size=self.chunk, top_k=self.top_k)
        return self.output(y.reshape(B, T, C))


class AttnBlock(nn.Module):
    """x += attn(ln1 x); x += channel_mix(ln2 x). No positional encoding (RWKV-X)."""

    def __init__(self, C: int, head_size: int, chunk: int, top_k: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(C)
        self.ln2 = nn.LayerNorm(C)
        self.att = MobaAttention(C, head_size, chunk, top_k)
        self.ffn = ChannelMix(C)

    def forward(self, x, v_first, state=None):
        if hasattr(self, "ln0"):
            x = self.ln0(x)
        x = x + self.att(self.ln1(x))
        ffn, _ = self.ffn(self.ln2(x))
        return x + ffn, v_first, None


class MixBlock(nn.Module):
    """x += time_mix(ln1 x); x += channel_mix(ln2 x), for the recurrent relatives
    of RWKV-7 (layers.py); the state is the time mix's dict plus the channel
    mix's token-shift vector."""

    def __init__(self, kind: str, C: int, head_size: int, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(C)
        self.ln2 = nn.LayerNorm(C)
        if kind == "rwkv4":
            self.att = RWKV4TimeMix(C, head_size)
        elif kind in ("gdn", "kda"):
            self.att = DeltaMix(C, head_size, per_channel=kind == "kda")
        else:
            self.att = RWKV8Mix(C, head_size, shared_value=cfg.rwkv8_shared_value)
        self.ffn = ChannelMix(C)

    def empty_state(self, B: int, device) -> dict[str, torch.Tensor]:
        return {
            **self.att.empty_state(B, device),
            "ffn_shift": torch.zeros(B, self.ln2.normalized_shape[0], device=device),
        }

    def forward(self, x, v_first, state: dict[str, torch.Tensor] | None = None):
        if hasattr(self, "ln0"):
            x = self.ln0(x)
        att, att_state = self.att(self.ln1(x), state)
        x = x + att
        ffn, ffn_shift = self.ffn(self.ln2(x), state["ffn_shift"] if state else None)
        return x + ffn, v_first, {**att_state, "ffn_shift": ffn_shift}


class LM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.n_embd
        self.kinds = layer_kinds(cfg)
        self.emb = nn.Embedding(cfg.vocab_size, C)
        blocks, rwkv_id = [], 0
        for pos, kind in enumerate(self.kinds):
            if kind == "rwkv7":
                blk = Block(C, cfg.head_size, rwkv_id, has_ln0=pos == 0)
                rwkv_id += 1
            elif kind == "moba":
                blk = AttnBlock(C, cfg.head_size, cfg.moba_chunk, cfg.moba_top_k)
            else:
                blk = MixBlock(kind, C, cfg.head_size, cfg)
            if pos == 0 and kind != "rwkv7":
                blk.ln0 = nn.LayerNorm(C)  # the first block normalises the embedding, whatever its kind
            blocks.append(blk)
        self.blocks = nn.ModuleList(blocks)
        self.ln_out = nn.LayerNorm(C)
        self.head = nn.Linear(C, cfg.vocab_size, bias=False)

    @property
    def recurrent(self) -> bool:
        """True when every block is recurrent (no attention): O(1) state per token."""
        return "moba" not in self.kinds

    def empty_state(self, B: int, device) -> list:
        return [
            None if kind == "moba" else blk.empty_state(B, device)
            for kind, blk in zip(self.kinds, self.blocks, strict=True)
        ]

    def forward(self, idx: torch.Tensor, state: list | None = None):
        """Logits [B, T, V], and the state after the last token (for TBPTT / generation)."""
        x = self.emb(idx)
        v_first = None
        new_state = []
        for i, blk in enumerate(self.blocks):
            x, v_first, s = blk(x, v_first, state[i] if state is not None else None)
            new_state.append(s)
        return self.head(self.ln_out(x)), new_state

    def loss(self, idx, targets, state=None):
        logits, new_state = self(idx, state)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1)), new_state


def _orthogonal_(w: torch.Tensor, scale: float, gen: torch.Generator) -> None:
    """RWKV-LM's rule: gain = scale * sqrt(rows / cols) when rows > cols, else scale."""
    rows, cols = w.shape
    gain = scale * (math.sqrt(rows / cols) if rows > cols else 1.0)
    nn.init.orthogonal_(w, gain=gain, generator=gen)


@torch.no_grad()
def init_weights(model: LM, seed: int) -> None:
    """RWKV-LM train_temp's "better rwkv7 init" (facts in ../shared/docs/ops.md), seeded."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    C, N = cfg.n_embd, cfg.head_size
    n = torch.arange(C, dtype=torch.float64)
    ddd = (n / C).view(1, 1, C)
    linear = n / (C - 1) - 0.5
    z = ((n % N) - (N - 1) / 2) / ((N - 1) / 2)
    zigzag = z * z.abs()

    model.emb.weight.uniform_(-1e-4, 1e-4, generator=gen)
    _orthogonal_(model.head.weight, 0.5, gen)
    rwkv_seen = 0
    n_blocks = len(model.blocks)
    for pos, blk in enumerate(model.blocks):
        if isinstance(blk, MixBlock):
            # Other recurrences take their ratios from their position in the whole stack.
            layer, L = pos, n_blocks
        else:
            # Attention blocks take the ratios of the RWKV-7 block before them.
            layer = max(rwkv_seen - 1, 0) if isinstance(blk, AttnBlock) else rwkv_seen
            L = max(model.kinds.count("rwkv7"), 1)
        r0 = layer / (L - 1) if L > 1 else 0.0
        r1 = 1.0 - layer / L
        for ln in (getattr(blk, "ln0", None), blk.ln1, blk.ln2):
            if ln is not None:
                ln.weight.fill_(1.0)
                ln.bias.zero_()
        blk.ffn.x_k.copy_(1.0 - ddd.pow(r1**4))
        _orthogonal_(blk.ffn.key.weight, 1.0, gen)
        blk.ffn.value.weight.zero_()
        att = blk.att
        if isinstance(blk, MixBlock):
            att.reset_parameters(gen, layer, L)
            continue
        if isinstance(blk, AttnBlock):
            for p, scale in ((att.receptance, 1.0), (att.key, 0.1), (att.value, 1.0)):
                _orthogonal_(p.weight, scale, gen)
            att.output.weight.zero_()
            continue
        rwkv_seen += 1
        for name, power in (("x_r", 0.2), ("x_w", 0.9), ("x_k", 0.7), ("x_v", 0.7), ("x_a", 0.9), ("x_g", 0.2)):
            getattr(att, name).copy_(1.0 - ddd.pow(power * r1))
        www = -6 + 6 * (n / (C - 1)).pow(1 + r0**0.3)
        att.w0.copy_((www + 0.5 + 2.5 * zigzag).view(1, 1, C))
        att.a0.copy_((-0.19 + 0.3 * zigzag + 0.4 * linear).view(1, 1, C))
        att.v0.copy_((0.73 - 0.4 * linear).view(1, 1, C))
        att.k_k.copy_((0.71 - 0.1 * linear).view(1, 1, C))
        att.k_a.fill_(1.02)
        att.r_k.fill_(-0.04)
        for name in ("w", "a", "v", "g"):
            getattr(att, f"{name}1").zero_()
            _orthogonal_(getattr(att, f"{name}2"), 0.1, gen)
        for p, scale in ((att.receptance, 1.0), (att.key, 0.1), (att.value, 1.0)):
            _orthogonal_(p.weight, scale, gen)
        att.output.weight.zero_()
        att.ln_x.weight.fill_(((1 + layer) / L) ** 0.7)
        att.ln_x.bias.zero_()
    model.ln_out.weight.fill_(1.0)
    model.ln_out.bias.zero_()


def build_model(cfg: ModelConfig, seed: int) -> LM:
    model = LM(cfg)
    init_weights(model, seed)
    return model


def parameter_groups(model: LM, lr: float, weight_decay: float) -> list[dict]:
    """RWKV-LM's optimizer groups: att.w0 at 2x LR without decay; 2-D `.weight`
    matrices with weight decay; everything else at 1x LR without decay."""
    decay, w0, rest = [], [], []
    for name, p in model.named_parameters():
        if name.endswith("att.w0"):
            w0.append(p)
        elif p.squeeze().dim() >= 2 and name.endswith(".weight") and weight_decay > 0:
            decay.append(p)
        else:
            rest.append(p)
    return [
        {"params": rest, "lr_scale": 1.0, "weight_decay": 0.0, "name": "1x"},
        {"params": w0, "lr_scale": 2.0, "weight_decay": 0.0, "name": "w0_2x"},
        {"params": decay, "lr_scale": 1.0, "weight_decay": weight_decay, "name": "decay"},
    ]
