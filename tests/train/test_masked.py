"""Training on loss masks (conversations): the step's loss is Σ CE over every target that carries loss, in every
micro-batch and rank, over their global count. Its gradient equals a hand computation and is the same for any
micro-batching and for 2 gloo ranks; packed conversations reset at their eod give the loss of each run alone; a
run resumes exactly, evaluates the masked validation loss, and refuses what does not fit in one line."""

import copy
import functools
import json

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.config import Config, DataConfig, ModelConfig, TrainConfig
from rwkvx_cli.data import ByteTokenizer, prepare
from rwkvx_cli.models import build_model, document_starts
from rwkvx_cli.models.losses import micro_batch_loss
from rwkvx_cli.train.distributed import DistInfo
from rwkvx_cli.train.loop import NonFiniteError, Trainer
from tests.data.chats import write_chats
from tests.train.helpers import losses, one_thread, rollback_to, rows, tiny_args

runner = CliRunner()


def _cfg(micro_batch=2, grad_accum=4, l2wrap=None, **train) -> Config:
    return Config(
        model=ModelConfig(vocab_size=257, n_layer=2, n_embd=32, head_size=16),
        data=DataConfig(reset_at_eod=True),
        train=TrainConfig(ctx_len=16, micro_batch=micro_batch, grad_accum=grad_accum, tokens=128 * 4,
                          grad_clip=1e9, l2wrap=l2wrap, **train),
    )


