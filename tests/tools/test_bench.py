"""`rwkvx bench` through the CLI at small shapes: every registered op and backend,
JSON contents, the speedup column, and usage errors. (Speed targets are read off
the numbers by people, never asserted.)"""

import functools
import json
import math
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.config import load_config
from rwkvx_cli.models import build_model
from rwkvx_cli.models.gpt import GPT, GPTConfig
from rwkvx_cli.models.losses import micro_batch_loss
from rwkvx_cli.ops import get_op, op_names
from tests.train.helpers import run_cli

runner = CliRunner()


@pytest.mark.parametrize(
    "ops",
    [
        pytest.param(["wkv4"], id="one-op"),  # the JSON's shape and every column, in seconds
        pytest.param(op_names(), id="every-op", marks=pytest.mark.slow),  # every backend of every op (minutes)
    ],
)
def test_bench_writes_json(tmp_path, ops, monkeypatch):
    if ops == op_names():
        # Every backend of every op, for what its rows hold: three repeats a row and a small matmul
        # probe beside each (the one-op case runs bench's own timing). ~35% of this case's time.
        from rwkvx_cli.tools import bench

        monkeypatch.setattr(bench, "timed", functools.partial(bench.timed, min_time=0.0))
        monkeypatch.setattr(bench, "matmul_peak_gflops", functools.partial(bench.matmul_peak_gflops, n=256))
    path = tmp_path / "bench.json"
    args = ["bench", "--shape", "1,32,2,16", "--mode", "fwd", "--mode", "fwdbwd", "--json", str(path)]
    if ops != op_names():
        args += [arg for op in ops for arg in ("--op", op)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["matmul_gflops"] > 0 and data["threads"] >= 1
    seen = {(r["op"], r["backend"], r["mode"]) for r in data["rows"]}
    assert {r["op"] for r in data["rows"]} == set(ops)
    for op in ops:
        spec = get_op(op)
        for bk in [*spec.production_backends(), spec.backends["reference"]]:
            assert (op, bk.name, "fwdbwd") in seen and (op, bk.name, "fwd") in seen
    for r in data["rows"]:
        assert r["error"] is None, r
        assert r["median_ms"] > 0 and r["gflops"] > 0 and r["tokens_per_s"] > 0 and r["repeats"] >= 3
        if r["backend"] == "reference":
            assert r["speedup"] == 1.0
        assert r["memory_mb"] > 0
        # each row is divided by the matmul rate measured next to it, not the run's first probe
        assert r["matmul_gflops"] > 0 and r["pct_of_peak"] == pytest.approx(r["gflops"] / r["matmul_gflops"] * 100)
        if r["mode"] == "fwdbwd":
            assert r["memory_mb"] > 0


def test_bench_times_document_starts_beside_each_row(tmp_path):
    path = tmp_path / "bench.json"
    args = ["bench", "--op", "wkv7", "--op", "rwkv7_out", "--backend", "cpu", "--baseline", "cpu"]
    args += ["--shape", "1,40,2,16"]
    result = runner.invoke(app, [*args, "--starts-every", "8", "--json", str(path)])
    assert result.exit_code == 0, result.output
    rows = {(r["op"], r["dims"].get("starts_every", 0)): r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {("wkv7", 0), ("wkv7", 8), ("rwkv7_out", 0), ("rwkv7_out", 8)}
    assert rows[("wkv7", 8)]["error"] is None and rows[("wkv7", 8)]["median_ms"] > 0
    assert rows[("rwkv7_out", 8)]["error"] == "takes no document starts"  # it mixes no tokens
    assert rows[("rwkv7_out", 0)]["error"] is None
    assert "·doc 8" in result.output


def test_bench_usage_errors():
    for args, message in (
        (["--shape", "1,2,3"], "must be B,T,H,N"),
        (["--op", "nope"], "unknown op 'nope'"),
        (["--mode", "both"], "'--mode': 'both' is not one of 'fwd', 'fwdbwd'"),
        (["--dtype", "int8"], "'--dtype': 'int8' is not one of 'fp32', 'bf16', 'fp64'"),
        (["--op", "wkv7", "--backend", "magic"], "unknown backend 'magic'"),
        (["--starts-every", "-1"], "--starts-every"),
        (["--model", "configs/tiny.yaml", "--starts-every", "8"], "does not go with --model"),
    ):
        result = runner.invoke(app, ["bench", *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and "Traceback" not in result.output


def test_bench_model(tmp_path):
    path = tmp_path / "model.json"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {n_layer: 2, n_embd: 64, head_size: 32}\ntrain: {ctx_len: 32, micro_batch: 2}\n")
    result = runner.invoke(app, ["bench", "--model", str(cfg), "--steps", "1", "--json", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["tokens_per_s"] > 0 and 0 < data["mfu_pct"] < 100
    parts = ("recurrence_pct", "matmul_pct", "fused_pct", "other_pct")
    assert abs(sum(data[p] for p in parts) - 100) < 1e-6
    assert data["recurrence_pct"] > 0 and data["matmul_pct"] > 0
    # each optimizer's step, and its share of a training step with it (the benched one ran AdamW)
    opts = data["optimizers"]
    assert data["optimizer"] == "adamw" and set(opts) == {"adamw", "muon"}
    for o in opts.values():
        assert o["step_ms"] > 0 and 0 < o["share_pct"] < 100
        assert o["share_pct"] == pytest.approx(o["step_ms"] / o["train_step_ms"] * 100)
    no_optimizer = opts["adamw"]["train_step_ms"] - opts["adamw"]["step_ms"]
    assert opts["muon"]["train_step_ms"] - opts["muon"]["step_ms"] == pytest.approx(no_optimizer)
    assert "optimizer step (this run: adamw): adamw" in result.stdout


def test_bench_model_vs_packed_times_document_starts(tmp_path):
    path = tmp_path / "model.json"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {n_layer: 2, n_embd: 64, head_size: 32}\ntrain: {ctx_len: 32, micro_batch: 2}\n")
    args = ["bench", "--model", str(cfg), "--steps", "1"]
    result = runner.invoke(app, [*args, "--set", "data.reset_at_eod=true", "--vs-packed", "--json", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["reset_over_packed"] > 0 and data["packed"]["step_ms"] > 0
    assert "data.reset_at_eod / packed step time" in result.output
    result = runner.invoke(app, [*args, "--vs-packed"])
    assert result.exit_code == 2 and "data.reset_at_eod must be true" in result.stderr


def test_bench_model_vs_packed_starts_documents_inside_a_short_window(tmp_path):
    """At ctx <= 64 a document every 64 tokens starts only at position 0, where the window starts from the zero
    state anyway: the benched window holds a document every half window instead, and says so."""
    path = tmp_path / "model.json"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {n_layer: 1, n_embd: 32, head_size: 32}\ntrain: {ctx_len: 16, micro_batch: 1}\n")
    args = ["bench", "--model", str(cfg), "--steps", "1", "--set", "data.reset_at_eod=true", "--vs-packed"]
    result = runner.invoke(app, [*args, "--json", str(path)])
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert (data["document_len"], data["document_starts"]) == (8, 1)  # one start inside the window: position 8
    assert "a document every 8 tokens" in result.output
    result = runner.invoke(app, [*args, "--set", "train.ctx_len=1"])
    assert result.exit_code == 2 and "train.ctx_len 1 has no room for a document start" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bench_model_refuses_an_end_of_document_id_outside_the_vocabulary(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {n_layer: 1, n_embd: 32, head_size: 32}\ntrain: {ctx_len: 16, micro_batch: 1}\n")
    args = ["bench", "--model", str(cfg), "--steps", "1", "--set", "data.reset_at_eod=true"]
    result = runner.invoke(app, [*args, "--set", "data.eod_id=257"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip() == (
        "error: data.eod_id: 257 is outside the vocabulary: must be below model.vocab_size (257)"
    )


def test_bench_model_keeps_the_profilers_chatter_off_the_terminal(tmp_path):
    """torch.profiler's C++ side writes STAGE:/USDT: lines to file descriptor 2 (a process is needed to
    see them: the runner only swaps sys.stderr); a warning written meanwhile still comes through."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {n_layer: 1, n_embd: 32, head_size: 32}\ntrain: {ctx_len: 16, micro_batch: 1}\n")
    proc = run_cli("bench", "--model", str(cfg), "--steps", "1")
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout
    assert "USDT:" not in proc.stderr and "STAGE:" not in proc.stderr, proc.stderr


def test_profiler_quiet_passes_other_stderr_lines_on(capfd):
    from rwkvx_cli.runs.runtime import profiler_quiet

    with profiler_quiet():
        os.write(2, b"USDT: profiler_start\nkept line\nSTAGE: done\n")
    assert capfd.readouterr().err == "kept line\n"


def test_bench_model_memory_follows_grad_cp_and_the_head(tmp_path):
    """The step's memory figures: recomputing the blocks keeps less, and so does the chunked head."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: {n_layer: 4, n_embd: 64, head_size: 32, vocab_size: 4096}\ntrain: {ctx_len: 256, micro_batch: 2}\n"
    )
    figures = {}
    for name, sets in (
        ("plain", ["train.head=full"]),
        ("grad_cp", ["train.head=full", "train.grad_cp=true"]),
        ("chunked", ["train.head=chunked"]),
    ):
        path = tmp_path / f"{name}.json"
        args = ["bench", "--model", str(cfg), "--steps", "1", "--json", str(path)]
        result = runner.invoke(app, args + [x for s in sets for x in ("--set", s)])
        assert result.exit_code == 0, result.output
        figures[name] = json.loads(path.read_text())
    plain = figures["plain"]
    # the gradients: every parameter once, fp32
    assert plain["grads_mb"] * 2**20 == pytest.approx(4 * (2 * 4096 * 64 + 4 * 64 * 64 * 12), rel=0.2)
    assert plain["peak_mb"] >= plain["grads_mb"] > 0
    assert figures["grad_cp"]["grad_cp"] and figures["grad_cp"]["activation_mb"] < 0.6 * plain["activation_mb"]
    # full logits: [2, 256, 4096] fp32 and their gradient, at least 16 MiB that the chunked head never holds
    assert figures["chunked"]["activation_mb"] < plain["activation_mb"] - 8


def test_bench_model_vs_unchunked(tmp_path):
    """Chunked BPTT's step against the same window unchunked, in one run: the chunked one keeps about
    one chunk's activations (a quarter, with the head's and the gradients' share on top)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {n_layer: 2, n_embd: 64, head_size: 32}\ntrain: {ctx_len: 1024, micro_batch: 1}\n")
    path = tmp_path / "r.json"
    args = ["bench", "--model", str(cfg), "--steps", "2", "--set", "train.chunk_len=256", "--vs-unchunked"]
    result = runner.invoke(app, [*args, "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "chunked / unchunked step time" in result.stdout
    r = json.loads(path.read_text())
    assert r["chunk_len"] == 256 and r["chunked_over_unchunked"] > 0 and "interleaved" in r["timing"]
    assert r["activation_mb"] < 0.5 * r["unchunked"]["activation_mb"]
    assert r["unchunked"]["grads_mb"] == r["grads_mb"]
    refused = runner.invoke(app, ["bench", "--model", str(cfg), "--steps", "1", "--vs-unchunked"])
    assert refused.exit_code == 2 and "train.chunk_len (0) must be set" in refused.stderr
    assert runner.invoke(app, ["bench", "--vs-unchunked"]).exit_code == 2


def test_bench_set_needs_a_model():
    result = runner.invoke(app, ["bench", "--set", "train.grad_cp=true"])
    assert result.exit_code == 2 and "--set" in result.stderr


# --- `bench --model --vs-gpt`: the same-size GPT baseline (models/gpt.py) ---

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _tiny_gpt(**sets):
    cfg = load_config(TINY, [f"{k}={v}" for k, v in sets.items()])
    return cfg, GPT(GPTConfig.matching(cfg), seed=0)


def test_gpt_matches_the_config_shape_and_size():
    cfg, gpt = _tiny_gpt()
    assert GPTConfig.matching(cfg) == GPTConfig(vocab_size=257, n_layer=4, n_embd=128, n_head=2, ctx_len=128)
    n_gpt = sum(p.numel() for p in gpt.parameters())
    n_rwkv = sum(p.numel() for p in build_model(cfg.model, 0).parameters())
    # 4 x (12 C^2 + 13 C) + (V + ctx) x C + 2 C with the head tied to the token table
    C, V, T = 128, 257, 128
    assert n_gpt == 4 * (12 * C * C + 13 * C) + (V + T) * C + 2 * C
    assert 0.5 < n_gpt / n_rwkv < 2


def test_gpt_is_causal_and_its_attention_is_per_head_softmax():
    _, gpt = _tiny_gpt(**{"train.ctx_len": 16})
    gpt.eval()
    idx = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 257
    with torch.no_grad():
        a, state = gpt(idx)
        b, _ = gpt(changed)
    assert state is None and a.shape == (2, 16, 257)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)  # earlier positions: bit-identical
    assert (a[:, 9:] - b[:, 9:]).abs().amax(-1).min() > 0  # that position and later ones see the change
    # the fused attention = a masked softmax per head of C/H channels, q|k|v in the projection's order
    attn, x = gpt.blocks[0].attn, torch.randn(2, 16, 128)
    q, k, v = (t.view(2, 16, 2, 64).transpose(1, 2) for t in attn.qkv(x).split(128, dim=-1))
    scores = (q @ k.transpose(-1, -2)) / 8.0
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    manual = attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, 128))
    torch.testing.assert_close(attn(x), manual, rtol=1e-5, atol=1e-5)


def test_gpt_loss_is_the_same_through_either_head():
    """The chunked cross-entropy (train.head=chunked) and full fp32 logits give the same loss."""
    _, gpt = _tiny_gpt(**{"train.ctx_len": 16})
    idx = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(1))
    chunked, _ = micro_batch_loss(gpt, idx[:, :-1], idx[:, 1:], None, "chunked", False)
    full, _ = micro_batch_loss(gpt, idx[:, :-1], idx[:, 1:], None, "full", False)
    torch.testing.assert_close(chunked, full)
    assert abs(full.item() - math.log(257)) < 0.5  # about uniform at init


def test_bench_model_vs_gpt(tmp_path):
    path = tmp_path / "vs.json"
    sets = ["--set", "train.ctx_len=32", "--set", "train.micro_batch=2"]
    args = ["bench", "--model", str(TINY), "--vs-gpt", "--steps", "1", *sets, "--json", str(path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    gpt = data["gpt"]
    assert data["tokens_per_s"] > 0 and gpt["tokens_per_s"] > 0
    assert data["rwkv_over_gpt"] == pytest.approx(data["tokens_per_s"] / gpt["tokens_per_s"], rel=1e-12)
    assert (gpt["n_layer"], gpt["n_embd"], gpt["n_head"], gpt["vocab_size"], gpt["ctx_len"]) == (4, 128, 2, 257, 32)
    assert data["batch"] == 2 and data["ctx_len"] == 32 and gpt["tied_head"]
    assert gpt["parameters"] == 4 * (12 * 128 * 128 + 13 * 128) + (257 + 32) * 128 + 2 * 128
    assert 0 < gpt["mfu_pct"] < 100 and gpt["train_flops_per_token"] > 6 * 4 * 12 * 128 * 128
    assert "GPT" in result.output and "interleaved" in data["timing"]


def test_bench_vs_gpt_needs_a_model():
    result = runner.invoke(app, ["bench", "--vs-gpt"])
    assert result.exit_code == 2 and "--vs-gpt" in result.stderr


def test_bench_model_vs_unfused(tmp_path):
    """The fused step against the same model unfused, interleaved in one run, with each one's memory and
    ops per block; it needs a fused model and goes with no other comparison."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {n_layer: 2, n_embd: 64, head_size: 32}\ntrain: {ctx_len: 32, micro_batch: 2}\n")
    path = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--model", str(cfg), "--steps", "2", "--vs-unfused", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "fused / unfused:" in result.stdout
    r = json.loads(path.read_text())
    assert r["fused_speedup"] > 0 and "interleaved with the unfused step's" in r["timing"]
    assert r["ops_per_block"]["kind"] == "rwkv7" and r["ops_per_block"]["fused"] is True
    assert r["unfused"]["ops_per_block"]["fused"] is False
    assert r["unfused"]["ops_per_block"]["ops"] > r["ops_per_block"]["ops"] > 0
    assert r["unfused"]["grads_mb"] == r["grads_mb"] and r["unfused"]["activation_mb"] > 0
    for args, message in (
        (["--vs-unfused", "--set", "model.fused=false"], "model.fused must be true"),
        (["--vs-unfused", "--vs-gpt"], "--vs-gpt and --vs-unfused do not go together"),
    ):
        refused = runner.invoke(app, ["bench", "--model", str(cfg), "--steps", "1", *args])
        assert refused.exit_code == 2 and message in refused.stderr, refused.output


def test_the_op_count_leaves_out_views_and_no_op_casts():
    from rwkvx_cli.tools.op_count import count_ops

    x = torch.randn(4, 6, requires_grad=True)

    def run():
        y = x.view(2, 12).t()  # views: not counted
        z = (y.contiguous() + 1).to(torch.float32)  # a copy, an add; a cast that copies nothing
        (z * 2).sum().backward()  # mul, sum; the backward's ops

    # The backward: ones_like (the seed gradient), mul (z * 2's), and the view's reshape, which copies
    # the transposed gradient; add, contiguous and t pass theirs on untouched.
    assert count_ops(run) == {
        "aten::contiguous": 1, "aten::add": 1, "aten::mul": 2, "aten::sum": 1, "aten::ones_like": 1, "aten::reshape": 1,
    }  # fmt: skip
