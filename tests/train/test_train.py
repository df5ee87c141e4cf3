"""Training through the CLI on a tiny config: exact resume, run files, bad input."""

import json

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from tests.train.helpers import REPO, cli_command, env, losses, rollback_to, rows, tiny_args

runner = CliRunner()


def train(*args):
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, corpus):
    full = tmp_path / "full"
    train(*tiny_args(full, corpus))
    reference = losses(full)
    assert len(reference) == 10 and reference[-1] < reference[0]

    interrupted = tmp_path / "interrupted"
    train(*tiny_args(interrupted, corpus))
    ckpts = sorted((interrupted / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_00000004", "step_00000008", "step_00000010"]
    for later in ckpts[1:]:  # roll the run back to its step-4 checkpoint
        for f in later.iterdir():
            f.unlink()
        later.rmdir()
    result = train(*tiny_args(interrupted, corpus), "--resume")
    assert "resumed from step 4" in result.output
    assert losses(interrupted) == reference  # bit-identical, including the steps before the checkpoint
    assert (interrupted / "config.yaml").is_file() and (interrupted / "tokenizer.json").is_file()


def test_train_refuses_to_overwrite_a_run_without_resume(tmp_path, corpus):
    run = tmp_path / "run"
    train(*tiny_args(run, corpus, "train.tokens=256"))
    result = runner.invoke(app, ["train", *tiny_args(run, corpus, "train.tokens=256")])
    assert result.exit_code == 2 and "--resume" in result.stderr


def test_eval_and_generate(tmp_path, corpus):
    run = tmp_path / "run"
    train(*tiny_args(run, corpus, "train.tokens=256"))
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json", "--generate", "line", "--tokens", "8"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["step"] == 2 and data["bpb"] > 0 and data["tokens"] > 0 and data["sample"].startswith("line")


def test_eval_finds_the_data_of_a_run_trained_on_a_prepared_directory(tmp_path, corpus):
    data = tmp_path / "prepared"
    result = runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(data)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    train(*tiny_args(run, data, "train.tokens=256"))  # the corpus is already a prepared directory
    assert not (run / "data").exists()
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step"] == 2


def test_split_seed_holds_the_validation_split_while_train_seed_changes(tmp_path, corpus):
    # A second seed of an ablation validates on the first seed's held-out documents: data.split_seed
    # chooses them (a run's train.seed does when it is unset, as before), and a directory prepared
    # with another split seed is refused naming the setting.
    prep = tmp_path / "prep"
    train(*tiny_args(tmp_path / "s0", corpus, "train.tokens=256", f"data.prepared_dir={prep}"))
    split = json.loads((prep / "meta.json").read_text())
    assert split["seed"] == 0
    train(*tiny_args(tmp_path / "s1", corpus, "train.tokens=256", f"data.prepared_dir={prep}",
                     "train.seed=1", "data.split_seed=0"))
    assert json.loads((prep / "meta.json").read_text()) == split  # the same split, not prepared again
    assert losses(tmp_path / "s1") != losses(tmp_path / "s0")  # the seed still changes the run
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "s2", corpus, "train.tokens=256",
                                                     f"data.prepared_dir={prep}", "train.seed=1")])
    assert result.exit_code != 0
    assert "prepared with split seed 0, but the config asks for 1; set data.split_seed=0" in result.stderr


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.ctx_len=0", "train.ctx_len: must be >= 1"),
        ("model.n_embd=100", "model.n_embd: 100 is not divisible by model.head_size"),
        ("train.lrr=1", "did you mean 'lr'"),
        ("data.corpus=[/nonexistent/file.txt]", "data.corpus: /nonexistent/file.txt does not exist"),
        ("model.vocab_size=100", "model.vocab_size: 100 is smaller than the tokenizer's 257"),
    ],
)
def test_bad_config_is_one_line_exit_2(tmp_path, corpus, override, message):
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "r", corpus), override])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_tbptt_resume_is_exact_and_carries_state(tmp_path, corpus):
    full = tmp_path / "full"
    train(*tiny_args(full, corpus, "train.tbptt=true"))
    reference = losses(full)
    assert (full / "checkpoints" / "step_00000010" / "extra.safetensors").is_file()
    assert reference != losses_of_plain_run(tmp_path, corpus)  # the carried state changes the run

    rollback_to(full, 4)
    train(*tiny_args(full, corpus, "train.tbptt=true"), "--resume")
    assert losses(full) == reference


def losses_of_plain_run(tmp_path, corpus):
    plain = tmp_path / "plain"
    train(*tiny_args(plain, corpus))
    return losses(plain)


