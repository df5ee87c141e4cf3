"""State tuning (train.tune=state): the weights frozen, a trainable initial state per RWKV-7 block that every
row starts from at a document start. Its gradient is the finite-difference one and the same through every path
(fused or not, chunked BPTT, grad_cp), for 1 or 2 gloo ranks (DDP, FSDP2); a step moves the state alone; a run's
checkpoints hold the state alone and resume exactly, in both formats; the frozen base comes from any format, and
a changed base, or a setting state tuning does not take, is refused in one line."""

import copy
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file
from typer.testing import CliRunner

from rwkvx_cli.checkpoints.full import save_checkpoint
from rwkvx_cli.cli import app
from rwkvx_cli.config import Config, ModelConfig, TrainConfig, config_to_dict
from rwkvx_cli.data import ByteTokenizer
from rwkvx_cli.models import build_model
from rwkvx_cli.models.losses import micro_batch_loss
from rwkvx_cli.models.state import InitialState
from rwkvx_cli.train.distributed import DistInfo
from rwkvx_cli.train.loop import Trainer
from tests.data.chats import write_chats
from tests.train.helpers import losses, one_line_error, one_thread, rollback_to, rows

runner = CliRunner()
BASE = {"source": "base", "weights": "base", "step": None, "sha256": "0" * 64}


def _model_cfg(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=257, n_layer=2, n_embd=32, head_size=16, **kw)


def _cfg(micro_batch=2, grad_accum=4, **train) -> Config:
    return Config(
        model=_model_cfg(),
        train=TrainConfig(ctx_len=24, micro_batch=micro_batch, grad_accum=grad_accum, tokens=24 * 8 * 4, lr=0.05,
                          tune="state", sampler="documents", init_from="base", **train),
    )


def _perturbed(model, seed=1, scale=0.05):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # init zeroes the output projections: perturb so that the state reaches the loss
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


@functools.cache
def _model(**kw):
    return _perturbed(build_model(_model_cfg(**kw), 0))


