"""data.reset_at_eod through the CLI: a run on many short documents starts each from a zero state
(the model sees a start at every end-of-document token), resumes exactly with truncated BPTT and
chunked BPTT, validates and evaluates the way it trained, or either way when asked."""

import json

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.models.model import LM
from tests.train.helpers import losses, rollback_to, rows, tiny_args

runner = CliRunner()


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """300 short JSONL documents (each 20-60 bytes: several to a 32-token window)."""
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    with path.open("w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"doc {i}: " + "abcdefgh"[i % 8] * (10 + i % 40)}) + "\n")
    return path


def train(*args):
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result


def test_the_model_gets_a_start_at_every_end_of_document_token(tmp_path, documents, monkeypatch):
    seen = []
    forward = LM.forward

    def spy(self, idx, *args, starts=None, **kwargs):
        seen.append((idx.detach().clone(), None if starts is None else starts.detach().clone()))
        return forward(self, idx, *args, starts=starts, **kwargs)

    monkeypatch.setattr(LM, "forward", spy)
    train(*tiny_args(tmp_path / "run", documents, "data.reset_at_eod=true", "train.tokens=256"))
    assert seen and all(s is not None for _, s in seen)
    assert all(torch.equal(s, idx == 0) for idx, s in seen)  # byte tokenizer: <|eod|> is id 0
    windows = [s for idx, s in seen if idx.shape[1] == 32]  # training and validation (the rest: sampling)
    assert windows and sum(int(s.sum()) for s in windows) > len(windows)  # several documents per window


@pytest.mark.parametrize("extra", [["train.tbptt=true"], ["train.chunk_len=8"]])
def test_a_reset_run_differs_from_a_packed_one_and_resumes_exactly(tmp_path, documents, extra):
    reset = tmp_path / "reset"
    train(*tiny_args(reset, documents, "data.reset_at_eod=true", *extra))
    reference = losses(reset)
    packed = tmp_path / "packed"
    train(*tiny_args(packed, documents, *extra))
    assert losses(packed) != reference  # the setting changes what the model computes

    rollback_to(reset, 4)
    train(*tiny_args(reset, documents, "data.reset_at_eod=true", *extra), "--resume")
    assert losses(reset) == reference

    result = runner.invoke(app, ["eval", "--checkpoint", str(reset), "--json"])
    assert result.exit_code == 0, result.output
    validated = [r["val_loss"] for r in rows(reset) if r.get("val_loss") is not None]
    assert json.loads(result.stdout)["loss"] == pytest.approx(validated[-1], rel=1e-6)  # as training validated
    result = runner.invoke(app, ["eval", "--checkpoint", str(reset), "--by-position", "--max-len", "64", "--json"])
    assert result.exit_code == 0, result.output
    assert [r["reset_at_eod"] for r in json.loads(result.stdout)["runs"]] == [True]


def test_resume_refuses_to_switch_it(tmp_path, documents):
    run = tmp_path / "run"
    train(*tiny_args(run, documents, "train.tokens=512"))
    result = runner.invoke(app, ["train", *tiny_args(run, documents, "data.reset_at_eod=true"), "--resume"])
    assert result.exit_code == 2, result.output
    assert "data.reset_at_eod" in result.stderr and "Traceback" not in result.output


def _eval(run, *flags) -> dict:
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json", *flags])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_eval_reads_a_run_either_way(tmp_path, documents):
    """--reset-at-eod / --no-reset-at-eod evaluate as the flag says whatever the run trained with
    (the ablation's two evaluations); without either, as it trained."""
    run = tmp_path / "packed"
    train(*tiny_args(run, documents, "train.tokens=512"))
    default, carried, reset = _eval(run), _eval(run, "--no-reset-at-eod"), _eval(run, "--reset-at-eod")
    assert [e["reset_at_eod"] for e in (default, carried, reset)] == [False, False, True]
    assert default["loss"] == carried["loss"] != reset["loss"]
    validated = [r["val_loss"] for r in rows(run) if r.get("val_loss") is not None]
    assert carried["loss"] == pytest.approx(validated[-1], rel=1e-6)
    by_position = _eval(run, "--by-position", "--max-len", "64", "--reset-at-eod")
    assert [r["reset_at_eod"] for r in by_position["runs"]] == [True]
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--tasks", "lambada_openai", "--reset-at-eod"])
    assert result.exit_code == 2 and "--tasks" in result.stderr and "Traceback" not in result.output
