"""An `ExplainResult` as a terminal table (rich), JSON, a self-contained HTML page, or a PNG:
the text coloured by relevance, red where a token raises the explained logit, blue where it
lowers it, the strength scaled to the largest |relevance|. Nothing here prints."""

from __future__ import annotations

import html
import io
import json
from pathlib import Path

from rich.table import Table
from rich.text import Text

from rwkvx_cli.explain.lrp import ExplainResult
from rwkvx_cli.fsio import check_output, write_output

RED = (214, 39, 40)
BLUE = (31, 119, 180)


def shown(token: str) -> str:
    """A token as text to show: control characters as symbols, so every token has a width."""
    if token == "":
        return "∅"
    return token.replace("\n", "↵").replace("\t", "→").replace("\r", "␍")


def _scale(values: list[float]) -> float:
    top = max((abs(v) for v in values), default=0.0)
    return top if top > 0 else 1.0


def _summary(r: ExplainResult) -> str:
    total = sum(r.relevance)
    parts = [f"logit {r.logit:.4f} = tokens {total:.4f} + norm biases {r.bias:.4f}"]
    if r.epsilon > 0:
        parts.append(f" + absorbed by ε {r.absorbed:.4f}")
    else:
        parts.append(f" (rounding {r.absorbed:.1e})")
    return "".join(parts)


def _title(r: ExplainResult) -> str:
    return (
        f"relevance for {r.target_token!r} (id {r.target_id}, p = {r.probability:.3f}) "
        f"after token {r.position}, ε = {r.epsilon:g}"
    )


def relevance_table(r: ExplainResult) -> Table:
    """One row per input token: its relevance and share of Σ|R|; with per-layer results, the
    relevance of that token's residual stream after each block as further columns."""
    table = Table(title=_title(r), caption=_summary(r), title_justify="left", caption_justify="left")
    table.add_column("#", justify="right")
    table.add_column("token", no_wrap=True)
    table.add_column("relevance", justify="right")
    table.add_column("share", justify="right")
    for layer in r.layers or []:
        table.add_column(f"b{layer.block} {layer.kind}", justify="right")
    table.add_column("")
    absolute = sum(abs(v) for v in r.relevance) or 1.0
    top = _scale(r.relevance)
    for t, (token, rel) in enumerate(zip(r.tokens, r.relevance, strict=True)):
        colour = "red" if rel > 0 else "blue"
        bar = Text("█" * round(12 * abs(rel) / top), style=colour)
        per_layer = [f"{layer.relevance[t]:+.4f}" for layer in r.layers or []]
        table.add_row(
            str(t), repr(token), Text(f"{rel:+.4f}", style=colour), f"{abs(rel) / absolute:.1%}", *per_layer, bar
        )
    return table


def to_json(r: ExplainResult) -> str:
    return json.dumps(r.to_dict(), indent=2, ensure_ascii=False) + "\n"


def check_outputs(json_path: Path | None, html_path: Path | None, png_path: Path | None, force: bool) -> None:
    """Refuse bad --json/--html/--png targets before anything is computed (fsio.check_output)."""
    for path, flag in ((json_path, "--json"), (html_path, "--html"), (png_path, "--png")):
        if path is not None:
            check_output(Path(path), force, flag)


def write_json(r: ExplainResult, path: Path, force: bool = False) -> Path:
    return write_output(Path(path), to_json(r), force=force, flag="--json")


def _background(rel: float, top: float) -> str:
    red, green, blue = RED if rel > 0 else BLUE
    return f"rgba({red},{green},{blue},{0.85 * min(abs(rel) / top, 1.0):.3f})"


def _spans(tokens: list[str], values: list[float], top: float) -> str:
    out = []
    for t, (token, rel) in enumerate(zip(tokens, values, strict=True)):
        text = html.escape(shown(token)) + ("\n" if "\n" in token else "")
        tip = html.escape(f"#{t} {token!r}: {rel:+.5f}", quote=True)
        out.append(f'<span style="background:{_background(rel, top)}" title="{tip}">{text}</span>')
    return "".join(out)


