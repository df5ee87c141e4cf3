"""What a model costs: parameters per component, FLOPs per token, recurrent state size (what
`rwkvx init` prints, and the numerator of MFU)."""

from __future__ import annotations

from rwkvx_cli.models.model import LM
from rwkvx_cli.ops import get_op


def model_summary(model: LM) -> dict:
    """Parameter counts per component, forward FLOPs per token, recurrent state size."""
    groups: dict[str, int] = {}
    for name, p in model.named_parameters():
        if name.startswith("emb."):
            key = "embedding"
        elif name.startswith("head."):
            key = "head"
        elif name.startswith("blocks."):
            kind = model.kinds[int(name.split(".")[1])]
            part = name.split(".")[2]
            key = f"{kind}.{'time_mix' if part == 'att' else 'channel_mix' if part == 'ffn' else 'norms'}"
        else:
            key = "norms"
        groups[key] = groups.get(key, 0) + p.numel()
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("emb."))
    # FLOPs/token: 2 per matmul weight forward (6 with backward), plus each recurrent
    # layer's op count for one token (the op's registry `flops`, e.g. wkv7: 9 N² per head
    # forward, 28 N² with backward). Attention's score/value products are not counted.
    fwd = bwd = 0.0
    state_floats = 0
    for kind, blk in zip(model.kinds, model.blocks, strict=True):
        if kind == "moba":
            continue
        op, dims = blk.att.op_dims()
        fwd += get_op(op).flops(dims, "fwd")
        bwd += get_op(op).flops(dims, "fwdbwd")
        state_floats += sum(t.numel() for t in blk.empty_state(1, "cpu").values())
    return {
        "parameters": sum(groups.values()),
        "by_component": groups,
        "forward_flops_per_token": int(2 * matmul + fwd),
        "train_flops_per_token": int(6 * matmul + bwd),
        "state_bytes_per_sequence_fp32": 4 * state_floats,
        "blocks": "".join(blk.att.letter for blk in model.blocks),
    }
