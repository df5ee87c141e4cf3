"""Export a checkpoint for other tools (docs/formats.md):

    rwkv-lm      RWKV-LM's `.pth` state dict (tensors only: `torch.load(weights_only=True)`, the `rwkv`
                 pip package), plain RWKV-7 stacks
    safetensors  rwkvx's own names, with the run's config in the file's metadata
    hf           a Hugging Face directory in fla's RWKV-7 layout (config.json, sharded safetensors,
                 the tokenizer's files), loadable by `transformers` with fla
    rwkv-x       RWKV-X's `.pth` layout (RWKV-7 and MoBA blocks)
    state        a state-tuned run's state as RWKV-PEFT's state file, what RWKV runtimes load
                 (`blocks.N.att.time_state`; runs/tuned.py)
    state-safetensors   the same state as rwkvx's state file, naming its base (`eval --state`)

Every format reads the checkpoint tensor by tensor and writes a temporary file or directory that
is renamed into place. Weights a reader would get wrong are refused unless `force`: non-finite
values, values the chosen dtype turns into inf (an fp16 export of |x| > 65504), and a model whose
`model.ln_x_eps` is not RWKV-LM's 64e-5 in a `.pth` format (rwkv-lm, rwkv-x), which holds no config:
its readers would normalise with 64e-5. (hf carries the eps in config.json; safetensors the config.)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError

from rwkvx_cli.checkpoints.find import open_weights
from rwkvx_cli.checkpoints.store import io_reason
from rwkvx_cli.config import LN_X_EPS, ModelConfig
from rwkvx_cli.errors import RwkvxError, UsageError
from rwkvx_cli.formats import export_hf, export_rwkv_x
from rwkvx_cli.formats.tensors import DictSource, TensorSource
from rwkvx_cli.formats.write import write_safetensors
from rwkvx_cli.fsio import check_output, create_temp, fsync_path
from rwkvx_cli.models import layer_kinds
from rwkvx_cli.runs import tuned as tuning
from rwkvx_cli.runs.opening import find_checkpoint
from rwkvx_cli.runs.tokenizers import run_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATE_FORMATS = ("state", "state-safetensors")
FORMATS = ("rwkv-lm", "safetensors", "hf", "rwkv-x", *STATE_FORMATS)


def export_checkpoint(
    checkpoint: Path, out: Path, fmt: str, dtype: str = "fp32", on_skip=None, force: bool = False
) -> dict:
    """`on_skip(path, reason)` hears of each damaged checkpoint passed over for an older one. `force`
    replaces an existing `out` and exports weights that `value_problems` finds (the summary's
    "warnings" say how many values). Never into a checkpoint or a prepared-data directory."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    out = Path(out)
    if fmt != "hf":
        check_output(out, force, "--out")
    ckpt = find_checkpoint(checkpoint, on_skip)
    base = tuning.base_of(ckpt.meta, str(ckpt.path))
    if fmt in STATE_FORMATS:
        if base is None:
            raise RwkvxError(
                f"{ckpt.path} is no state-tuned run's checkpoint (train.tune=state): it holds no tuned state"
            )
        return _export_state(ckpt, base, out, fmt, DTYPES[dtype], force)
    if base is not None:
        raise RwkvxError(
            f"{ckpt.path} holds a tuned initial state, not weights: export it with --format state or "
            f"state-safetensors; the weights it is tuned for are {base['weights']}"
        )
    other = sorted(set(layer_kinds(ckpt.config.model)) - {"rwkv7"})
    if fmt in ("rwkv-lm", "hf") and other:
        raise RwkvxError(f"the {fmt} format holds plain RWKV-7 models; this one has {', '.join(other)} blocks")
    eps_warnings = eps_problem(ckpt.config.model, fmt, force)
    # Verified by find_checkpoint; model.safetensors, or a sharded checkpoint's shards, tensor by tensor.
    with open_weights(ckpt.path, ckpt.meta) as source:
        warnings = eps_warnings + value_problems(source, DTYPES[dtype], str(ckpt.path), force)
        try:
            if fmt == "hf":
                tok = _tokenizer(ckpt)
                info = export_hf(source, out, cfg=ckpt.config.model, dtype=dtype, tokenizer=tok, force=force)
            elif fmt == "rwkv-x":
                info = export_rwkv_x(source, out, cfg=ckpt.config.model, dtype=dtype, force=force)
            else:
                info = _write_file(source, out, fmt, DTYPES[dtype], ckpt.meta)
        except (OSError, SafetensorError) as e:  # a full disk: the temporary file or directory is gone
            raise RwkvxError(f"cannot write {out}: {io_reason(e)}; {_intact(out)}") from None
        except RuntimeError as e:  # torch.save (rwkv-x) reports a failed write as RuntimeError
            if fmt != "rwkv-x":
                raise
            raise RwkvxError(f"cannot write {out}: {io_reason(e)}; {_intact(out)}") from None
    return {**info, "checkpoint": str(ckpt.path), "step": ckpt.step, "warnings": warnings}