def test_hybrid_rwkvx_and_bpe_runs_learn(tmp_path, corpus):
    run = tmp_path / "hybrid"
    args = tiny_args(run, corpus, "model.n_attn=1", "model.moba_chunk=8", "model.moba_top_k=1", "train.tokens=2560")
    result = train(*args, "data.tokenizer=bpe", "data.bpe_vocab_size=300", "model.vocab_size=300")
    assert "(RRA)" in result.stdout or "RRA" in result.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if r["val_loss"] is not None]
    assert len(val) >= 3 and val[-1] < val[0]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_saves_a_checkpoint_and_exits_0(tmp_path, corpus, signame):
    import signal
    import subprocess
    import time

    run = tmp_path / "run"
    args = tiny_args(run, corpus, "train.tokens=1000000", "train.ckpt_interval=100000", "train.eval_interval=100000")
    proc = subprocess.Popen(
        cli_command("train", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO
    )
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(getattr(signal, signame))
    out, errs = proc.communicate(timeout=120)
    assert proc.returncode == 0, errs
    assert "checkpoint saved at step" in out
    steps = [int(p.name.split("_")[1]) for p in (run / "checkpoints").iterdir()]
    logged = [r["step"] for r in rows(run)]
    assert steps and max(steps) == len(logged) and logged == list(range(1, len(logged) + 1))


@pytest.fixture
def prepared(tmp_path, corpus):
    """A run whose data has been prepared by `rwkvx init`."""
    run = tmp_path / "run"
    result = runner.invoke(app, ["init", *tiny_args(run, corpus)])
    assert result.exit_code == 0, result.output
    assert "parameters" in result.stdout and (run / "checkpoints" / "step_00000000" / "meta.json").is_file()
    return run


@pytest.mark.parametrize(
    "damage,message",
    [
        ("magic", "magic"),
        ("truncate_bin", "val.bin"),
        ("dtype", "dtype"),
    ],
)
def test_damaged_data_is_refused_before_training(prepared, corpus, damage, message):
    data = prepared / "data"
    if damage == "magic":
        raw = bytearray((data / "train.idx").read_bytes())
        raw[:4] = b"XXXX"
        (data / "train.idx").write_bytes(bytes(raw))
    elif damage == "truncate_bin":
        raw = (data / "val.bin").read_bytes()
        (data / "val.bin").write_bytes(raw[: len(raw) // 2])
    else:
        raw = bytearray((data / "train.idx").read_bytes())
        raw[17] = 99  # the dtype code after magic (9 bytes) and version (8 bytes)
        (data / "train.idx").write_bytes(bytes(raw))
    result = runner.invoke(app, ["train", *tiny_args(prepared, corpus)])
    assert result.exit_code == 1, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert not (prepared / "metrics.jsonl").exists()
    assert [p.name for p in (prepared / "checkpoints").iterdir()] == ["step_00000000"]


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    from rwkvx_cli.data import write_binidx

    data = tmp_path / "data"
    data.mkdir()
    import numpy as np

    from rwkvx_cli.data import ByteTokenizer

    ByteTokenizer().save(data / "tokenizer.json")
    write_binidx(data / "train", [np.array([1, 2, 3, 400, 5] * 50, dtype=np.uint16)], np.uint16)
    write_binidx(data / "val", [np.array([1, 2, 3, 4, 5] * 50, dtype=np.uint16)], np.uint16)
    (data / "meta.json").write_text("{}")
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "run", data)])
    assert result.exit_code == 1, result.output
    assert "400" in result.stderr and "Traceback" not in result.output


def test_init_refuses_a_directory_with_checkpoints(prepared, corpus):
    before = sorted(p.name for p in (prepared / "checkpoints").iterdir())
    result = runner.invoke(app, ["init", *tiny_args(prepared, corpus)])
    assert result.exit_code == 2 and "already holds checkpoints" in result.stderr
    assert sorted(p.name for p in (prepared / "checkpoints").iterdir()) == before


