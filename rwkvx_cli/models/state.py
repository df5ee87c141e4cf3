"""State tuning (`train.tune: state`): a trainable initial state for the RWKV-7 blocks of a frozen model,
RWKV-PEFT's `time_state` (docs/training.md#state-tuning).

    blocks.{i}.att.time_state   [H, N, N]  the wkv state every row starts from: row = value channel,
                                           column = key channel, the op's layout (ops/wkv7), RWKV-PEFT's
                                           and the rwkv pip package's (its state[i*3+1]): no transpose
    blocks.{i}.att.shift_state  [C]        with train.tune_shifts: the time mix's token shift, the
                                           previous token's ln1 output (pip: state[i*3+0])
    blocks.{i}.ffn.shift_state  [C]        with train.tune_shifts: the channel mix's, its ln2 output
                                           (pip: state[i*3+2])

`i` is the block's place in the stack. Every tensor starts at zero, so that step 0 is the frozen model
read from its usual zero state. A MoBA block's state is the keys and values it has read, nothing of a
fixed size to tune: it has no entry, stays frozen and starts empty. Without tuned shifts a row starts
with zero token shifts, as runtimes start a loaded state file (which holds no shifts).
"""

from __future__ import annotations

import torch
from torch import nn

from rwkvx_cli.config import STATE_TUNED_KINDS
from rwkvx_cli.models.model import LM


class _Slot(nn.Module):
    """A holder whose name gives the state's tensors RWKV-PEFT's names (`att`, `ffn`)."""


class _BlockState(nn.Module):
    def __init__(self, H: int, N: int, C: int, shifts: bool):
        super().__init__()
        self.att = _Slot()
        self.att.time_state = nn.Parameter(torch.zeros(H, N, N))
        if shifts:
            self.att.shift_state = nn.Parameter(torch.zeros(C))
            self.ffn = _Slot()
            self.ffn.shift_state = nn.Parameter(torch.zeros(C))


class InitialState(nn.Module):
    """The initial state of every row, trainable: `expand(B)` is a model state (models/model.py's list of
    per-block dicts) whose gradient reaches these tensors, summed over the rows."""

    def __init__(self, model: LM, shifts: bool = False):
        super().__init__()
        other = sorted(set(model.kinds) - set(STATE_TUNED_KINDS))
        if other:
            raise ValueError(f"state tuning takes RWKV-7 and MoBA blocks, not {', '.join(other)}")
        self.n_blocks, self.shifts = len(model.kinds), shifts
        self.blocks = nn.ModuleDict(
            {
                str(i): _BlockState(blk.att.n_head, blk.att.head_size, model.cfg.n_embd, shifts)
                for i, (kind, blk) in enumerate(zip(model.kinds, model.blocks, strict=True))
                if kind == "rwkv7"
            }
        )

    def tuned(self) -> list[int]:
        """The blocks with a tuned state (the RWKV-7 ones), bottom to top."""
        return [int(i) for i in self.blocks]

    def expand(self, B: int) -> list[dict[str, torch.Tensor] | None]:
        """The model state of B rows that start from this one (None for a MoBA block: empty)."""
        out: list[dict[str, torch.Tensor] | None] = [None] * self.n_blocks
        for i, blk in self.blocks.items():
            s = blk.att.time_state
            state = {"wkv": s.unsqueeze(0).expand(B, *s.shape)}
            if self.shifts:
                C = blk.att.shift_state.shape[0]
                state["att_shift"] = blk.att.shift_state.unsqueeze(0).expand(B, C)
                state["ffn_shift"] = blk.ffn.shift_state.unsqueeze(0).expand(B, C)
            out[int(i)] = state
        return out

