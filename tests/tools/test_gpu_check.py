"""`make gpu-check`'s driver, run on the CPU at tiny sizes (`--device cpu --quick`): the shape
of bench/gpu.json and bench/gpu.md, and that a failing step is reported with a non-zero exit."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rwkvx_cli.native import cache_root

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check(tmp_path, *args) -> subprocess.CompletedProcess:
    # the package from the checkout, as on a GPU box: no venv entry points on PATH; the native
    # kernels from the suite's cache (rwkvx_cli/native.py), not compiled afresh under the new HOME
    # (30 s of each run here, and not what these tests check)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path), "RWKVX_CACHE": str(cache_root())}
    cmd = [sys.executable, "-m", "rwkvx_cli.tools.gpu_check", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _run(tmp_path, *args):
    proc = _gpu_check(tmp_path, "--device", "cpu", "--quick", "--out", str(tmp_path), *args)
    report = json.loads((tmp_path / "gpu.json").read_text())
    return proc, report, (tmp_path / "gpu.md").read_text()


@pytest.mark.slow  # every step of the driver, the compile step included: ~2 minutes on the CPU
def test_gpu_check_quick_cpu_run(tmp_path):
    proc, report, md = _run(tmp_path, "--ops", "wkv4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["passed"] and report["failed"] == []
    assert [s["name"] for s in report["steps"]] == ["gradcheck", "bench", "fused", "model", "train", "auto", "compile"]
    assert all(s["status"] == "ok" for s in report["steps"])
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["gradcheck"]["data"]["wkv4"]["passed"]
    rows = steps["bench"]["data"]["fp32"]["rows"]
    assert {r["mode"] for r in rows} == {"fwd", "fwdbwd"} and all(r["median_ms"] > 0 for r in rows)
    fused = steps["fused"]["data"]["fp32"]  # every block op's rows, the reference among them
    assert {r["op"] for r in fused} == {"shift_mix", "rwkv7_prep", "rwkv7_out", "channel_mix"}
    assert all(r["median_ms"] > 0 and r["speedup"] > 0 for r in fused)
    model = steps["model"]["data"]
    assert model["fused_speedup"] > 0 and model["unfused_ops_per_block"] > 0 and model["ops_per_block"] > 0
    train = steps["train"]["data"]
    assert train["steps"] == 4 and train["loss_falling"] and train["tokens_per_s"] > 0
    assert set(steps["auto"]["data"]) >= {"wkv7", "wkv4", "rwkv8", "gdn", "kda"}
    # quick: wkv7 `triton` alone, under the interpreter, compiled (fullgraph) against eager
    [compiled] = steps["compile"]["data"]["backends"]
    assert (compiled["op"], compiled["backend"], compiled["passed"]) == ("wkv7", "triton", True)
    assert report["environment"]["torch"]
    assert md.startswith("# rwkvx gpu-check") and "| gradcheck | ok |" in md and "tokens/s" in md
    assert "## fused block ops" in md and "## fused vs unfused training step" in md


def test_gpu_check_reports_a_failing_step(tmp_path):
    proc, report, md = _run(tmp_path, "--ops", "nosuchop", "--steps", "gradcheck,auto")
    assert proc.returncode == 1
    assert not report["passed"] and report["failed"] == ["gradcheck"]
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["gradcheck"]["status"] == "FAIL" and "exit 1" in steps["gradcheck"]["detail"]
    assert steps["auto"]["status"] == "ok"
    assert "| gradcheck | FAIL |" in md and "FAIL in" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: --device cuda runs")
def test_cuda_without_a_cuda_device_is_one_line_before_any_step(tmp_path):
    proc = _gpu_check(tmp_path, "--device", "cuda", "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["error: --device=cuda: no CUDA device is available here"]
    assert not (tmp_path / "out").exists()
