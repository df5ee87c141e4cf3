"""Issue 24's hostile tries, each a promise of the README's "What rwkvx will never do" held at its
mechanism: no write through a planted symbolic link, no output option over a checkpoint or an
existing file, no second writer after the lock file is deleted or the run directory replaced."""

import json
import os
import shutil
import subprocess
import time

import pytest
from typer.testing import CliRunner

from rwkvx_cli.checkpoints import find, full, store
from rwkvx_cli.cli import app
from tests.train.helpers import REPO, cli_command, env, one_line_error, run_cli, tiny_args

runner = CliRunner()
SHORT = ("train.tokens=512", "train.ckpt_interval=2", "train.eval_interval=2", "train.eval_tokens=64")  # 4 steps


def invoke(*args):
    return runner.invoke(app, [*map(str, args)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    run = tmp_path_factory.mktemp("trained") / "run"
    result = invoke("train", *tiny_args(run, corpus, *SHORT))
    assert result.exit_code == 0, result.output
    return run


# -- 1. no write through a symbolic link ----------------------------------------------------------
RUN_FILES = (".rwkvx-lock", "config.yaml", "tokenizer.json", "loss.png", ".rwkvx-run")


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_link_planted_in_a_run_directory_is_never_written_through(tmp_path, corpus, name):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".rwkvx-run").write_text("")  # a shared run directory rwkvx made
    if name == ".rwkvx-run":
        (run / name).unlink()
    (run / name).symlink_to(victim)
    result = invoke("train", *tiny_args(run, corpus, *SHORT))
    assert victim.read_text() == "precious\n"
    assert result.exit_code == 0, result.output
    if name != ".rwkvx-run":  # the marker is only ever created, never rewritten: a link there stays, unread
        assert not (run / name).is_symlink()  # the link itself was replaced by rwkvx's own file


def test_a_link_at_the_metrics_log_is_refused_in_one_line(tmp_path, corpus, trained):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    store.set_aside(store.list_checkpoints(run / "checkpoints")[-1])  # something left to train on resume
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(victim)
    result = invoke("train", "--config", run / "config.yaml", "--resume", f"run_dir={run}")
    # Resuming rewrites the log up to its checkpoint (atomically: the link is replaced, not followed).
    assert victim.read_text() == "precious\n"
    assert result.exit_code == 0, result.output


def test_a_link_at_a_temporary_name_is_never_followed(tmp_path):
    from rwkvx_cli.fsio import atomic_write_text, temp_path

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    target = tmp_path / "out.json"
    temp_path(target).symlink_to(victim)  # a name an attacker can predict
    atomic_write_text(target, "{}")
    assert victim.read_text() == "precious\n" and target.read_text() == "{}"


def test_appending_refuses_a_link(tmp_path):
    from rwkvx_cli.fsio import LinkRefused, open_append

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "log").symlink_to(victim)
    with pytest.raises(LinkRefused, match="is a symbolic link"):
        open_append(tmp_path / "log")
    assert victim.read_text() == "precious\n"


# -- 2. output options: one guarded writer ----------------------------------------------------------
def test_no_output_option_replaces_a_checkpoint_or_an_existing_file(trained, tmp_path):
    ckpt = store.list_checkpoints(trained / "checkpoints")[-1]
    weights = (ckpt / "model.safetensors").read_bytes()
    explain = ["explain", "--checkpoint", trained, "--text", "hi"]
    for flag in ("--json", "--html", "--png"):
        for forced in ((), ("--force",)):
            line = one_line_error(invoke(*explain, flag, ckpt / "model.safetensors", *forced), 2)
            assert "inside a checkpoint" in line
    assert (ckpt / "model.safetensors").read_bytes() == weights
    assert "run's own files" in one_line_error(invoke(*explain, "--json", trained / "config.yaml", "--force"), 2)
    mine = tmp_path / "mine.json"
    mine.write_text("the user's own file")
    for args in (
        [*explain, "--json", mine],
        ["gradcheck", "--op", "wkv4", "--backend", "reference", "--json", mine],
        ["bench", "--op", "wkv4", "--backend", "reference", "--shape", "1,4,1,4", "--json", mine],
    ):
        assert "already exists; pass --force" in one_line_error(invoke(*args), 2)
    assert mine.read_text() == "the user's own file"
    result = invoke(*explain, "--json", mine, "--force")
    assert result.exit_code == 0 and json.loads(mine.read_text())["text"] == "hi"


