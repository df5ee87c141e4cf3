"""What rwkvx never does (issue 11): overwrite a file it did not write, let two processes write one
run, resume past a damaged history silently, unpickle; and no traceback for bad input."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.checkpoints import find
from rwkvx_cli.checkpoints import store as ck
from rwkvx_cli.cli import app
from rwkvx_cli.config import ConfigError, load_config
from rwkvx_cli.data.errors import DataError
from rwkvx_cli.data.prepare import read_prepared_meta
from rwkvx_cli.errors import CheckpointError, RwkvxError
from rwkvx_cli.fsio import RUN_MARKER, NotOurDirectory, check_writable_dir
from rwkvx_cli.models.generate import sample_next
from rwkvx_cli.runs.weights import load_weights_file
from tests.train.helpers import REPO, cli_command, env, one_line_error, run_cli, tiny_args

runner = CliRunner()
SHORT = ("train.tokens=512", "train.ckpt_interval=2", "train.eval_interval=2", "train.eval_tokens=64")  # 4 steps


def invoke(*args):
    return runner.invoke(app, [*map(str, args)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("trained") / "run"
    result = invoke("train", *tiny_args(run, corpus, *SHORT))
    assert result.exit_code == 0, result.output
    return run


def resume(run, *extra):
    return invoke("train", "--config", run / "config.yaml", "--resume", f"run_dir={run}", *extra)


@pytest.fixture
def run_copy(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / ".rwkvx-lock").unlink(missing_ok=True)
    return run


# -- 1. export never overwrites what it did not mean to ----------------------------------------------
def test_export_refuses_an_existing_target_a_checkpoint_dir_and_a_directory(trained, tmp_path):
    out = tmp_path / "model.safetensors"
    out.write_text("the user's own file")
    args = ["export", "--checkpoint", trained, "--format", "safetensors", "--out"]
    assert "already exists" in one_line_error(invoke(*args, out), 2)
    assert out.read_text() == "the user's own file"
    assert invoke(*args, out, "--force").exit_code == 0 and out.stat().st_size > 1000
    ckpt = ck.list_checkpoints(trained / "checkpoints")[-1]
    weights = (ckpt / "model.safetensors").read_bytes()
    for target in (ckpt / "model.safetensors", ckpt / "other.safetensors", trained / "checkpoints" / "x.pth"):
        assert "inside a checkpoint" in one_line_error(invoke(*args, target, "--force"), 2)
    assert (ckpt / "model.safetensors").read_bytes() == weights
    for target in (tmp_path, "/"):
        assert "is a directory" in one_line_error(invoke(*args, target), 2)
    assert not list(tmp_path.glob(".*tmp*"))


# -- 2. one writer per run directory ---------------------------------------------------------------
def test_a_second_process_on_a_held_run_dir_is_refused_and_a_dead_holder_is_taken_over(tmp_path, corpus):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom rwkvx_cli.runs.lock import hold_run\n"
            f"with hold_run({str(run)!r}):\n    print('held', flush=True)\n    time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env(),
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        second = run_cli("train", *tiny_args(run, corpus, *SHORT))
        assert second.returncode == 1, second.stderr
        assert f"is in use by pid {holder.pid}" in second.stderr and "Traceback" not in second.stderr
        assert not (run / "config.yaml").exists()  # it wrote nothing
    finally:
        holder.kill()  # a holder killed -9 leaves its lock file: the kernel released the lock itself
        holder.wait()
    assert (run / ".rwkvx-lock").exists()
    third = run_cli("init", *tiny_args(run, corpus, *SHORT))
    assert third.returncode == 0, third.stderr


# -- 3. write only into a new or empty directory, or one rwkvx made --------------------------------
def test_run_and_data_dirs_that_rwkvx_did_not_make_are_refused(tmp_path, corpus):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "config.yaml").write_text("my own\n")
    (user / "metrics.jsonl").write_text("my own\n")
    assert "did not write" in one_line_error(invoke("train", *tiny_args(user, corpus, *SHORT)), 2)
    assert "did not write" in one_line_error(invoke("init", *tiny_args(user, corpus, *SHORT)), 2)
    assert "did not write" in one_line_error(invoke("data", "prepare", corpus, "--out", user), 2)
    assert (user / "config.yaml").read_text() == (user / "metrics.jsonl").read_text() == "my own\n"
    assert sorted(p.name for p in user.iterdir()) == ["config.yaml", "metrics.jsonl"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "is a file" in one_line_error(invoke("init", *tiny_args(a_file, corpus, *SHORT)), 2)
    assert "under a file" in one_line_error(invoke("init", *tiny_args(a_file / "run", corpus, *SHORT)), 2)
    assert "is empty" in one_line_error(invoke("init", *tiny_args("", corpus, *SHORT)), 2)
    assert "under a file" in one_line_error(invoke("data", "prepare", corpus, "--out", a_file / "d"), 2)
    with pytest.raises(NotOurDirectory, match="root"):
        check_writable_dir("/", RUN_MARKER)
    (user / RUN_MARKER).write_text("")  # marked: ours
    check_writable_dir(user, RUN_MARKER)


def test_a_run_dir_made_by_an_older_rwkvx_still_resumes(run_copy):
    (run_copy / RUN_MARKER).unlink()
    result = resume(run_copy, "train.tokens=768")
    assert result.exit_code == 0, result.output
    assert ck.step_of(ck.list_checkpoints(run_copy / "checkpoints")[-1]) == 6


def test_a_resume_that_gives_other_init_settings_keeps_the_runs_record_true(run_copy, tmp_path):
    """model.ffn_key_gain and train.init_from decide only how a run starts: a resume may give other values
    (nothing it computes changes), but the run's config.yaml and every later checkpoint keep the ones it
    started with, and the resume says so, on the console and in metrics.jsonl."""
    weights = tmp_path / "other.pth"
    result = resume(run_copy, "train.tokens=768", "model.ffn_key_gain=2.0", f"train.init_from={weights}")
    assert result.exit_code == 0, result.output
    warning = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "model.ffn_key_gain 2.0 (kept: 1.0)" in warning[0], result.stderr
    assert f"train.init_from '{weights}' (kept: '')" in warning[0]
    assert "config.yaml and the checkpoints keep what the run was initialised with" in warning[0]
    saved = load_config(run_copy / "config.yaml")
    assert (saved.model.ffn_key_gain, saved.train.init_from, saved.train.tokens) == (1.0, "", 768)
    newest = ck.list_checkpoints(run_copy / "checkpoints")[-1]
    assert ck.step_of(newest) == 6
    meta = ck.read_meta(newest)["config"]
    assert (meta["model"]["ffn_key_gain"], meta["train"]["init_from"]) == (1.0, "")
    rows = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in rows if "event" in r]
    kept = {"model.ffn_key_gain": [1.0, 2.0], "train.init_from": ["", str(weights)]}
    assert events == [{"event": "resume", "step": 4, "init_only": kept}]
    again = resume(run_copy, "train.tokens=768")  # the run's own values: nothing to say
    assert again.exit_code == 0 and "warning" not in again.stderr, again.output


# -- 4, 5. never resume past a damaged history silently, never delete it ----------------------------
def test_resume_refuses_when_every_checkpoint_is_damaged(run_copy):
    for ckpt in ck.list_checkpoints(run_copy / "checkpoints"):
        with open(ckpt / "model.safetensors", "r+b") as f:
            f.seek(200)
            f.write(b"\xff" * 16)
    metrics = (run_copy / "metrics.jsonl").read_text()
    result = resume(run_copy)
    assert result.exit_code == 1, result.output
    assert "every checkpoint" in result.output and "nothing to resume from" in result.output
    assert (run_copy / "metrics.jsonl").read_text() == metrics
    names = sorted(p.name for p in (run_copy / "checkpoints").iterdir())
    assert names == ["corrupt-step_00000002", "corrupt-step_00000004"]  # set aside, not deleted
    assert resume(run_copy).exit_code == 1  # and again: the damaged history still stands
    assert (run_copy / "metrics.jsonl").read_text() == metrics


def test_a_step_dir_without_meta_json_is_reported_and_kept_aside(run_copy):
    newest = ck.list_checkpoints(run_copy / "checkpoints")[-1]
    (newest / "meta.json").unlink()
    weights = (newest / "model.safetensors").read_bytes()
    result = resume(run_copy)
    assert result.exit_code == 0, result.output
    assert "skipping damaged checkpoint step_00000004" in result.output and "meta.json is missing" in result.output
    kept = run_copy / "checkpoints" / "corrupt-step_00000004"
    assert (kept / "model.safetensors").read_bytes() == weights
    assert (run_copy / "checkpoints" / "step_00000004" / "meta.json").is_file()  # retrained


def test_a_metrics_log_without_checkpoints_is_kept_aside(tmp_path, corpus):
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_MARKER).write_text("")
    old = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 4))
    (run / "metrics.jsonl").write_text(old)
    with pytest.warns(UserWarning, match="kept as metrics.jsonl.old-1"):
        result = invoke("train", *tiny_args(run, corpus, *SHORT))
    assert result.exit_code == 0, result.output
    assert (run / "metrics.jsonl.old-1").read_text() == old


def test_a_checkpoint_write_that_hits_the_file_size_limit_is_one_line_and_keeps_the_last(run_copy):
    """`ulimit -f`: the optimizer file of the next checkpoint is larger than the limit."""
    before = ck.list_checkpoints(run_copy / "checkpoints")

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    proc = subprocess.run(
        cli_command(
            "train", "--config", str(run_copy / "config.yaml"), "--resume", f"run_dir={run_copy}", "train.tokens=768"
        ),
        capture_output=True,
        text=True,
        env=env(),
        cwd=REPO,
        timeout=300,
        preexec_fn=limit,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "cannot write the checkpoint of step 6" in proc.stderr and "File too large" in proc.stderr
    assert ck.list_checkpoints(run_copy / "checkpoints") == before
    find.verify(before[-1])
    assert not list((run_copy / "checkpoints").glob(".tmp-*"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_run_dir_is_one_line(run_copy):
    os.chmod(run_copy / "checkpoints", 0o555)
    try:
        result = resume(run_copy, "train.tokens=768")
    finally:
        os.chmod(run_copy / "checkpoints", 0o755)
    assert result.exit_code == 1 and "Traceback" not in result.output


def test_a_write_refused_at_its_destination_names_the_destination_not_its_temporary_file(tmp_path):
    """An atomic write that cannot rename its temporary file into place (a directory there) says where it
    was writing, and leaves no temporary file behind."""
    from rwkvx_cli.fsio import atomic_write_bytes

    target = tmp_path / "by-position.png"
    target.mkdir()
    with pytest.raises(IsADirectoryError) as e:
        atomic_write_bytes(target, b"png")
    assert e.value.filename == str(target) and e.value.filename2 is None
    assert list(tmp_path.iterdir()) == [target] and not any(target.iterdir())


# -- silent wrong answers -----------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["random", "list", "truncated", "vocab", "dtype", "tokens"])
def test_a_damaged_or_edited_prepared_meta_json_is_refused(trained, tmp_path, damage):
    data = tmp_path / "data"
    shutil.copytree(trained / "data", data)
    meta_path = data / "meta.json"
    meta = json.loads(meta_path.read_text())
    text = {
        "random": os.urandom(64).hex()[:50] + "\x00",
        "list": "[1, 2]",
        "truncated": meta_path.read_text()[:40],
        "vocab": json.dumps({**meta, "vocab_size": 300}),
        "dtype": json.dumps({**meta, "dtype": "int32"}),
        "tokens": json.dumps({**meta, "train": {**meta["train"], "tokens": 5}}),
    }[damage]
    meta_path.write_text(text)
    with pytest.raises(DataError):
        read_prepared_meta(data, 257)


def test_train_refuses_an_edited_meta_json(run_copy):
    meta_path = run_copy / "data" / "meta.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "vocab_size": 300}))
    result = resume(run_copy, "train.tokens=768")
    assert "vocab_size 300" in one_line_error(result, 1)


def test_eval_refuses_data_tokenized_otherwise_than_the_run(run_copy):
    tok = run_copy / "data" / "tokenizer.json"
    spec = json.loads(tok.read_text())
    tok.write_text(json.dumps(spec, indent=4))  # any other bytes: a different tokenizer for all we know
    assert "differs from the one the run was trained with" in one_line_error(
        invoke("eval", "--checkpoint", run_copy), 1
    )


def test_the_pickle_refusal_never_suggests_weights_only_false(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"w": torch.zeros(2), "f": print}, path)
    with pytest.raises(CheckpointError) as e:
        load_weights_file(path)
    assert "weights_only" not in str(e.value) and "never unpickles" in str(e.value)


def test_config_refuses_duplicate_keys_a_final_lr_above_lr_and_a_huge_seed(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="train.lr_final"):
        load_config(None, ["train.lr_final=10", "train.lr=1.5e-3"])
    with pytest.raises(ConfigError, match="train.seed"):
        load_config(None, ["train.seed=99999999999999999999999"])


# -- tracebacks for bad input become one line ---------------------------------------------------------
def test_bad_numbers_and_text_are_usage_errors_not_tracebacks(trained):
    huge = "99999999999999999999999"
    for args in (
        ["gradcheck", "--op", "wkv7", "--seed", huge],
        ["eval", "--checkpoint", trained, "--seed", huge],
        ["bench", "--op", "wkv7", "--baseline", "nosuch"],
    ):
        result = invoke(*args)
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "not valid UTF-8" in one_line_error(invoke("eval", "--checkpoint", trained, "--generate", "\udcff\udcfe"), 2)


def test_top_p_zero_samples_the_top_token():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample_next(logits, 1.0, 0.0, torch.Generator().manual_seed(0)) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_logits_that_are_not_finite_are_one_line_not_a_sample(bad, temperature):
    """Damaged weights (found by tests/runs/test_fuzz_files.py): multinomial stopped with a traceback."""
    logits = torch.tensor([0.1, bad, -1.0])
    with pytest.raises(RwkvxError, match="NaN or infinity"):
        sample_next(logits, temperature, 0.9, torch.Generator().manual_seed(0))


def test_eval_with_top_p_zero_generates(trained):
    result = invoke("eval", "--checkpoint", trained, "--generate", "the", "--tokens", "5", "--top-p", "0")
    assert result.exit_code == 0, result.output


# -- 7. sizes that cannot fit are refused before allocating -----------------------------------------
def test_sizes_that_cannot_fit_are_refused_with_the_estimate(tmp_path, corpus, monkeypatch):
    monkeypatch.delenv("RWKVX_NO_MEMORY_CHECK", raising=False)
    cases = [
        ["init", *tiny_args(tmp_path / "a", corpus, "model.n_embd=1048576", "model.head_size=64")],
        ["init", *tiny_args(tmp_path / "b", corpus, "model.n_layer=10000", "model.n_embd=4096")],
        ["train", *tiny_args(tmp_path / "c", corpus, "train.micro_batch=100000000")],
        ["bench", "--op", "wkv7", "--backend", "chunked", "--shape", "100000,8192,32,64"],
        ["gradcheck", "--op", "wkv7", "--backend", "reference", "--size", "1000000000"],
    ]
    for args in cases:
        line = one_line_error(invoke(*args), 1)
        assert "needs at least" in line and "GiB" in line and "RWKVX_NO_MEMORY_CHECK" in line, line
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()  # refused before writing


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_usage_error():
    assert "no CUDA device" in one_line_error(invoke("bench", "--op", "wkv7", "--device", "cuda"), 2)


# -- signals ----------------------------------------------------------------------------------------------
def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_sigterm_during_start_up_says_terminated(tmp_path, corpus):
    proc = subprocess.Popen(
        cli_command("train", *tiny_args(tmp_path / "run", corpus, *SHORT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        cwd=REPO,
    )
    start = time.time()
    while not _catches_sigterm(proc.pid) and time.time() - start < 60:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode in (0, 143), stderr  # 0: it was already training, and stopped gracefully
    assert "Traceback" not in stderr
    if proc.returncode == 143:
        assert "terminated" in stderr


def test_a_second_sigterm_while_stopping_does_not_kill_the_save(tmp_path, corpus):
    run = tmp_path / "run"
    args = tiny_args(run, corpus, "train.tokens=2048", "train.ckpt_interval=100")
    proc = subprocess.Popen(
        cli_command("train", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO
    )
    start = time.time()
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() - start < 120
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode in (0, 143), stderr  # 143: after the save, and it says so
    assert "Traceback" not in stderr
    find.verify(ck.list_checkpoints(run / "checkpoints")[-1])


# -- 8. train.compile=true with a warm inductor cache ------------------------------------------------
@pytest.mark.slow  # compiles the model twice: minutes on CPU; run by `make test-slow` (CI)
def test_compile_twice_with_a_warm_cache(tmp_path, corpus):
    """The second compile reads the first's cache: it crashed with "shape '[94238218782269, ...]' is
    invalid" from the AOTAutograd cache until runner.py turned that cache off under train.compile."""
    for name in ("cold", "warm"):
        proc = subprocess.run(
            cli_command(
                "train",
                *tiny_args(tmp_path / name, corpus, "train.tokens=384", "train.compile=true", "train.device=cpu"),
            ),
            capture_output=True,
            text=True,
            env={**env(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
            cwd=REPO,
            timeout=1800,
        )
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
