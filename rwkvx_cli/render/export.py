"""`rwkvx export`: what was written, and what the format left out."""

from __future__ import annotations

from rwkvx_cli.render.console import out, warning


def render_export(info: dict) -> None:
    for line in info["warnings"]:
        warning(f"exported anyway (--force): {line}")
    out.print(f"wrote {info['out']} ({info['format']}, {info['tensors']} tensors, step {info['step']})", markup=False)
    if info.get("left_out"):
        out.print(f"not in the format (unused by it): {', '.join(info['left_out'])}", markup=False)
    if info.get("base"):
        out.print(f"a state tuned for the weights of {info['base']}", markup=False)
    if info.get("tokenizer"):
        out.print(f"tokenizer: {info['tokenizer']}", markup=False)
    if info.get("rwkv_x_args"):
        out.print("RWKV-X: " + " ".join(f"--{k} {v}" for k, v in info["rwkv_x_args"].items()), markup=False)