def test_empty_corpus_is_refused_before_training(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "run", empty)])
    assert result.exit_code == 1, result.output
    assert "the corpus has no text" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_corpus_shorter_than_one_window_is_refused_before_training(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("\n".join(f"line {i}" for i in range(40)) + "\n")  # ~300 tokens
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "run", short, "train.ctx_len=512")])
    assert result.exit_code == 1, result.output
    assert "fewer than one window of train.ctx_len + 1 = 513" in result.stderr
    assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_architecture_mismatch_on_resume_names_what_differs(tmp_path, corpus):
    """A resume that changes the model is refused before any file is written (config.yaml stays)."""
    run = tmp_path / "run"
    train(*tiny_args(run, corpus, "train.tokens=256"))
    config = (run / "config.yaml").read_text()
    result = runner.invoke(app, ["train", *tiny_args(run, corpus, "model.n_layer=3"), "--resume"])
    assert result.exit_code == 2, result.output
    assert "model.n_layer is 2 in the run's checkpoints, 3 now; the model is fixed" in result.stderr
    result = runner.invoke(
        app, ["train", *tiny_args(run, corpus, "model.n_embd=32", "model.head_size=16"), "--resume"]
    )
    assert result.exit_code == 2 and "model.n_embd is 64 in the run's checkpoints, 32 now" in result.stderr
    assert "Traceback" not in result.output
    assert (run / "config.yaml").read_text() == config


def test_a_resume_may_change_the_init_gain_which_the_weights_no_longer_depend_on(tmp_path, corpus):
    """model.ffn_key_gain decides the init only: a run started before the setting existed (its checkpoints read as
    1.0) resumes under a config that sets 2.0, as `make demo --resume` does after the tiny config gained it."""
    from rwkvx_cli.checkpoints.manager import resume_changes
    from rwkvx_cli.config import load_config

    run = tmp_path / "run"
    train(*tiny_args(run, corpus, "train.tokens=256"))
    args = tiny_args(run, corpus, "model.ffn_key_gain=2.0", "train.tokens=512")
    result = runner.invoke(app, ["train", *args, "--resume"])
    assert result.exit_code == 0, result.output
    assert "resumed from step" in result.output
    saved, now = load_config(None, ["model.ffn_key_gain=1.0"]), load_config(None, ["model.ffn_key_gain=2.0"])
    assert resume_changes(saved, now) == {}


def test_graceful_stop_records_the_signal_and_restores_the_handlers():
    import signal

    from rwkvx_cli.train.signals import GracefulStop

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in before:
        with GracefulStop() as stop:
            assert not stop.requested
            signal.raise_signal(sig)
            assert stop.requested
        assert {s: signal.getsignal(s) for s in before} == before


def test_a_run_made_with_relative_paths_resumes_from_another_directory(tmp_path, corpus, monkeypatch):
    """The saved config names its files absolutely: `train -c RUN/config.yaml --resume` from elsewhere
    reads the same corpus, tokenizer file, prepared data and init_from weights, into the same run; and
    the same relative paths given again from the first directory are no change."""
    import yaml

    from rwkvx_cli.config import ModelConfig
    from rwkvx_cli.data import ByteTokenizer
    from rwkvx_cli.models import build_model

    first, other = tmp_path.resolve() / "first", tmp_path.resolve() / "other"
    first.mkdir(), other.mkdir()
    (first / "text.txt").write_text(corpus.read_text())
    ByteTokenizer().save(first / "tok.json")
    weights = build_model(ModelConfig(vocab_size=257, n_layer=1, n_embd=32, head_size=16), 0).state_dict()
    torch.save(weights, first / "w.pth")
    args = ["run_dir=run", "data.corpus=[text.txt]", "data.tokenizer=tok.json", "data.prepared_dir=prep"]
    args += ["train.ctx_len=16", "train.micro_batch=2", "train.tokens=64", "train.eval_tokens=64", "train.loggers=[]"]
    monkeypatch.setattr("rwkvx_cli.train.runner.SAMPLE_TOKENS", 4)  # the closing sample is not what is tested
    monkeypatch.chdir(first)
    result = runner.invoke(app, ["init", *args, "--from", "w.pth"])
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((first / "run" / "config.yaml").read_text())
    assert saved["run_dir"] == str(first / "run") and saved["data"]["corpus"] == [str(first / "text.txt")]
    assert saved["data"]["tokenizer"] == str(first / "tok.json")
    assert saved["data"]["prepared_dir"] == str(first / "prep")
    assert saved["train"]["init_from"] == str(first / "w.pth")

    monkeypatch.chdir(other)
    result = runner.invoke(app, ["train", "-c", "../first/run/config.yaml", "--resume"])
    assert result.exit_code == 0, result.output
    assert list(other.iterdir()) == [] and (first / "run" / "checkpoints" / "step_00000002").is_dir()

    monkeypatch.chdir(first)  # the same relative paths again: the same settings, nothing to do
    result = runner.invoke(app, ["train", *args, "train.init_from=w.pth", "--resume"])
    assert result.exit_code == 0, result.output
    assert "changed" not in result.output
