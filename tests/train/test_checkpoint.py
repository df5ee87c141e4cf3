"""The checkpoint reader: random, mutated and truncated checkpoints either load or raise
CheckpointError (fuzzed); weights from elsewhere are never unpickled as code; a mismatch
names what differs."""

import copy
import functools
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from typer.testing import CliRunner

from rwkvx_cli.checkpoints import full
from rwkvx_cli.checkpoints.fit import mismatch
from rwkvx_cli.cli import app
from rwkvx_cli.config import Config, ModelConfig, TrainConfig
from rwkvx_cli.data import ByteTokenizer
from rwkvx_cli.errors import CheckpointError, RwkvxError
from rwkvx_cli.models import build_model
from rwkvx_cli.runs.weights import load_weights_file
from rwkvx_cli.train.loop import Trainer
from tests.train.helpers import tiny_args

runner = CliRunner()
CFG = Config(
    model=ModelConfig(vocab_size=33, n_layer=2, n_embd=32, head_size=16),
    train=TrainConfig(ctx_len=8, micro_batch=2, grad_accum=2, tokens=320, tbptt=True),
)
TOKENS = (np.arange(400) % 33).astype(np.uint16)


@functools.cache
def _initial_model():
    return build_model(CFG.model, 0)  # once: the orthogonal init is the slow part of a Trainer


def make_trainer(run_dir) -> Trainer:
    return Trainer(CFG, run_dir, copy.deepcopy(_initial_model()), TOKENS, TOKENS, ByteTokenizer())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The files of a real checkpoint after one step: weights, optimizer state, TBPTT carry, meta."""
    run = tmp_path_factory.mktemp("ckpt")
    trainer = make_trainer(run)
    trainer.train_step()
    path = trainer.save()
    assert sorted(p.name for p in path.iterdir()) == [
        "extra.safetensors",
        "meta.json",
        "model.safetensors",
        "optimizer.safetensors",
    ]
    return {p.name: p.read_bytes() for p in path.iterdir()}, trainer.model.state_dict()


def test_meta_lists_every_file_with_its_checksum(saved):
    files, _ = saved
    meta = json.loads(files["meta.json"])
    assert meta["step"] == 1 and meta["format"] == 2
    assert sorted(meta["files"]) == ["extra.safetensors", "model.safetensors", "optimizer.safetensors"]
    for name, entry in meta["files"].items():
        assert entry["bytes"] == len(files[name]) and len(entry["sha256"]) == 64
    assert len(meta["meta_sha256"]) == 64


def write(root: Path, files: dict[str, bytes]) -> None:
    ckpt = root / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    for name, raw in files.items():
        (ckpt / name).write_bytes(raw)


def test_resume_round_trip(tmp_path, saved):
    files, weights = saved
    write(tmp_path, files)
    trainer = make_trainer(tmp_path)
    assert trainer.resume() == 1
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())
    assert trainer.carry[0] is not None and trainer.carry[0][0]["wkv"].shape == (2, 2, 16, 16)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _mutate_meta_field(meta: dict, data) -> None:
    """Replace one field, at the top level or inside the optimizer's groups, by a random JSON value."""
    targets = [(meta, k) for k in meta]
    targets += [(g, k) for g in meta["optimizer"]["param_groups"] for k in g]
    targets += [(meta["optimizer"], "scalars")] + [(e, "bytes") for e in meta.get("files", {}).values()]
    node, key = data.draw(st.sampled_from(targets))
    node[key] = data.draw(json_values)


_fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(_fuzz, max_examples=100)
@given(data=st.data())
def test_fuzz_resume_loads_or_raises_checkpoint_error(saved, data):
    files = dict(saved[0])
    meta = json.loads(files["meta.json"])
    if data.draw(st.booleans()):
        del meta["files"], meta["meta_sha256"]  # first format: no checksums, so the parsers meet the damage
    if data.draw(st.booleans()):
        _mutate_meta_field(meta, data)
    files["meta.json"] = json.dumps(meta).encode()
    name = data.draw(st.sampled_from(sorted(files)))
    raw = bytearray(files[name])
    for _ in range(data.draw(st.integers(0, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    files[name] = bytes(raw)

    rng = torch.get_rng_state()
    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp), files)
        trainer = make_trainer(Path(tmp))
        skipped = []
        try:
            step = trainer.resume(lambda path, reason: skipped.append(reason))
        except CheckpointError as e:
            assert str(e) and "\n" not in str(e)
            event("refused")
            return
        finally:
            torch.set_rng_state(rng)
        event(f"step {step}")
        assert (step, len(skipped)) in ((0, 1), (1, 0))
        if step == 1:
            assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
            assert all(s is not None for s in trainer.carry)
            try:  # what loaded also trains (or stops with the project's error, e.g. on huge weights)
                trainer.train_step()
            except RwkvxError as e:
                event(type(e).__name__)
        else:
            assert (Path(tmp) / "checkpoints" / "corrupt-step_00000001").is_dir()  # set aside, not deleted


@_fuzz
@given(raw=st.binary(max_size=300), data=st.data())
def test_fuzz_weight_files_load_or_raise_checkpoint_error(tmp_path, saved, raw, data):
    """safetensors and .pth readers on random bytes and on damaged real files."""
    files, weights = saved
    pth = tmp_path / "w.pth"
    if not pth.exists():
        torch.save({k: v[:2].clone() for k, v in list(weights.items())[:4]}, pth)
    real = {"model.safetensors": files["model.safetensors"], "w.pth": pth.read_bytes()}
    name = data.draw(st.sampled_from(sorted(real)))
    if data.draw(st.booleans()):
        raw = bytearray(real[name])
        for _ in range(data.draw(st.integers(1, 3))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        if data.draw(st.booleans()):
            raw = raw[: data.draw(st.integers(0, len(raw)))]
        raw = bytes(raw)
    path = tmp_path / f"fuzz{Path(name).suffix}"
    path.write_bytes(raw)
    try:
        loaded = load_weights_file(path)
    except CheckpointError as e:
        assert str(e) and "\n" not in str(e)
        event(f"{path.suffix} refused")
        return
    event(f"{path.suffix} loaded")
    assert all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items())


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pth_with_code_in_it_is_refused_without_running_the_code(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"emb.weight": torch.zeros(2), "x": _Payload(marker)}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match="is not a weights-only state dict"):
        load_weights_file(tmp_path / "evil.pth")
    assert not marker.exists()
    torch.save([torch.zeros(2)], tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="does not hold a flat state dict"):
        load_weights_file(tmp_path / "list.pth")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="expected a .safetensors or .pth file"):
        load_weights_file(tmp_path / "w.bin")


def test_mismatch_names_missing_unexpected_and_shapes():
    own = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1)}
    other = {"a": torch.zeros(3, 2), "b": torch.zeros(4), "d": torch.zeros(1)}
    assert mismatch(own, other) == "missing c; unexpected d; shape mismatch a (3, 2) vs (2, 3)"
    assert mismatch(own, own) == ""
    many = {f"w{i}": torch.zeros(1) for i in range(8)}
    assert mismatch(many, {}) == "missing w0, w1, w2, w3, w4 (+3 more)"


def test_init_from_loads_an_rwkv_lm_pth_and_reports_a_mismatch(tmp_path, corpus):
    run = tmp_path / "run"
    result = runner.invoke(app, ["train", *tiny_args(run, corpus, "train.tokens=256")])
    assert result.exit_code == 0, result.output
    pth = tmp_path / "model.pth"
    result = runner.invoke(app, ["export", "--checkpoint", str(run), "--out", str(pth)])
    assert result.exit_code == 0, result.output

    fresh = tmp_path / "fresh"
    result = runner.invoke(app, ["init", *tiny_args(fresh, corpus, f"train.init_from={pth}")])
    assert result.exit_code == 0, result.output
    loaded = full.load_weights(fresh / "checkpoints" / "step_00000000")
    exported = torch.load(pth, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in exported.items())

    result = runner.invoke(
        app, ["init", *tiny_args(tmp_path / "deeper", corpus, "model.n_layer=3", f"train.init_from={pth}")]
    )
    assert result.exit_code == 1
    line = "model.pth: the config says n_layer=3 (the weights: 2): blocks.2.ln1.weight missing"
    assert line in result.stderr and "Traceback" not in result.output


def test_non_finite_weights_are_refused(tmp_path):
    weights = {k: v.clone() for k, v in build_model(CFG.model, 0).state_dict().items()}
    weights["emb.weight"][0, 0] = float("nan")
    save_file(weights, tmp_path / "w.safetensors")
    with pytest.raises(CheckpointError, match="emb.weight holds non-finite values"):
        make_trainer(tmp_path).load_initial(load_weights_file(tmp_path / "w.safetensors"), "w.safetensors")