def _data(n=3000, seed=0):
    """Byte tokens with an eod every ~20 and a loss mask over about half of the targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 257, size=n).astype(np.uint16)
    tokens[rng.random(n) < 0.05] = 0
    mask = (np.sin(np.arange(n) / 5.0) > -0.2).astype(np.uint8)
    return tokens, mask


def _trainer(cfg, run_dir, dist=DistInfo(), model=None):
    tokens, mask = _data()
    model = copy.deepcopy(model if model is not None else _model())
    return Trainer(cfg, run_dir, model, tokens, tokens, ByteTokenizer(), dist=dist, train_mask=mask, val_mask=mask,
                   base=BASE)


def _first_step(trainer) -> tuple[float, dict]:
    grads = {}
    step = trainer.optimizer.step

    def capture(*a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in trainer.tuned.named_parameters()})
        return step(*a, **k)

    trainer.optimizer.step = capture
    loss, _, _, applied = trainer.train_step()
    assert applied
    return loss, grads


def _close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys() and want
    worst = max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)
    assert worst <= tol, worst


def _state_loss(model, initial, x, y, **kw):
    loss, _ = micro_batch_loss(model, x, y, initial.expand(x.shape[0]), kw.pop("head", "chunked"), True, **kw)
    return loss


@pytest.mark.parametrize("shifts", [False, True])
def test_the_state_gradient_is_the_finite_difference_one(shifts):
    """fp64, the plain composition (the fused ops' reference): the loss's gradient with respect to every tensor of
    the initial state, against central differences (torch.autograd.gradcheck)."""
    cfg = ModelConfig(vocab_size=40, n_layer=2, n_embd=8, head_size=4, fused=False)
    model = _perturbed(build_model(cfg, 0), scale=0.3).double().requires_grad_(False)
    initial = InitialState(model, shifts).double()
    names = [n for n, _ in initial.named_parameters()]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in initial.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    idx = torch.randint(0, 40, (2, 7), generator=gen)

    def loss_of(*tensors):
        state = initial.expand(2)
        for name, t in zip(names, tensors, strict=True):
            i, slot, _ = name.removeprefix("blocks.").split(".")
            key = {"att.time_state": "wkv", "att.shift_state": "att_shift", "ffn.shift_state": "ffn_shift"}
            state[int(i)][key[f"{slot}.{name.split('.')[-1]}"]] = t.unsqueeze(0).expand(2, *t.shape)
        logits, _ = model(idx[:, :-1], state)
        return F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())

    inputs = tuple(p.detach().clone().requires_grad_(True) for p in initial.parameters())
    assert len(inputs) == (6 if shifts else 2)
    assert torch.autograd.gradcheck(loss_of, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_every_path_gives_the_state_the_same_gradient():
    """The fused block ops (the default), the plain composition, chunked BPTT and grad_cp carry the initial
    state and its gradient alike (fp32, 1e-5), token shifts included."""
    x = torch.randint(0, 257, (3, 21), generator=torch.Generator().manual_seed(2))
    grads = {}
    for name, fused, chunk_len, grad_cp in (
        ("fused", True, 0, False), ("plain", False, 0, False), ("chunked", True, 8, False), ("grad_cp", True, 0, True),
    ):
        model = copy.deepcopy(_model()) if fused else _perturbed(build_model(_model_cfg(fused=False), 0))
        model.requires_grad_(False)
        model.grad_checkpointing = grad_cp
        initial = InitialState(model, shifts=True)
        with torch.no_grad():
            for p in initial.parameters():
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(5))
        _state_loss(model, initial, x[:, :-1], x[:, 1:], chunk_len=chunk_len).backward()
        grads[name] = {n: p.grad for n, p in initial.named_parameters()}
        assert all(p.grad is None for p in model.parameters())
    for name in ("plain", "chunked", "grad_cp"):
        _close(grads[name], grads["fused"], 1e-5)


def test_a_step_moves_the_state_alone_by_the_masked_mean_over_documents(tmp_path):
    with one_thread():
        trainer = _trainer(_cfg(), tmp_path)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        assert [g["weight_decay"] for g in trainer.optimizer.param_groups] == [0.0]
        assert not any(p.requires_grad for p in trainer.model.parameters())
        x, y = trainer.sampler.batch(0)
        m, count = trainer.sampler.target_masks(0)
        starts = trainer.sampler.starts(0)
        assert all(s == 0 or trainer.train_tokens[s - 1] == 0 for s in starts.tolist())  # rows start at documents
        model = copy.deepcopy(_model()).requires_grad_(False)
        initial = InitialState(model)
        logits, _ = model(x, initial.expand(x.shape[0]))
        each = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        want = each[m.flatten()].sum() / count
        loss, grads = _first_step(trainer)
    assert abs(loss - want.item()) < 1e-5
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert all(p.abs().max() > 0 for p in trainer.tuned.parameters())  # zeros before the step
    assert set(grads) == {"blocks.0.att.time_state", "blocks.1.att.time_state"}


def test_micro_batches_and_heads_do_not_change_the_state_gradient(tmp_path):
    with one_thread():
        want = _first_step(_trainer(_cfg(micro_batch=8, grad_accum=1), tmp_path / "a"))
        for name, cfg in (("accum", _cfg()), ("full head", _cfg(head="full")), ("chunked", _cfg(chunk_len=10))):
            got = _first_step(_trainer(cfg, tmp_path / name.replace(" ", "-")))
            assert abs(got[0] - want[0]) < 1e-5, name
            _close(got[1], want[1], 1e-5)


def test_under_bf16_mixed_the_state_stays_fp32_and_its_gradient_near_fp32s(tmp_path):
    """train.precision=bf16-mixed (CPU autocast): the state and its AdamW moments stay fp32, the weights
    stay frozen, and the first step's state gradient is fp32's within bf16's rounding."""
    with one_thread():
        want = _first_step(_trainer(_cfg(), tmp_path / "fp32"))
        trainer = _trainer(_cfg(precision="bf16-mixed"), tmp_path / "bf16")
        assert trainer.precision == "bf16-mixed"
        got = _first_step(trainer)
    assert all(p.dtype == torch.float32 for p in trainer.tuned.parameters())
    assert all(t.dtype == torch.float32 for st in trainer.optimizer.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)
    assert not any(p.requires_grad or p.grad is not None for p in trainer.model.parameters())
    assert abs(got[0] - want[0]) < 2e-2 * abs(want[0])
    _close(got[1], want[1], 3e-2)  # measured 1.1e-2


def _rank(rank: int, store: str, out: str, mode: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        trainer = _trainer(_cfg(distributed=mode), f"{out}/run{rank}", DistInfo(rank, 2, launched=True))
        loss, grads = _first_step(trainer)
        torch.save({"loss": loss, "grads": grads, "state": dict(trainer.tuned.named_parameters())},
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_gloo_ranks_give_one_processs_state_gradient(tmp_path, mode):
    """The frozen model is not DDP's (nothing of it trains; FSDP2 still shards it): the state's gradient is
    averaged over the ranks by hand, and equals one process's, as does the step's state (1e-5)."""
    with one_thread():
        one = _trainer(_cfg(), tmp_path / "single")
        want_loss, want = _first_step(one)
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), mode), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert abs(got["loss"] - want_loss) < 1e-6
        _close(got["grads"], want, 1e-5)
        _close(got["state"], dict(one.tuned.named_parameters()), 1e-5)


def test_the_hybrid_tunes_its_rwkv7_blocks_and_leaves_moba_empty(tmp_path):
    model = _perturbed(build_model(_model_cfg(layers=["rwkv7", "moba", "rwkv7"], moba_chunk=8), 0))
    cfg = _cfg()
    cfg.model = copy.deepcopy(model.cfg)
    with one_thread():
        trainer = _trainer(cfg, tmp_path, model=model)
        loss, grads = _first_step(trainer)
    assert set(grads) == {"blocks.0.att.time_state", "blocks.2.att.time_state"}
    assert trainer.tuned.expand(1)[1] is None and trainer.tuned.tuned() == [0, 2]
    assert np.isfinite(loss)
    with pytest.raises(ValueError, match="not gdn"):
        InitialState(build_model(_model_cfg(layers=["rwkv7", "gdn"]), 0))


# -- runs from the command line --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A perturbed RWKV-7 saved as an rwkvx run's checkpoint, and a conversation corpus."""
    root = tmp_path_factory.mktemp("state")
    cfg = Config(model=ModelConfig(vocab_size=257, n_layer=2, n_embd=32, head_size=16))
    model = _perturbed(build_model(cfg.model, 0), scale=0.1)
    save_checkpoint(root / "base" / "checkpoints", 3, model, None, {"config": config_to_dict(cfg)}, 3)
    write_chats(root / "chats.jsonl", 200, seed=7)
    return root


def _args(root: Path, run: str, *extra) -> list[str]:
    return [
        f"run_dir={root / run}", f"data.corpus=[{root / 'chats.jsonl'}]", f"data.prepared_dir={root / 'data'}",
        f"train.init_from={root / 'base'}", "train.tune=state", "train.sampler=documents", "train.ctx_len=96",
        "train.micro_batch=4", "train.tokens=3072", "train.eval_interval=4", "train.eval_tokens=1000",
        "train.ckpt_interval=4", "train.warmup_tokens=0", "train.lr=0.2", *extra,
    ]  # fmt: skip


def _train(*args):
    with one_thread():
        result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def tuned(base):
    """A state-tuned run of 8 steps from `base`, full checkpoints every 4."""
    _train(*_args(base, "tuned"))
    return base / "tuned"


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_state_run_checkpoints_the_state_alone_and_resumes_exactly(base, tuned, fmt):
    name = "tuned" if fmt == "full" else f"run-{fmt}"  # the full run resumed ends as it was: bit for bit
    args = _args(base, name, f"train.checkpoint_format={fmt}")
    run = base / name
    if fmt != "full":
        assert "training the initial state (1.02k parameters) of" in _train(*args)
    full = losses(run)
    assert len(full) == 8 and all(np.isfinite(full)) and full[-1] < full[0]
    meta = json.loads((run / "checkpoints" / "step_00000008" / "meta.json").read_text())
    assert meta["base"]["weights"] == str(base / "base" / "checkpoints" / "step_00000003") and meta["base"]["step"] == 3
    if fmt == "full":
        tensors = load_file(run / "checkpoints" / "step_00000008" / "model.safetensors")
        assert {n: tuple(t.shape) for n, t in tensors.items()} == {
            "blocks.0.att.time_state": (2, 16, 16), "blocks.1.att.time_state": (2, 16, 16),
        }  # fmt: skip
    rollback_to(run, 4)
    _train(*args, "--resume")
    assert losses(run) == full  # bit for bit
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])
    assert result.exit_code == 0, result.output
    ev = json.loads(result.stdout)
    assert ev["by_document"] and ev["tuned_state"] and ev["documents"] >= 1
    assert abs(ev["loss"] - rows(run)[-1]["val_loss"]) < 1e-6  # the loop's validation, from the same state


