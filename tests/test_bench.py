"""`rwkvx bench` through the CLI at small shapes: every registered op and backend,
JSON contents, the speedup column, and usage errors. (Speed targets are read off
the numbers by people, never asserted.)"""

import json

import pytest
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.ops import get_op, op_names

runner = CliRunner()


def test_bench_every_op_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    result = runner.invoke(
        app, ["bench", "--shape", "1,32,2,16", "--mode", "fwd", "--mode", "fwdbwd", "--json", str(path)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["matmul_gflops"] > 0 and data["threads"] >= 1
    seen = {(r["op"], r["backend"], r["mode"]) for r in data["rows"]}
    for op in op_names():
        spec = get_op(op)
        for bk in [*spec.production_backends(), spec.backends["reference"]]:
            assert (op, bk.name, "fwdbwd") in seen and (op, bk.name, "fwd") in seen
    for r in data["rows"]:
        assert r["error"] is None, r
        assert r["median_ms"] > 0 and r["gflops"] > 0 and r["tokens_per_s"] > 0 and r["repeats"] >= 3
        if r["backend"] == "reference":
            assert r["speedup"] == 1.0
        assert r["memory_mb"] > 0
    fwdbwd = [r for r in data["rows"] if r["mode"] == "fwdbwd" and r["op"] == "wkv7"]
    assert all(r["memory_mb"] > 0 for r in fwdbwd)


def test_bench_usage_errors():
    for args, message in (
        (["--shape", "1,2,3"], "must be B,T,H,N"),
        (["--op", "nope"], "unknown op 'nope'"),
        (["--mode", "both"], "--mode 'both'"),
        (["--dtype", "int8"], "--dtype 'int8'"),
        (["--op", "wkv7", "--backend", "magic"], "unknown backend 'magic'"),
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
    assert abs(data["recurrence_pct"] + data["matmul_pct"] + data["other_pct"] - 100) < 1e-6
    assert data["recurrence_pct"] > 0 and data["matmul_pct"] > 0


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


def test_bench_set_needs_a_model():
    result = runner.invoke(app, ["bench", "--set", "train.grad_cp=true"])
    assert result.exit_code == 2 and "--set" in result.stderr
