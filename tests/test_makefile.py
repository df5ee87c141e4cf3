"""The Makefile's training targets (issue 33): `make demo` run again after an interrupted demo
continues it, and after a finished one says there is nothing to do, instead of exiting 2 with
"pass --resume" (which make gives no way to pass). Each target's command line is read from
`make -n` and run in process on a tiny model, with dotted overrides appended."""

import re
import shlex
import shutil
import subprocess

import pytest
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from tests.train.helpers import REPO, one_thread, rollback_to

MAKEFILE = REPO / "Makefile"
STAMP = ".venv/.installed"  # the install prerequisite: `-o` keeps `make -n` from listing its recipe
runner = CliRunner()


def train_targets() -> list[str]:
    """The targets whose recipe runs `rwkvx train` (or `-m rwkvx_cli train`)."""
    targets, current = [], None
    for line in MAKEFILE.read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9_.-]+):(?!=)", line):
            current = match.group(1)
        elif line.startswith("\t") and re.search(r"rwkvx(_cli)? train\b", line) and current not in targets:
            targets.append(current)
    return targets


def make_train_args(target: str) -> list[str]:
    """The arguments after `rwkvx` of the target's command, as make would run it."""
    lines = subprocess.run(
        ["make", "-s", "-n", "-o", STAMP, target], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    (line,) = [ln for ln in lines if re.search(r"rwkvx(_cli)? train\b", ln)]
    words = shlex.split(line)
    at = next(i for i, w in enumerate(words) if w.endswith("rwkvx") or w == "rwkvx_cli")
    return words[at + 1 :]


def test_the_demo_targets_are_found():
    assert {"demo", "demo-rwkvx"} <= set(train_targets())


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", train_targets())
def test_a_train_target_run_again_continues_or_has_nothing_to_do(tmp_path, corpus, target, monkeypatch):
    monkeypatch.setattr("rwkvx_cli.train.runner.SAMPLE_TOKENS", 4)  # the closing sample: not this test's subject
    args = make_train_args(target)
    assert args[0] == "train", shlex.join(args)
    tiny = [
        f"run_dir={tmp_path / 'run'}",
        f"data.corpus=[{corpus}]",
        f"data.prepared_dir={tmp_path / 'data'}",
        "model.n_layer=2",
        "model.n_embd=64",
        "model.head_size=32",
        "train.ctx_len=32",
        "train.micro_batch=2",
        "train.tokens=192",  # 3 steps
        "train.warmup_tokens=64",
        "train.ckpt_interval=1",
        "train.eval_interval=100",
        "train.eval_tokens=128",
        "model.moba_chunk=16",  # demo-rwkvx's MoBA blocks: two chunks a window
    ]

    def run():
        with one_thread():  # a model this small runs fastest on one thread
            result = runner.invoke(app, [*args, *tiny])
        assert result.exit_code == 0, result.output
        return result.output

    run()  # the first run: no checkpoint yet
    assert (tmp_path / "run" / "checkpoints" / "step_00000003").is_dir()
    rollback_to(tmp_path / "run", 1)  # as if the demo had been stopped after its first step
    assert "resumed from step 1" in run()
    assert (tmp_path / "run" / "checkpoints" / "step_00000003").is_dir()
    assert "nothing to do" in run()  # finished: make demo again is a no-op
