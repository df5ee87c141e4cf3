"""`rwkvx data prepare` and `data merge`: the summary line, warnings, and the progress bar."""

from __future__ import annotations

import contextlib

from rwkvx_cli.render.console import err, fmt_count, fmt_seconds, out, progress, warning


def render_prepared(stats) -> None:
    out.print(prepared_line(stats), soft_wrap=True)
    prepare_warnings(stats)
    if stats.skipped_records:
        warning(f"skipped {stats.skipped_records:,} bad records (first: {stats.first_skipped})")


def print_prepared(stats) -> None:
    """The summary line alone: the data a run prepared first (`init`, `train`)."""
    out.print(prepared_line(stats))


def prepared_line(stats) -> str:
    return (
        f"prepared {stats.documents:,} documents, {stats.bytes / 1e6:.2f} MB -> {stats.train_tokens:,} train + "
        f"{stats.val_tokens:,} val tokens ({stats.tokenizer_kind} tokenizer, vocab {stats.vocab_size:,}) "
        f"at {stats.mb_per_s:.1f} MB/s into {stats.out_dir}"
        + (
            f"; template {stats.template}: {stats.train_loss_tokens:,} train tokens carry loss"
            if getattr(stats, "template", None)
            else ""
        )
    )


def prepare_warnings(stats) -> None:
    """What a prepare's summary line leaves out: that it resumed, and long documents cut with no safe point."""
    if stats.resumed_bytes:
        err.print(
            f"resumed: {stats.resumed_bytes / 1e6:,.1f} of {stats.bytes / 1e6:,.1f} MB were tokenized before",
            markup=False, soft_wrap=True,
        )
    if stats.forced_cuts:
        err.print(
            f"[yellow]warning:[/] {stats.forced_cuts:,} cuts in long runs without a point where the tokenizer may "
            f"be cut (its safe cuts: {stats.cut_rule}); near them the ids may differ from encoding the whole document",
            soft_wrap=True,
        )


def render_merged(stats) -> None:
    out.print(
        f"merged {stats.directories} prepared directories into {stats.out_dir}: train {stats.train_tokens:,} tokens "
        f"({stats.train_documents:,} documents), val {stats.val_tokens:,} tokens ({stats.val_documents:,} documents)",
        markup=False, soft_wrap=True, highlight=False,
    )


@contextlib.contextmanager
def prepare_progress(interval: float = 30.0):
    """`data prepare`'s progress (see `progress`): MB/s, documents, tokens and the ETA from the input sizes.
    Yields the callback for PrepareProgress reports."""
    with progress(interval) as report:
        yield lambda p: report("tokenizing", p.bytes_done, p.bytes_total, "bytes", prepare_status(p))


def prepare_status(p) -> str:
    """'12.3/45.6 MB (27%) · 1,234 docs · 5.60M tokens · 10.2 MB/s · ETA 3m05s' of a PrepareProgress."""
    share = f" ({100 * p.bytes_done / p.bytes_total:.0f}%)" if p.bytes_total else ""
    eta = p.eta_seconds
    tail = f" · ETA {fmt_seconds(eta)}" if eta is not None and p.bytes_done < p.bytes_total else ""
    return (
        f"{p.bytes_done / 1e6:,.1f}/{p.bytes_total / 1e6:,.1f} MB{share} · {p.documents:,} docs · "
        f"{fmt_count(p.tokens)} tokens · {p.mb_per_s:.1f} MB/s{tail}"
    )


@contextlib.contextmanager
def data_progress():
    """A progress bar (stderr, erased when done) around data preparation; yields its callback (done, total)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
    )
    task = progress.add_task("tokenizing", total=None)
    with progress:
        yield lambda done, total: progress.update(task, completed=done, total=total)
