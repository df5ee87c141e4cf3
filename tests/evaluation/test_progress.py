"""Progress of long work, `rwkvx eval`'s above all (render.console.progress, as `data prepare` shows its
own; bench and gradcheck through render.console.status_line): piped, a plain line on stderr now and then
and when a phase ends; stdout (the figures, --json) unchanged. And the passkey picture."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.config import ModelConfig
from rwkvx_cli.data import ByteTokenizer
from rwkvx_cli.evaluation import long_context as lc
from rwkvx_cli.models import build_model
from rwkvx_cli.render import console
from rwkvx_cli.render.bench import bench_status
from rwkvx_cli.runs.runtime import Runtime

runner = CliRunner()


def test_piped_progress_is_a_plain_line_now_and_then_and_at_the_end(capsys):
    with console.progress(interval=3600.0) as report:
        report("passkey", 0, 40)
        report("passkey", 10, 40)  # within the interval: no line
        report("passkey", 40, 40)  # the phase ends: a line
    lines = capsys.readouterr()
    assert lines.out == ""
    assert len(lines.err.splitlines()) == 1 and lines.err.startswith("passkey 40/40 tokens (100%) · ")
    with console.progress(interval=0.0) as report:  # every report past the interval: a line each
        report("by position", 5, 20)
        report("tokenizing", 1, 2, "bytes", "half the input")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("by position 5/20 tokens (25%) · ") and "ETA" in err[0]
    assert err[1] == "tokenizing half the input"


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    run_dir = tmp_path_factory.mktemp("progress") / "run"
    args = [f"run_dir={run_dir}", f"data.corpus=[{corpus}]", "model.n_layer=1", "model.n_embd=32"]
    result = runner.invoke(app, ["init", *args, "model.head_size=16"])
    assert result.exit_code == 0, result.output
    return run_dir


def test_plain_eval_shows_progress_on_stderr_when_piped(run):
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)  # stdout: the figures alone
    assert f"validation {figures['tokens']:,}/{figures['tokens']:,} tokens (100%)" in result.stderr
    table = runner.invoke(app, ["eval", "--checkpoint", str(run), "--generate", "the", "--tokens", "3"])
    assert table.exit_code == 0, table.output
    assert table.stdout.startswith("step 0: val loss ") and "validation" not in table.stdout
    assert "generating 3/3 tokens (100%)" in table.stderr


def test_passkey_reports_the_prompt_tokens_it_has_read():
    cfg = ModelConfig(vocab_size=256, n_embd=32, head_size=16, layers=["rwkv7"])
    model = build_model(cfg, 0)
    tokens = np.frombuffer(("the quick brown fox. " * 60).encode(), dtype=np.uint8)
    seen = []
    result = lc.passkey(
        model, ByteTokenizer(), tokens, Runtime(torch.device("cpu"), "fp32"), [128, 160], depths=[0.0, 1.0],
        trials=2, on_progress=lambda what, done, total: seen.append((what, done, total)),
    )
    total = (128 + 160) * 2 * 2
    assert seen[0] == ("passkey", 0, total) and seen[-1] == ("passkey", total, total)
    assert all(a[1] <= b[1] for a, b in zip(seen, seen[1:], strict=False)) and len(seen) > 4
    assert result["chance"] == pytest.approx(1 / 90_000)  # a guess of the five-digit key


def test_the_passkey_picture_reads_at_both_ends_and_marks_chance():
    from matplotlib.colors import to_rgb

    from rwkvx_cli.evaluation import plots

    depths = [0.0, 1.0]
    cells = [dict(length=128, depth=d, trials=4, correct=4 * d, accuracy=d) for d in depths]
    result = dict(lengths=[128], depths=depths, trials=4, step=3, ctx_len=256, chance=lc.CHANCE, cells=cells)
    fig = plots.passkey_figure(result)
    try:
        ax, bar = fig.axes
        cmap = ax.images[0].get_cmap()
        for text, value in zip(ax.texts, (0.0, 1.0), strict=True):  # an empty cell and a full one
            assert text.get_text().startswith(f"{value:.0%}")
            assert plots.contrast(cmap(value), to_rgb(text.get_color())) >= 7.0  # WCAG AAA
        assert plots.contrast(cmap(0.0), cmap(1.0)) >= 7.0  # the ends of the scale are told apart
        assert "chance 0.0011% (1 in 90,000)" in bar.get_ylabel()
        assert any(list(line.get_ydata()) == [lc.CHANCE, lc.CHANCE] for line in bar.lines)  # the mark
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_piped_bench_and_gradcheck_say_now_and_then_what_they_are_at(capsys):
    with bench_status(interval=0.0) as on_row:
        on_row("wkv7 reference {'B': 1} fwdbwd")
    with console.status_line("gradcheck", interval=3600.0) as on_case:
        on_case("cpu: gate A, small")  # within the interval: no line
    lines = capsys.readouterr()
    assert lines.err.splitlines() == ["bench wkv7 reference {'B': 1} fwdbwd"] and lines.out == ""