def _export_state(ckpt, base: dict, out: Path, fmt: str, dtype: torch.dtype, force: bool) -> dict:
    """A state-tuned checkpoint's state: RWKV-PEFT's file (`state`: torch.save of time_state tensors alone,
    which is all its readers take: tuned token shifts are refused unless `force`, then left out with a
    warning) or rwkvx's (`state-safetensors`: every tensor, and the base in its metadata)."""
    tensors = tuning.checkpoint_state(ckpt.path, ckpt.meta)
    warnings = value_problems(DictSource(tensors), dtype, str(ckpt.path), force)
    shifts = tuning.tuned_shifts(tensors)
    if fmt == "state" and shifts:
        line = (
            "the state tunes the token shifts (train.tune_shifts), which RWKV-PEFT's state file cannot hold: its "
            "readers start them at zero and would compute other logits"
        )
        if not force:
            raise RwkvxError(
                f"{line}; export --format state-safetensors to keep them, or pass --force to leave them out"
            )
        warnings.append(line)
    kinds = layer_kinds(ckpt.config.model)
    if fmt == "state":
        written = tuning.peft_state(tensors, kinds, dtype)
    else:
        written = {name: t.to(dtype).contiguous() for name, t in tensors.items()}
        info = tuning.state_file_meta(base, ckpt.config.model, ckpt.step, str(ckpt.path), shifts)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, f = create_temp(out)
    try:
        with f:
            if fmt == "state":
                torch.save(written, f)
        if fmt == "state-safetensors":
            write_safetensors(DictSource(written), tmp, list(written), {tuning.STATE_META: json.dumps(info)})
        fsync_path(tmp)
        os.replace(tmp, out)
    except (OSError, SafetensorError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        tmp.unlink(missing_ok=True)
        raise RwkvxError(f"cannot write {out}: {io_reason(e)}; {_intact(out)}") from None
    return {
        "out": str(out), "format": fmt, "tensors": len(written), "checkpoint": str(ckpt.path), "step": ckpt.step,
        "warnings": warnings, "base": base["weights"],
    }  # fmt: skip


def eps_problem(model: ModelConfig, fmt: str, force: bool) -> list[str]:
    """A `.pth` format has no config, and its readers (RWKV-LM, the rwkv and rwkv-x packages) use
    RWKV-LM's ln_x eps: another model.ln_x_eps is refused (RwkvxError) unless `force`, then a warning."""
    if fmt not in ("rwkv-lm", "rwkv-x") or math.isclose(model.ln_x_eps, LN_X_EPS, rel_tol=1e-9):
        return []
    line = (
        f"model.ln_x_eps is {model.ln_x_eps:g}, but the {fmt} .pth holds no config and its readers use RWKV-LM's "
        f"{LN_X_EPS:g}, so they would compute other logits"
    )
    if not force:
        raise RwkvxError(f"{line}; export --format hf or safetensors to keep it, or pass --force to export anyway")
    return [line]


def value_problems(source: TensorSource, dtype: torch.dtype, where: str, force: bool) -> list[str]:
    """Count the non-finite values, and the finite ones `dtype` cannot hold, tensor by tensor; refuse
    (RwkvxError) when there are any, unless `force`: then they come back as warnings."""
    bad: dict[str, list[str]] = {"non-finite": [], "overflowing": []}
    counts = {"non-finite": 0, "overflowing": 0}
    for name in source.names():
        t = source.get(name)
        if t.is_floating_point():
            finite = torch.isfinite(t)
            for what, n in (
                ("non-finite", int((~finite).sum())),
                ("overflowing", int((finite & ~torch.isfinite(t.to(dtype))).sum())),
            ):
                if n:
                    counts[what] += n
                    bad[what].append(name)
        source.release(name)
    lines = []
    if counts["non-finite"]:
        lines.append(f"{counts['non-finite']:,} non-finite values (in {_names(bad['non-finite'])})")
    if counts["overflowing"]:
        target = str(dtype).removeprefix("torch.")
        lines.append(f"{counts['overflowing']:,} values too large for {target} (in {_names(bad['overflowing'])})")
    if lines and not force:
        raise RwkvxError(f"{where}: {'; '.join(lines)}; a reader would get inf/NaN; pass --force to export anyway")
    return lines


def _intact(out: Path) -> str:
    """What a failed export left at `out` (it writes a temporary sibling, renamed when whole)."""
    if out.exists():
        return f"the {'directory' if out.is_dir() else 'file'} that was there is unchanged; the checkpoint is intact"
    return "nothing was written there; the checkpoint is intact"


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" +{len(names) - 3} more" if len(names) > 3 else "")


def _tokenizer(ckpt):
    """The run's tokenizer for the HF directory's tokenizer files (None when the run's data is gone)."""
    try:
        return run_tokenizer(ckpt.config, ckpt.run_dir)
    except RwkvxError:
        return None


class _Cast(TensorSource):
    """`base`'s tensors, each cast to `dtype` when it is read."""

    def __init__(self, base: TensorSource, dtype: torch.dtype):
        self.base, self.to = base, dtype

    def names(self):
        return self.base.names()

    def shape(self, name):
        return self.base.shape(name)

    def dtype(self, name):
        return self.to

    def get(self, name):
        return self.base.get(name).to(self.to).contiguous()

    def release(self, name):
        self.base.release(name)


def _write_file(source: TensorSource, out: Path, fmt: str, dtype: torch.dtype, meta: dict) -> dict:
    """One file; safetensors is streamed tensor by tensor (a sharded checkpoint's too: its rows are
    gathered one tensor at a time, so the model is never held whole); rwkv-lm's torch.save takes a dict."""
    names = source.names()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, f = create_temp(out)  # a new file: a link planted at the temporary name is not followed
    try:
        with f:
            if fmt == "rwkv-lm":
                torch.save({name: source.get(name).to(dtype).contiguous() for name in names}, f)
        if fmt == "safetensors":
            info = {"rwkvx_config": json.dumps(meta["config"]), "step": str(meta["step"])}
            write_safetensors(_Cast(source, dtype), tmp, names, info)
        fsync_path(tmp)
        os.replace(tmp, out)
    except (OSError, SafetensorError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        tmp.unlink(missing_ok=True)
        raise RwkvxError(f"cannot write {out}: {io_reason(e)}; {_intact(out)}") from None
    return {"out": str(out), "format": fmt, "tensors": len(names)}
