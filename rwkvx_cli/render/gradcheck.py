"""`rwkvx gradcheck`: a table per op and backend, a verdict per op, and the overall one."""

from __future__ import annotations

from rich.table import Table

from rwkvx_cli.render.console import out, print_wide, status_line, warning


def gradcheck_run(plan, seed: int, size: int, all_ops: bool) -> dict:
    """Run `rwkvx gradcheck`'s plan (tools/gradcheck.plan_gradcheck) with a status line, rendering each
    op's report as it ends, then (`all_ops`) the overall verdict. Returns the JSON summary."""
    import time

    from rwkvx_cli.tools.gradcheck import run_gradcheck

    results = []
    for spec, backends in plan:
        start = time.perf_counter()
        with status_line("gradcheck") as on_case:
            report = run_gradcheck(spec, backends, seed=seed, size=size, on_case=on_case)
        seconds = time.perf_counter() - start
        render_gradcheck(report)
        names = ", ".join(b.name for b in backends)
        out.print(f"{_verdict(report.passed)} {report.op}: {len(report.results)} cases, {names} in {seconds:.1f}s")
        results.append({**report.to_dict(), "seconds": seconds})
    passed = all(r["passed"] for r in results)
    seconds = sum(r["seconds"] for r in results)
    if all_ops:
        failed = [r["op"] for r in results if not r["passed"]]
        out.print(
            f"{_verdict(passed)} all: {len(results) - len(failed)} of {len(results)} ops passed in {seconds:.1f}s"
            + (f" (failed: {', '.join(failed)})" if failed else "")
        )
    return {"ops": results, "passed": passed, "seconds": seconds}


def warn_skipped_backend(backend: str, reason: str) -> None:
    warning(f"skipping the {backend!r} backend: {reason}")


def render_gradcheck(report) -> None:
    from rwkvx_cli.tools.gradcheck import THRESHOLD, VACUOUS_BELOW

    for backend in dict.fromkeys(r.backend for r in report.results):
        rows = [r for r in report.results if r.backend == backend]
        names = list(dict.fromkeys(c.name for r in rows for c in r.columns))
        table = Table(title=f"gradcheck {report.op} · backend {backend} · seed {report.seed}", title_justify="left")
        for head in ("gate", "case", "B×T×H×N"):
            table.add_column(head, no_wrap=True)
        for name in names:
            table.add_column(name, justify="right", no_wrap=True)
        table.add_column("worst rms", justify="right", no_wrap=True)
        table.add_column("", no_wrap=True)
        for r in rows:
            by_name = {c.name: c for c in r.columns}
            rms = max(c.rms_ratio for c in r.columns)
            table.add_row(
                f"{r.gate} {r.dtype.replace('float', 'fp')}",
                r.case,
                "×".join(str(v) for v in r.dims.values()),
                *(gradcheck_cell(by_name.get(n)) for n in names),
                f"{rms:.1e}",
                "[green]ok[/]" if r.passed else "[bold red]FAIL[/]",
            )
        print_wide(table)
    out.print(
        f"[dim]cells: max |g - ref| / (|ref| + 1e-6), pass < {THRESHOLD:g}; gate A vs the fp64 oracle, "
        f"gate B vs central finite differences; a gradient whose reference max |g| <= {VACUOUS_BELOW:g} "
        "is vacuous and fails[/]"
    )


def gradcheck_cell(col) -> str:
    from rwkvx_cli.tools.gradcheck import THRESHOLD

    if col is None:
        return "[dim]–[/]"
    if col.vacuous:
        return f"[bold red]vacuous {col.ref_max:.0e}[/]"
    colour = "green" if col.max_rel < THRESHOLD else "bold red"
    return f"[{colour}]{col.max_rel:.1e}[/]"


def _verdict(passed: bool) -> str:
    return "[bold green]PASS[/]" if passed else "[bold red]FAIL[/]"
