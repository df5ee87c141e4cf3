"""`rwkvx bench`: the op table, `--model`'s figures of a training step, and the status line."""

from __future__ import annotations

from rich.table import Table

from rwkvx_cli.render.console import out, print_wide, status_line


def bench_status(interval: float = 30.0):
    """`rwkvx bench`'s status_line; yields its callback (the row being timed)."""
    return status_line("bench", interval)


def render_bench(report, baseline: str) -> None:
    isa = ""  # which build of the fused CPU kernels ran: their speed depends on it
    if report.device == "cpu":
        isa = f" · {report.cpu_isa} kernels" if report.cpu_isa else " · no cpu kernels"
    table = Table(
        title=f"bench · {report.device}{isa} · {report.threads} threads · "
        f"matmul peak {report.matmul_gflops:,.0f} GFLOP/s",
        title_justify="left",
    )
    for head in ("op", "backend", "shape", "dtype", "mode"):
        table.add_column(head, no_wrap=True)
    for head in ("median ms", "± spread", "tokens/s", "GFLOP/s", "% peak", "matmul", "mem MiB", f"x {baseline}"):
        table.add_column(head, justify="right", no_wrap=True)
    for r in report.rows:
        shape = "×".join(str(r.dims[d]) for d in "BTHN")
        if r.dims.get("starts_every"):  # a document start every K tokens
            shape += f" ·doc {r.dims['starts_every']}"
        if r.error:
            table.add_row(r.op, r.backend, shape, r.dtype, r.mode, f"[dim]{r.error}[/]", *[""] * 7)
            continue
        table.add_row(
            r.op,
            r.backend,
            shape,
            r.dtype,
            r.mode,
            f"{r.median_ms:,.2f}",
            f"{r.spread_pct:.0f}%",
            f"{r.tokens_per_s:,.0f}",
            f"{r.gflops:,.1f}",
            f"{r.pct_of_peak:.1f}",
            f"{r.matmul_gflops:,.0f}" if r.matmul_gflops else "–",
            f"{r.memory_mb:,.1f}",
            f"{r.speedup:,.1f}" if r.speedup is not None else "–",
        )
    print_wide(table)
    out.print(
        "[dim]GFLOP/s counts each op's useful FLOPs (docs/operators.md); % peak divides it by `matmul`, the "
        "matmul rate measured just before and after the row (their mean; the title's: the run's first); mem = "
        "bytes saved for backward plus outputs (CPU) or peak allocated (CUDA)[/]"
    )


def render_model_bench(r: dict) -> None:
    sets = "".join(f" {o}" for o in r.get("overrides", ()))
    chunked = f" · chunk_len {r['chunk_len']}" if r.get("chunk_len") else ""
    title = (
        f"bench --model {r['config']}{sets} · {r['device']} · {r['precision']} · B={r['batch']} T={r['ctx_len']}"
        f" · head {r['head']}{' · grad_cp' if r['grad_cp'] else ''}{chunked}"
    )
    other = next((name for name in ("gpt", "unchunked", "unfused", "packed", "finetune") if name in r), None)
    gpt = r.get(other) if other else None
    table = Table(title=title, title_justify="left")
    table.add_column("figure")
    table.add_column("this config" if gpt else "value", justify="right")
    if gpt:
        table.add_column({"gpt": "GPT", "finetune": "full fine-tuning"}.get(other, other), justify="right")

    def fmt(val) -> str:
        if val is None:
            return ""
        return f"{val:,.1f}" if isinstance(val, float) else f"{val:,}"

    for key, label in (
        ("tokens_per_s", "tokens/s"),
        ("step_ms", "ms / step"),
        ("parameters", "parameters"),
        ("trainable", "  trainable"),
        ("recurrence_pct", "recurrence ops %"),
        ("matmul_pct", "matmuls %"),
        ("fused_pct", "fused block kernels %"),
        ("other_pct", "other %"),
        ("train_flops_per_token", "train FLOPs / token"),
        ("matmul_gflops", "matmul peak GFLOP/s"),
        ("mfu_pct", "MFU %"),
        ("peak_mb", "peak memory of a step MiB"),
        ("grads_mb", "  of which gradients MiB"),
        ("activation_mb", "  activations + transients MiB"),
        ("optimizer_mb", "optimizer state MiB"),
        ("checkpoint_mb", "a checkpoint's tensors MiB"),
        ("ops", "ops per block, fwd + bwd"),
    ):
        row = [label, fmt(_figure(r, key))]
        if gpt:
            row.append(fmt(_figure(gpt, key)))
        table.add_row(*row)
    out.print(table)
    kind = r["ops_per_block"]["kind"]
    out.print(f"[dim]ops per block: {kind} blocks, forward + backward, counted as docs/benchmarks.md#op-count says[/]")
    if "fused_speedup" in r:
        ratio = r["activation_mb"] / gpt["activation_mb"] if gpt["activation_mb"] else float("nan")
        out.print(
            f"[bold]fused / unfused: {r['fused_speedup']:.2f}x the tokens/s, {ratio:.2f}x the activation memory[/]"
            f" · {r['timing']}"
        )
    elif "reset_over_packed" in r:
        out.print(
            f"[bold]data.reset_at_eod / packed step time: {r['reset_over_packed']:.2f}x[/] · "
            f"a document every {r['document_len']} tokens · {r['timing']}"
        )
    elif "chunked_over_unchunked" in r:
        out.print(f"[bold]chunked / unchunked step time: {r['chunked_over_unchunked']:.2f}x[/] · {r['timing']}")
    elif "state_over_finetune" in r:
        q = r["state_over_finetune"]
        out.print(
            f"[bold]state tuning / full fine-tuning: {q['step_time']:.2f}x the step time, "
            f"{q['optimizer_memory']:.2%} of the optimizer state, {q['checkpoint']:.2%} of a checkpoint[/] · "
            f"{r['timing']}"
        )
    elif gpt:
        out.print(
            f"[bold]this config / GPT tokens/s: {r['rwkv_over_gpt']:.2f}x[/] · GPT: {gpt['shape']} · {r['timing']}"
        )
        out.print(f"[dim]GPT train FLOPs / token = {gpt['flops_formula']}[/]")
    if r.get("optimizers"):
        shares = " · ".join(
            f"{kind} {o['step_ms']:,.1f} ms ({o['share_pct']:.2g}% of a {o['train_step_ms']:,.0f} ms step)"
            for kind, o in r["optimizers"].items()
        )
        accum = f", {r['grad_accum']} micro-batches a step" if r.get("grad_accum", 1) > 1 else ""
        out.print(f"optimizer step (this run: {r['optimizer']}{accum}): {shares}")
    if r.get("tune") == "state":
        origin = f"from {r['state']}" if r.get("state") else "from zeros"
        out.print(f"state tuning: the weights frozen, the initial state ({origin}) the one thing trained, by AdamW")
    out.print(f"[dim]{r['mfu_formula']}[/]")


def _figure(r: dict, key: str):
    return r.get("ops_per_block", {}).get("ops") if key == "ops" else r.get(key)