def test_the_base_comes_from_any_format_and_a_changed_one_is_refused(base, tuned, tmp_path):
    """The frozen weights from an RWKV-LM .pth and a safetensors export train the state as the run directory's
    do (the same digest, the same losses); a base file that changed under a run refuses its resume."""
    digest = json.loads((tuned / "checkpoints" / "step_00000008" / "meta.json").read_text())["base"]["sha256"]
    for fmt, name in (("rwkv-lm", "base.pth"), ("safetensors", "base.safetensors")):
        result = runner.invoke(app, ["export", "--checkpoint", str(base / "base"), "--format", fmt,
                                     "--out", str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        _train(*_args(base, f"from-{fmt}", f"train.init_from={tmp_path / name}"))
        assert losses(base / f"from-{fmt}") == losses(tuned)
        meta = json.loads((base / f"from-{fmt}" / "checkpoints" / "step_00000008" / "meta.json").read_text())
        assert meta["base"]["sha256"] == digest and meta["base"]["weights"] == str(tmp_path / name)
    from safetensors.torch import save_file

    other = _perturbed(build_model(ModelConfig(vocab_size=257, n_layer=2, n_embd=32, head_size=16), 0), seed=9)
    save_file(other.state_dict(), tmp_path / "base.safetensors")
    rollback_to(base / "from-safetensors", 4)
    args = _args(base, "from-safetensors", f"train.init_from={tmp_path / 'base.safetensors'}")
    with one_thread():
        result = runner.invoke(app, ["train", *args, "--resume"])
    line = one_line_error(result, 1)
    assert "its state was tuned for the weights of" in line and str(tmp_path / "base.safetensors") in line


def test_what_state_tuning_does_not_take_is_refused_in_one_line(base, tuned):
    def refused(*extra, code=2):
        with one_thread():
            return one_line_error(runner.invoke(app, ["train", *_args(base, "refused", *extra)]), code)

    assert "train.init_from: state tuning trains an initial state for trained weights" in refused("train.init_from=")
    assert "set train.sampler=documents" in refused("train.sampler=epoch")
    assert "data.reset_at_eod" in refused("data.reset_at_eod=true")
    assert "train.optimizer: muon" in refused("train.optimizer=muon")
    assert "not gdn blocks" in refused("model.layers=[rwkv7,gdn]")
    assert "set train.tune=state" in refused("train.tune=full", "train.tune_shifts=true")
    assert "train.tbptt" in refused("train.tbptt=true")
    assert "upcycle" in refused("model.layers=[rwkv7,moba,rwkv7]")
    assert "a state-tuned run's checkpoint holds its initial state" in refused(f"train.init_from={tuned}", code=1)
    assert not (base / "refused" / "checkpoints").exists()


def test_a_resume_cannot_switch_what_trains(base):
    run = base / "switch"
    _train(*_args(base, "switch", "train.tokens=384", "train.ckpt_interval=1"))
    with one_thread():
        result = runner.invoke(app, ["train", *_args(base, "switch", "train.tokens=768", "train.tune_shifts=true"),
                                     "--resume", "--allow-change", "train.tune_shifts"])
    assert "train.tune_shifts is False in the run's checkpoints, True now" in one_line_error(result, 2)
    assert len(losses(run)) == 1