def _data(n=4000, seed=0):
    """Byte tokens with an eod every ~40 and a mask over ~40% of the targets (zeros in runs, as prompts)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 257, size=n).astype(np.uint16)
    tokens[rng.random(n) < 0.025] = 0
    mask = (np.sin(np.arange(n) / 7.0) > 0.3).astype(np.uint8)
    return tokens, mask


@functools.cache
def _model():
    model = build_model(_cfg().model, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # init zeroes output projections: perturb so every weight gets a gradient
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def _first_step_grads(cfg, run_dir, dist=DistInfo()) -> tuple[float, dict]:
    """The loss of step 1 and the gradient the optimizer was given."""
    tokens, mask = _data()
    trainer = Trainer(cfg, run_dir, copy.deepcopy(_model()), tokens, tokens, ByteTokenizer(), dist=dist,
                      train_mask=mask, val_mask=mask)
    grads = {}
    step = trainer.optimizer.step

    def capture(*a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(*a, **k)

    trainer.optimizer.step = capture
    loss, _, _, applied = trainer.train_step()
    assert applied
    return loss, grads


def _assert_grads_close(got, want, tol):
    assert got.keys() == want.keys() and len(want) > 10
    worst = max(((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item() for n in want)
    assert worst <= tol, worst


def test_masked_step_gradient_is_the_hand_computed_masked_mean(tmp_path):
    with one_thread():
        cfg = _cfg(l2wrap=False)
        loss, grads = _first_step_grads(cfg, tmp_path)
        trainer = Trainer(cfg, tmp_path, copy.deepcopy(_model()), *[_data()[0]] * 2, ByteTokenizer(),
                          train_mask=_data()[1])
        x, y = trainer.sampler.batch(0)
        m, count = trainer.sampler.target_masks(0)
        model = copy.deepcopy(_model())
        logits, _ = model(x, starts=document_starts(x, 0))
        each = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        want = each[m.flatten()].sum() / m.sum()  # every loss-carrying target of the global batch alike
        want.backward()
    assert count == int(m.sum()) and 0 < count < m.numel()
    assert abs(loss - want.item()) < 1e-5
    _assert_grads_close(grads, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, 1e-5)


def test_micro_batches_do_not_change_the_masked_gradient_l2wrap_included(tmp_path):
    with one_thread():
        one = _first_step_grads(_cfg(micro_batch=8, grad_accum=1), tmp_path / "a")
        four = _first_step_grads(_cfg(micro_batch=2, grad_accum=4), tmp_path / "b")
    assert abs(one[0] - four[0]) < 1e-6
    _assert_grads_close(four[1], one[1], 1e-5)


def _rank(rank: int, store: str, out: str, mode: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        cfg = _cfg(distributed=mode)
        loss, grads = _first_step_grads(cfg, f"{out}/run{rank}", DistInfo(rank, 2, launched=True))
        if mode == "fsdp":  # each rank holds rows of every gradient: gather them whole
            grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
        torch.save({"loss": loss, "grads": grads}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_gloo_ranks_give_one_processs_masked_gradient(tmp_path, mode):
    """8 rows a step in micro-batches of 2: one process accumulates 4, each of 2 ranks 2 (its 4 rows hold
    other counts of loss tokens than the other rank's): the gradient is the one masked mean's all the same."""
    with one_thread():
        want_loss, want = _first_step_grads(_cfg(), tmp_path / "single")
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), mode), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert abs(got["loss"] - want_loss) < 1e-6
        _assert_grads_close(got["grads"], want, 1e-5)
    tokens, mask = _data()
    trainer = Trainer(_cfg(), tmp_path, copy.deepcopy(_model()), tokens, tokens, ByteTokenizer(), train_mask=mask,
                      dist=DistInfo(0, 2))
    counts = [int(trainer.sampler.target_masks(0, r, 2)[0].sum()) for r in range(2)]
    assert counts[0] != counts[1]  # the ranks' shares differ: a per-rank mean would weigh them wrongly


def test_packed_conversations_reset_at_their_eod_give_each_ones_loss(tmp_path):
    """With data.reset_at_eod each conversation starts from a zero state at the eod before it, so the masked
    loss of a window packing several equals that of each read alone ([eod, its tokens, eod])."""
    model = copy.deepcopy(_model()).double()
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 257, size=int(rng.integers(5, 30))).tolist() + [0] for _ in range(5)]
    masks = [(rng.random(len(d)) < 0.5).tolist() for d in docs]
    window = torch.tensor([[0] + sum(docs, [])])
    target_mask = torch.tensor([sum(masks, [])])
    x, y = window[:, :-1], window[:, 1:]
    packed, _ = micro_batch_loss(model, x, y, None, "chunked", True, 0, document_starts(x, 0),
                                 target_mask.double() / target_mask.sum())
    total = 0.0
    for d, m in zip(docs, masks, strict=True):
        w = torch.tensor([[0] + d])
        part, _ = micro_batch_loss(model, w[:, :-1], w[:, 1:], None, "full", False, 0,
                                   document_starts(w[:, :-1], 0), torch.tensor([m], dtype=torch.float64))
        total += part.item()
    assert abs(packed.item() - total / target_mask.sum().item()) < 1e-10


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    root = tmp_path_factory.mktemp("chats")
    write_chats(root / "chats.jsonl", 250, seed=5)
    return root / "chats.jsonl"


def test_a_masked_run_resumes_exactly_and_evaluates_the_masked_loss(tmp_path, chats):
    args = tiny_args(tmp_path / "run", chats, "data.reset_at_eod=true", "train.grad_accum=2")
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    full = losses(tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "data" / "meta.json").read_text())
    assert meta["template"]["name"] == "g1" and 0 < meta["train"]["loss_tokens"] < meta["train"]["tokens"]
    rollback_to(tmp_path / "run", 4)
    result = runner.invoke(app, ["train", *args, "--resume"])
    assert result.exit_code == 0, result.output
    assert losses(tmp_path / "run") == full  # bit for bit
    result = runner.invoke(app, ["eval", "--checkpoint", str(tmp_path / "run"), "--json"])
    assert result.exit_code == 0, result.output
    ev = json.loads(result.stdout)
    assert 0 < ev["loss_tokens"] < ev["tokens"]
    assert abs(ev["loss"] - rows(tmp_path / "run")[-1]["val_loss"]) < 1e-6  # the loop's validation, the same


def test_eval_loss_is_the_mean_over_the_loss_tokens(tmp_path):
    from rwkvx_cli.evaluation.validation import evaluate
    from rwkvx_cli.runs.runtime import resolve

    tokens, mask = _data(300)
    model = copy.deepcopy(_model())
    ev = evaluate(model, tokens, 16, 4, 10_000, ByteTokenizer(), resolve("cpu", "fp32"), masks=mask)
    x = torch.from_numpy(tokens[:-1].astype(np.int64))[None]
    y = torch.from_numpy(tokens[1:].astype(np.int64))
    with torch.no_grad():  # one long window carries the state that consecutive windows do not: compare per window
        each = torch.cat([
            F.cross_entropy(model(x[:, a : a + 16])[0][0], y[a : a + 16], reduction="none")
            for a in range(0, 299, 16)
        ])
    m = torch.from_numpy(mask[1:] != 0)
    assert ev["tokens"] == 299 and ev["loss_tokens"] == int(m.sum())
    assert abs(ev["loss"] - (each[m].sum() / m.sum()).item()) < 1e-5
    n_bytes = len(ByteTokenizer().decode(tokens[1:][mask[1:] != 0].tolist()).encode())
    assert abs(ev["bpb"] - each[m].sum().item() / np.log(2) / n_bytes) < 1e-4


def test_a_step_without_loss_tokens_stops_or_is_skipped(tmp_path):
    tokens, _ = _data()
    mask = np.zeros(len(tokens), np.uint8)
    trainer = Trainer(_cfg(), tmp_path, copy.deepcopy(_model()), tokens, tokens, ByteTokenizer(), train_mask=mask)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(NonFiniteError) as e:
        trainer.train_step()
    assert str(e.value) == (
        "no target of step 1's batch carries loss (the data's loss masks) (its loss, a mean over none, is not "
        "defined); the model was not updated. Train on longer windows (train.ctx_len) or more rows per step, or "
        "set train.nonfinite=skip"
    )
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    cfg = _cfg(nonfinite="skip")
    trainer = Trainer(cfg, tmp_path, copy.deepcopy(_model()), tokens, tokens, ByteTokenizer(), train_mask=mask)
    loss, _, _, applied = trainer.train_step()
    assert not applied and loss != loss and trainer.skipped_steps == 1


def test_prepared_data_of_another_template_is_refused(tmp_path, chats):
    prepare([chats], tmp_path / "data", "byte", workers=1)
    other = tmp_path / "single.yaml"
    other.write_text('name: single\nroles: {user: {prefix: "Q:", loss: false}, assistant: {prefix: "A:", '
                     'loss: true}}\ntext_prefix: " "\nturn_end: "\\n"\n')
    args = tiny_args(tmp_path / "run", chats, f"data.prepared_dir={tmp_path / 'data'}", f"data.template={other}")
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'data'} was prepared with template g1, but the config asks for {other}; point "
        f"data.prepared_dir elsewhere, or remove {tmp_path / 'data'} to prepare it again"
    )
    result = runner.invoke(app, ["train", *tiny_args(tmp_path / "run2", chats, "data.template=chatml")])
    assert result.exit_code == 2 and "template 'chatml' is neither a template name (g1) nor a file" in result.output


def test_a_mixture_brings_each_sources_mask_and_refuses_two_templates(tmp_path, chats):
    from rwkvx_cli.config import load_config
    from rwkvx_cli.data import DataError
    from rwkvx_cli.runs.data import open_data
    from rwkvx_cli.train.loop import make_sampler

    prepare([chats], tmp_path / "chat", "byte", workers=1)
    plain = tmp_path / "plain.txt"
    plain.write_text("plain text, every token of it carries loss.\n" * 40)
    prepare([plain], tmp_path / "plain", "byte", workers=1)
    mix = f"data.mix=[{{path: {tmp_path / 'chat'}, weight: 1}}, {{path: {tmp_path / 'plain'}, weight: 1}}]"
    cfg = load_config(None, _mix_args(tmp_path, mix))
    data = open_data(cfg, tmp_path / "run")
    chat_mask, plain_mask = data.train.mask
    assert plain_mask is None and len(chat_mask) == len(data.train.sources[0].tokens)
    assert data.val.mask is not None  # the first prepared directory's validation split, with its mask
    sampler = make_sampler(cfg, data.train.tokens, 8, data.train.mask)
    m, count = sampler.target_masks(0)
    source, _ = sampler.starts(0)
    assert m[torch.from_numpy(source == 1)].all() and not m[torch.from_numpy(source == 0)].all()
    other = tmp_path / "other.yaml"
    other.write_text('name: other\nroles: {system: {prefix: "S:", loss: false}, user: {prefix: "Q:", loss: false}, '
                     'assistant: {prefix: "A:", loss: true}}\n')
    prepare([chats], tmp_path / "chat2", "byte", workers=1, template=other)
    mix = f"data.mix=[{{path: {tmp_path / 'chat'}, weight: 1}}, {{path: {tmp_path / 'chat2'}, weight: 1}}]"
    with pytest.raises(DataError, match=r"different chat templates \(g1 and other\)"):
        open_data(load_config(None, _mix_args(tmp_path, mix)), tmp_path / "run")


def _mix_args(tmp_path, mix: str) -> list[str]:
    return [a for a in tiny_args(tmp_path / "run", "unused", mix) if not a.startswith("data.corpus=")]


def test_validation_without_a_loss_token_is_refused_before_training(tmp_path, chats):
    from rwkvx_cli.config import load_config
    from rwkvx_cli.data import DataError
    from rwkvx_cli.runs.data import open_data

    prepare([chats], tmp_path / "data", "byte", workers=1)
    args = [f"data.corpus=[{tmp_path / 'data'}]", "train.ctx_len=8"]
    open_data(load_config(None, args), tmp_path / "run")  # the default eval_tokens reaches the replies
    with pytest.raises(DataError) as e:
        open_data(load_config(None, [*args, "train.eval_tokens=4"]), tmp_path / "run")  # "User: ..." or "System:"
    assert str(e.value) == (
        "no target among the first 4 validation tokens carries loss (the split's loss masks): validation would "
        "average over none; raise train.eval_tokens"
    )