def test_explain_png_writes_the_path_it_names(trained, tmp_path):
    explain = ["explain", "--checkpoint", trained, "--text", "hi", "--png"]
    assert "is a directory" in one_line_error(invoke(*explain, tmp_path), 2)
    target = tmp_path / "picture"  # no suffix: written as named, and said so
    result = invoke(*explain, target)
    assert result.exit_code == 0, result.output
    said = " ".join(result.stdout.split())  # the console wraps a long path at 80 columns
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {target}" in said
    assert not (tmp_path / "picture.png").exists()


# -- 3. one writer, whatever happens to the lock file ------------------------------------------------
def _start_training(run, corpus, *extra):
    args = tiny_args(run, corpus, "train.tokens=200000", "train.ckpt_interval=1", "train.eval_interval=1000", *extra)
    proc = subprocess.Popen(
        cli_command("train", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO
    )
    start = time.time()
    while not store.list_checkpoints(run / "checkpoints") or len(store.list_checkpoints(run / "checkpoints")) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.time() - start < 120
        time.sleep(0.05)
    return proc


def test_deleting_the_lock_file_lets_no_second_writer_in(tmp_path, corpus):
    run = tmp_path / "run"
    first = _start_training(run, corpus)
    try:
        (run / ".rwkvx-lock").unlink()
        second = run_cli("train", *tiny_args(run, corpus, "train.tokens=200000"), "--resume")
        assert second.returncode == 1, second.stderr
        assert "is in use by" in second.stderr and "Traceback" not in second.stderr
    finally:
        first.terminate()
        first.communicate(timeout=120)
    assert not list((run / "checkpoints").glob("corrupt-*"))


def test_the_holder_sees_its_run_directory_moved_or_replaced(tmp_path):
    from rwkvx_cli.runs.lock import RunLockLost, hold_run

    run = tmp_path / "run"
    run.mkdir()
    with hold_run(run) as lock:
        lock.check()  # still its own
        os.rename(run, tmp_path / "moved")
        with pytest.raises(RunLockLost, match="was moved, deleted or replaced"):
            lock.check()
        run.mkdir()  # a new directory under the old name is not the one it holds
        with pytest.raises(RunLockLost):
            lock.check()


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_lost_run_directory_stops_the_checkpoint_before_it_writes(tmp_path, corpus, fmt):
    """The trainer's checkpoints call the lock's check first: nothing is written once it fails (in
    either checkpoint format)."""
    from rwkvx_cli.config import load_config
    from rwkvx_cli.models import build_model
    from rwkvx_cli.runs.data import ensure_data
    from rwkvx_cli.runs.lock import RunLockLost
    from rwkvx_cli.train.loop import Trainer

    def lost():
        raise RunLockLost("the run directory was replaced")

    cfg = load_config(None, tiny_args(tmp_path / "run", corpus, *SHORT, f"train.checkpoint_format={fmt}"))
    data = ensure_data(cfg, tmp_path / "run")
    model = build_model(cfg.model, 0)
    trainer = Trainer(cfg, tmp_path / "run", model, data.train.tokens, data.val.tokens, data.tokenizer, guard=lost)
    with pytest.raises(RunLockLost):
        trainer.run()
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- 7. a resume that changes the computation ------------------------------------------------------
@pytest.mark.parametrize(
    "setting, old, new",
    [
        ("train.micro_batch", 4, 2),
        ("train.ctx_len", 32, 16),
        ("train.precision", "auto", "bf16-mixed"),
        ("train.sampler", "epoch", "random"),
        ("train.seed", 0, 1),
    ],
)
def test_a_resume_that_breaks_exactness_is_refused_naming_both_values(trained, tmp_path, setting, old, new):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = {p: (run / p).read_bytes() for p in ("config.yaml", "metrics.jsonl")}
    result = invoke("train", "--config", run / "config.yaml", "--resume", f"run_dir={run}", f"{setting}={new}")
    line = one_line_error(result, 2)
    assert f"{setting} is {old!r} in the run's checkpoints, {new!r} now" in line and "--allow-change" in line
    assert {p: (run / p).read_bytes() for p in before} == before


def test_an_allowed_change_keeps_the_schedule_monotone_in_tokens(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    ckpts = store.list_checkpoints(run / "checkpoints")
    shutil.rmtree(ckpts[-1])  # as if it had stopped at step 2 of 4 (512 tokens, 128 a step)
    args = ["--config", run / "config.yaml", "--resume", f"run_dir={run}", "train.micro_batch=2"]
    result = invoke("train", *args, "--allow-change", "train.micro_batch")
    assert result.exit_code == 0, result.output
    assert "continuing with changed settings" in result.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    tokens = [r["tokens"] for r in steps]
    assert tokens == sorted(tokens) and tokens[-1] == 512  # 256 trained, then 4 steps of 64: no more, no less
    note = [r for r in rows if r.get("event") == "resume"]
    assert note == [{"event": "resume", "step": 2, "changed": {"train.micro_batch": [4, 2]}}]
    assert "--allow-change train.tokenz: not a config setting" in one_line_error(
        invoke("train", *args, "--allow-change", "train.tokenz"), 2
    )


# -- 6. never train on data other than the config describes ---------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        (("data.tokenizer=world", "model.vocab_size=65536"), "tokenizer byte, but the config asks for world"),
        (("data.val_fraction=0.1",), "val_fraction 0.05, but the config asks for 0.1"),
        (("train.seed=3",), "seed 0, but the config asks for 3"),
        (("data.corpus=[{other}]",), "corpus text.txt"),
    ],
)
def test_a_stale_prepared_dir_is_refused(tmp_path, corpus, change, message):
    shared = tmp_path / "prepared"
    first = invoke("init", *tiny_args(tmp_path / "a", corpus, f"data.prepared_dir={shared}"))
    assert first.exit_code == 0, first.output
    before = (shared / "meta.json").read_bytes()
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text()[: len(corpus.read_text()) // 2])
    extra = [c.format(other=other) for c in change]
    line = one_line_error(invoke("train", *tiny_args(tmp_path / "b", corpus, f"data.prepared_dir={shared}", *extra)), 1)
    assert message in line and "data.prepared_dir elsewhere" in line
    assert (shared / "meta.json").read_bytes() == before and not (tmp_path / "b" / "config.yaml").exists()


def test_a_corpus_file_that_changed_since_it_was_prepared_is_refused(tmp_path, corpus):
    text = tmp_path / "text.txt"
    text.write_text(corpus.read_text())
    shared = tmp_path / "prepared"
    assert invoke("init", *tiny_args(tmp_path / "a", text, f"data.prepared_dir={shared}")).exit_code == 0
    text.write_text(corpus.read_text() + "one more line\n")
    line = one_line_error(invoke("train", *tiny_args(tmp_path / "b", text, f"data.prepared_dir={shared}")), 1)
    assert "but the config asks for text.txt" in line


# -- 8. export never writes a broken model silently --------------------------------------------------
def test_export_refuses_non_finite_weights_and_fp16_overflow(tmp_path):
    from rwkvx_cli.config import Config, ModelConfig, config_to_dict
    from rwkvx_cli.models import build_model

    cfg = Config(model=ModelConfig(n_layer=1, n_embd=64, head_size=64))
    weights = build_model(cfg.model, 0).state_dict()
    weights["emb.weight"][0, :3] = float("nan")
    weights["head.weight"][0, 0] = 1e6  # finite in fp32, inf in fp16
    full.save_checkpoint(tmp_path / "run" / "checkpoints", 1, weights, None, {"config": config_to_dict(cfg)}, 3)
    args = ["export", "--checkpoint", tmp_path / "run", "--format", "safetensors", "--out", tmp_path / "m.safetensors"]
    line = one_line_error(invoke(*args), 1)
    assert "3 non-finite values (in emb.weight)" in line and "--force" in line
    line = one_line_error(invoke(*args, "--dtype", "fp16"), 1)
    assert "1 values too large for float16 (in head.weight)" in line
    assert not (tmp_path / "m.safetensors").exists()
    result = invoke(*args, "--force")
    assert result.exit_code == 0 and "exported anyway (--force): 3 non-finite values" in result.stderr


# -- 9. a model vocabulary larger than the tokenizer's --------------------------------------------
def test_a_model_vocabulary_above_the_tokenizers_samples_only_its_ids(tmp_path, corpus):
    """docs/config.md allows model.vocab_size above the tokenizer's (padding to a round number): the rows
    beyond it are never sampled, so the closing sample and `eval --generate` decode."""
    run = tmp_path / "run"
    result = invoke("train", *tiny_args(run, corpus, *SHORT, "model.vocab_size=4096"))
    assert result.exit_code == 0, result.output
    result = invoke("eval", "--checkpoint", run, "--generate", "ab", "--tokens", "50", "--temperature", "5")
    assert result.exit_code == 0, result.output


def test_sampling_never_picks_an_id_beyond_the_limit():
    import torch

    from rwkvx_cli.config import ModelConfig
    from rwkvx_cli.models import build_model
    from rwkvx_cli.models.generate import generate

    model = build_model(ModelConfig(vocab_size=512, n_layer=1, n_embd=64, head_size=64), 0)
    with torch.no_grad():
        model.head.weight[300:] += 50.0  # the extra rows would win every draw
    assert max(generate(model, [1, 2], 40, temperature=1.0, top_p=1.0, vocab_size=257)) < 257
    assert max(generate(model, [1, 2], 40, temperature=1.0, top_p=1.0)) >= 300  # the test can fail


# -- 10-12. no traceback, the right exit code, nothing written by a refusal ------------------------
def test_no_traceback_for_odd_input(trained, tmp_path, corpus, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    line = one_line_error(invoke("train", *tiny_args(tmp_path / "w", corpus, "train.loggers=[wandb]")), 2)
    assert "wandb has no API key" in line and "WANDB_MODE=offline" in line
    assert not (tmp_path / "w").exists()  # refused before the run directory was touched
    huge = tiny_args(tmp_path / "x", corpus, "model.layers=rwkv7*99999999999999999999")
    line = one_line_error(invoke("init", *huge), 2)
    assert "the repeat count must be an integer from 1 to 10,000" in line
    line = one_line_error(invoke("explain", "--checkpoint", trained, "--text", "a\udcffb"), 2)
    assert "--text is not valid UTF-8" in line


def test_a_forged_vocabulary_in_meta_json_is_refused_before_allocating(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    ckpt = store.list_checkpoints(run / "checkpoints")[-1]
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["model"]["vocab_size"] = 10**12
    meta.pop("meta_sha256")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    for command in (["eval"], ["explain", "--text", "hi"]):
        line = one_line_error(invoke(*command, "--checkpoint", ckpt), 1)
        assert "meta.json: its config is not valid: model.vocab_size: must be from 2 to" in line, line
    meta["config"]["model"]["vocab_size"] = 2**31 - 1  # in range, but no machine holds its embedding
    (ckpt / "meta.json").write_text(json.dumps(meta))
    for command in (["eval"], ["explain", "--text", "hi"]):
        line = one_line_error(invoke(*command, "--checkpoint", ckpt), 1)
        assert "needs at least" in line and "GiB" in line, line


def test_a_dangling_link_as_run_dir_and_a_home_relative_path(tmp_path, corpus, monkeypatch):
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    line = one_line_error(invoke("init", *tiny_args(tmp_path / "gone", corpus)), 2)
    assert "is a symbolic link to" in line and "which does not exist" in line
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert invoke("init", *tiny_args("~/runs/x", corpus)).exit_code == 0
    assert (tmp_path / "runs" / "x" / "config.yaml").is_file() and not (tmp_path / "~").exists()


def test_a_mixture_on_the_command_line_replaces_the_files_corpus(tmp_path, trained):
    from rwkvx_cli.config import load_config

    config = tmp_path / "c.yaml"
    config.write_text("data:\n  corpus: [some/text.txt]\n")
    cfg = load_config(config, [f"data.mix=[{{path: {trained / 'data'}, weight: 1}}]"])
    assert cfg.data.mix[0].path == str(trained / "data") and cfg.data.corpus == ["data/tinyshakespeare.txt"]


def test_init_refuses_what_train_would(tmp_path, corpus):
    line = one_line_error(invoke("init", *tiny_args(tmp_path / "big", corpus, "train.micro_batch=1e8")), 1)
    assert "needs at least" in line and not (tmp_path / "big").exists()


def test_an_os_error_is_one_plain_line(trained, tmp_path, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "m.pth"))

    monkeypatch.setattr("rwkvx_cli.runs.export.export_checkpoint", full)
    line = one_line_error(invoke("export", "--checkpoint", trained, "--out", tmp_path / "m.pth"), 1)
    assert line == f"error: {tmp_path / 'm.pth'}: No space left on device"  # no markup shown literally


# -- 13. checkpoint writes: no planted link followed, nothing written into a replaced run (issue 44) ----
VARIANTS = {
    "full": ("train.checkpoint_format=full", "train.async_checkpoint=false"),
    "full-async": ("train.checkpoint_format=full", "train.async_checkpoint=true"),
    "sharded": ("train.checkpoint_format=sharded", "train.async_checkpoint=false"),
    "sharded-async": ("train.checkpoint_format=sharded", "train.async_checkpoint=true"),
}
# Every file either format writes into .tmp-step_N (extra.safetensors: the TBPTT carry).
CHECKPOINT_FILES = (
    "model.safetensors", "optimizer.safetensors", "extra.safetensors", "meta.json", "index.json",
    "shard-00000-of-00001.safetensors",
)


def _when_temp_dir_made(monkeypatch, step, action):
    """Run `action()` right after the save of `step` made its `.tmp-step_N` (by path or relative to a
    directory descriptor), before any file is written into it."""
    original = os.mkdir

    def mkdir(path, *args, **kwargs):
        original(path, *args, **kwargs)
        if os.path.basename(os.fsdecode(path)) == f".tmp-step_{step:08d}":
            action()

    monkeypatch.setattr(os, "mkdir", mkdir)


def _error_line(result) -> str:
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and result.output.rstrip().endswith(errors[0]), result.output
    return errors[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_links_planted_in_a_checkpoint_temp_dir_are_never_written_through(tmp_path, corpus, monkeypatch, variant):
    run = tmp_path / "run"

    def plant():
        for name in CHECKPOINT_FILES:
            victim = tmp_path / f"victim-{name}"
            victim.write_text("precious\n")
            (run / "checkpoints" / ".tmp-step_00000004" / name).symlink_to(victim)

    _when_temp_dir_made(monkeypatch, 4, plant)
    result = invoke("train", *tiny_args(run, corpus, *SHORT, "train.tbptt=true", *VARIANTS[variant]))
    victims = sorted(tmp_path.glob("victim-*"))
    assert len(victims) == len(CHECKPOINT_FILES)
    assert all(v.read_text() == "precious\n" for v in victims)
    assert result.exit_code == 0, result.output
    ckpt = run / "checkpoints" / "step_00000004"
    written = [*find.verify(ckpt)["files"], "meta.json"]  # a planted name the format does not write stays, unread
    assert len(written) >= 4 and not any((ckpt / name).is_symlink() for name in written)


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_link_planted_at_a_checkpoint_temp_dir_is_removed_never_followed(trained, tmp_path, fmt):
    from tests.train.helpers import rollback_to

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    rollback_to(run, 2)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious\n")
    planted = run / "checkpoints" / ".tmp-step_00000004"
    planted.symlink_to(victim, target_is_directory=True)
    result = invoke("train", "--config", run / "config.yaml", "--resume", f"run_dir={run}",
                    f"train.checkpoint_format={fmt}")
    assert result.exit_code == 0, result.output
    assert os.listdir(victim) == ["keep.txt"] and (victim / "keep.txt").read_text() == "precious\n"
    assert not os.path.lexists(planted)
    assert find.verify(run / "checkpoints" / "step_00000004")["step"] == 4


def _replace_run(run, moved):
    os.rename(run, moved)
    run.mkdir()
    (run / "notes.txt").write_text("the user's own file\n")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("moment", ["after the guard", "mid-save"])
def test_a_run_directory_replaced_during_a_checkpoint_receives_nothing(tmp_path, corpus, monkeypatch, variant, moment):
    """The run directory is moved away and a user's new one put at its path, deterministically: right
    after the guard passed (before the save made anything), or once the save made its `.tmp-step_N`.
    The save stops in one line; the new directory holds only the user's file; the moved one its earlier
    checkpoint and no partial `.tmp-step_N`."""
    from rwkvx_cli.checkpoints.manager import CheckpointManager

    run, moved = tmp_path / "run", tmp_path / "moved"
    if moment == "after the guard":
        original = CheckpointManager._check_guard

        def check_then_replace(self, step):
            original(self, step)
            if step == 4:
                _replace_run(run, moved)

        monkeypatch.setattr(CheckpointManager, "_check_guard", check_then_replace)
    else:
        _when_temp_dir_made(monkeypatch, 4, lambda: _replace_run(run, moved))
    result = invoke("train", *tiny_args(run, corpus, *SHORT, "train.tbptt=true", *VARIANTS[variant]))
    line = _error_line(result)
    assert "cannot write the checkpoint of step 4" in line and "moved, deleted or replaced" in line, line
    assert os.listdir(run) == ["notes.txt"]
    assert sorted(os.listdir(moved / "checkpoints")) == ["step_00000002"]
    assert find.verify(moved / "checkpoints" / "step_00000002")["step"] == 2


def test_a_symlinked_checkpoints_folder_is_refused_in_one_line(trained, tmp_path, corpus):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("the user's own file\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".rwkvx-run").write_text("")
    (run / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    line = _error_line(invoke("train", *tiny_args(run, corpus, *SHORT)))
    assert f"{run / 'checkpoints'} is a symbolic link" in line, line
    assert os.listdir(elsewhere) == ["mine.txt"]
    resumed = tmp_path / "resumed"  # a run whose checkpoints were moved elsewhere and linked
    shutil.copytree(trained, resumed)
    shutil.move(resumed / "checkpoints", tmp_path / "kept")
    (resumed / "checkpoints").symlink_to(tmp_path / "kept", target_is_directory=True)
    before = sorted(os.listdir(tmp_path / "kept"))
    result = invoke("train", "--config", resumed / "config.yaml", "--resume", f"run_dir={resumed}",
                    "train.tokens=768")
    assert f"{resumed / 'checkpoints'} is a symbolic link" in _error_line(result)
    assert sorted(os.listdir(tmp_path / "kept")) == before