_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 2em auto; max-width: 64em;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.3em; margin-bottom: .2em; }
.meta { color: #555; margin: .2em 0; }
.text { font-family: ui-monospace, 'DejaVu Sans Mono', Menlo, Consolas, monospace; font-size: 16px;
        line-height: 1.9; white-space: pre-wrap; word-break: break-all; border: 1px solid #ccc;
        border-radius: 4px; padding: .8em 1em; margin: 1em 0; }
.text span { border-radius: 2px; }
.legend { display: flex; align-items: center; gap: .6em; font-size: .9em; color: #555; }
.bar { width: 16em; height: .9em; border: 1px solid #ccc;
       background: linear-gradient(to right, rgba(31,119,180,.85), #fff, rgba(214,39,40,.85)); }
.layers { overflow-x: auto; margin-top: 1.5em; }
.layers table { border-collapse: collapse; font-family: ui-monospace, 'DejaVu Sans Mono', monospace;
                font-size: 13px; }
.layers td { padding: 2px 1px; text-align: center; white-space: pre; min-width: .8em; }
.layers th { text-align: right; padding-right: .6em; font-weight: normal; color: #555; white-space: nowrap; }
"""


def to_html(r: ExplainResult) -> str:
    """A self-contained page (inline CSS, no scripts or external assets)."""
    top = _scale(r.relevance)
    where = f"{html.escape(r.checkpoint)} (step {r.step})" if r.checkpoint else "a model"
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>rwkvx explain: {html.escape(repr(r.target_token))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Why {html.escape(repr(r.target_token))} next?</h1>",
        f'<p class="meta">Relevance of each input token for the logit of {html.escape(repr(r.target_token))} '
        f"(id {r.target_id}, p = {r.probability:.3f}) after the last token, by LRP (ε = {r.epsilon:g}), "
        f"from {where}.</p>",
        f'<p class="meta">{html.escape(_summary(r))}</p>',
        f'<div class="text">{_spans(r.tokens, r.relevance, top)}</div>',
        f'<div class="legend"><span>lowers the logit</span><span class="bar"></span><span>raises it</span>'
        f"<span>(full colour: |relevance| = {top:.4f})</span></div>",
    ]
    if r.layers:
        rows = [("input", r.relevance)] + [(f"after block {x.block} ({x.kind})", x.relevance) for x in r.layers]
        cells = []
        for name, values in reversed(rows):
            scale = _scale(values)
            tds = "".join(
                f'<td style="background:{_background(v, scale)}" title="{html.escape(f"#{t} {tok!r}: {v:+.5f}")}">'
                f"{html.escape(shown(tok))}</td>"
                for t, (tok, v) in enumerate(zip(r.tokens, values, strict=True))
            )
            cells.append(f"<tr><th>{html.escape(name)}</th>{tds}</tr>")
        parts += [
            '<div class="layers"><p class="meta">Relevance of the residual stream after each block, top to '
            "bottom (each row scaled to its own largest |relevance|; RWKV-7's v_first and the norm biases carry "
            "the rest):</p>",
            f"<table>{''.join(cells)}</table></div>",
        ]
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_html(r: ExplainResult, path: Path, force: bool = False) -> Path:
    return write_output(Path(path), to_html(r), force=force, flag="--html")


def write_png(r: ExplainResult, path: Path, force: bool = False, columns: int = 72) -> Path:
    """The text coloured by relevance as a PNG, written at exactly `path` (no suffix added)."""
    return write_output(Path(path), to_png(r, columns), force=force, flag="--png")


def to_png(r: ExplainResult, columns: int = 72) -> bytes:
    """The coloured text as a PNG (matplotlib, monospace, wrapped at `columns` characters)."""
    from matplotlib.figure import Figure  # not pyplot: no backend or global state to touch
    from matplotlib.patches import Rectangle

    top = _scale(r.relevance)
    placed, line, col = [], 0, 0  # (token text, line, column, relevance)
    for token, rel in zip(r.tokens, r.relevance, strict=True):
        text = shown(token)
        if col + len(text) > columns and col > 0:
            line, col = line + 1, 0
        placed.append((text, line, col, rel))
        col += len(text)
        if "\n" in token:
            line, col = line + 1, 0
    lines = line + 1
    font, char_w, line_h = 13, 0.602, 1.9  # DejaVu Sans Mono's advance is 0.602 em
    width_in = (columns * char_w + 2) * font / 72
    height_in = (lines * line_h + 4.5) * font / 72
    fig = Figure(figsize=(width_in, height_in), dpi=150)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-1, columns * char_w + 1)
    ax.set_ylim(lines * line_h + 4.5, 0)
    ax.axis("off")
    ax.text(0, 1.0, _title(r), fontsize=font * 0.85, family="DejaVu Sans", va="center")
    ax.text(0, 2.3, _summary(r), fontsize=font * 0.75, family="DejaVu Sans", va="center", color="#555")
    for text, ln, c, rel in placed:
        y = 3.8 + ln * line_h
        colour = tuple(ch / 255 for ch in (RED if rel > 0 else BLUE))
        ax.add_patch(
            Rectangle((c * char_w, y - 0.75), len(text) * char_w, 1.5, color=(*colour, 0.85 * min(abs(rel) / top, 1)))
        )
        ax.text(c * char_w, y, text, fontsize=font, family="DejaVu Sans Mono", va="center")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
