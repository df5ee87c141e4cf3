"""`make gpu-check`: one command for a GPU box, writing bench/gpu.json and bench/gpu.md.

Runs offline with the box's own python (CUDA torch 2.11+ and Triton 3.6+ tested for; nothing
is installed except fla from a local wheel folder), the package from this checkout
(PYTHONPATH=.), each step in its own process with a time limit so that a crashed or hung
kernel fails that step only:

  1. gradcheck  `rwkvx gradcheck` gates A and B of every production backend of every op that
                runs on the device (the fp64 oracle and finite differences on the CPU).
  2. bench      every wkv7 backend at (8, 4096, 64, 64), bf16 and fp32, fwd and fwdbwd, with
                fla's chunk_rwkv7 as a peer row when FLA_WHEELS=dir (or --fla-wheels) names a
                folder of fla-core / flash-linear-attention wheels; else the row is skipped.
  3. fused      every fused block op (shift_mix, rwkv7_prep, rwkv7_out, channel_mix) at the
                0.1B model's width and batch (8, 4096, 12, 64), bf16 and fp32, fwdbwd: each
                backend against the reference, the unfused torch composition.
  4. model      `rwkvx bench --model configs/gpu-0.1b.yaml --vs-unfused`: the fused training
                step against the unfused one, interleaved: tokens/s, activation memory, ops per
                block of each.
  5. train      200 bf16 steps of configs/gpu-0.1b.yaml (ctx 4096, byte vocabulary, the
                bundled corpus): tokens/s, MFU, peak memory, loss falling.
  6. auto       the backend `auto` picks per op on the device.
  7. compile    every Triton backend through torch.compile(fullgraph=True) against eager, forward
                and backward, at the ops' small gradient-check case: on CUDA the kernels are
                torch.library.triton_ops that Inductor launches itself, which no CPU test can run.

Each step's status (ok, FAIL, skipped) is in the report; the exit status is 1 if any failed. An
existing gpu.json or gpu.md in --out is replaced only with --force (`make gpu-check` passes it).
`--device cpu --quick` runs the same steps at tiny sizes (the test suite's check of the driver).
Library code never prints; this module is a script (`python -m rwkvx_cli.tools.gpu_check`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rwkvx_cli.entry import ArgumentParser, run_main
from rwkvx_cli.fsio import check_output, write_output

ROOT = Path(__file__).resolve().parents[2]  # the checkout (rwkvx_cli/tools/ is two below it)
TRAIN_CONFIG = ROOT / "configs" / "gpu-0.1b.yaml"
BENCH_SHAPE = "8,4096,64,64"
BLOCK_SHAPE = "8,4096,12,64"  # the fused block ops at C = 768: the 0.1B model's width, batch and ctx
TRAIN_STEPS = 200
MODEL_STEPS = 10
# Seconds per step (the whole run must stay under 8 minutes on one H100/H200).
LIMITS = {"gradcheck": 90, "bench": 120, "fused": 120, "model": 150, "train": 150, "auto": 60, "compile": 360}


@dataclass
class Step:
    name: str
    status: str = "ok"  # ok, FAIL, skipped
    seconds: float = 0.0
    detail: str = ""
    data: dict = field(default_factory=dict)


def _env(extra_path: str | None = None, interpret: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(ROOT), *([extra_path] if extra_path else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def _run(step: Step, cmd: list[str], limit: float, env: dict) -> subprocess.CompletedProcess | None:
    """Run one command; on a non-zero exit or a timeout mark the step failed with the tail of its output."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        step.status, step.detail = "FAIL", f"timed out after {limit:.0f}s: {' '.join(cmd[2:])}"
        return None
    finally:
        step.seconds += time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-3:]
        step.status = "FAIL"
        step.detail = (step.detail + "; " if step.detail else "") + f"exit {proc.returncode}: " + " | ".join(tail)
    return proc


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


# -- the steps -------------------------------------------------------------------------------------


def step_gradcheck(device: str, ops: list[str], args) -> Step:
    step = Step("gradcheck")
    with tempfile.TemporaryDirectory() as tmp:
        for op in ops:
            out = Path(tmp) / f"{op}.json"
            cmd = _py("-m", "rwkvx_cli.tools.gpu_check", "--worker", "gradcheck", "--op", op, "--device", device)
            _run(step, [*cmd, "--json", str(out)], LIMITS["gradcheck"], _env())
            if out.exists():
                result = json.loads(out.read_text())
                step.data[op] = result
                if not result["passed"]:
                    step.status = "FAIL"
                    failed = sorted({r["backend"] for r in result["results"] if not r["passed"]})
                    step.detail += f"{op}: {', '.join(failed) or 'no backend ran'} failed; "
            elif step.status != "FAIL" or op not in step.detail:
                step.data[op] = {"passed": False}
    step.detail = step.detail.strip("; ") or f"{len(ops)} ops, every {device} backend passed both gates"
    return step


def _fla_path(wheels: str | None, step: Step, target: Path) -> str | None:
    if not wheels:
        step.data["fla"] = "skipped: no FLA_WHEELS folder given"
        return None
    cmd = _py("-m", "pip", "install", "--no-index", "--no-deps", "--find-links", wheels, "--target", str(target))
    proc = subprocess.run([*cmd, "fla-core", "flash-linear-attention"], capture_output=True, text=True)
    if proc.returncode != 0:
        step.data["fla"] = "skipped: pip could not install fla from " + wheels
        return None
    step.data["fla"] = f"installed from {wheels}"
    return str(target)


def step_bench(device: str, quick: bool, wheels: str | None) -> Step:
    step = Step("bench")
    shape = "1,64,1,16" if quick else BENCH_SHAPE
    with tempfile.TemporaryDirectory() as tmp:
        fla = _fla_path(wheels, step, Path(tmp) / "fla") if device == "cuda" else None
        names = ["recurrent"] if quick else _bench_backends(device, fla)  # quick: the CPU test's seconds
        step.data["backends"] = names
        for dtype in ("fp32",) if quick else ("bf16", "fp32"):
            out = Path(tmp) / f"{dtype}.json"
            cmd = _py("-m", "rwkvx_cli", "bench", "--op", "wkv7", "--shape", shape, "--dtype", dtype)
            cmd += ["--mode", "fwd", "--mode", "fwdbwd", "--device", device, "--baseline", names[0]]
            cmd += [x for n in names for x in ("--backend", n)] + ["--json", str(out)]
            _run(step, cmd, LIMITS["bench"], _env(fla))
            if out.exists():
                step.data[dtype] = json.loads(out.read_text())
                for row in step.data[dtype]["rows"]:
                    if row.get("error"):
                        step.status = "FAIL"
                        step.detail += f"{row['backend']} {dtype} {row['mode']}: {row['error']}; "
    step.detail = step.detail.strip("; ")
    if step.status == "ok":
        step.detail = f"wkv7 at {shape}: {', '.join(names)}" + ("" if fla or device != "cuda" else "; fla row skipped")
    return step


def _bench_backends(device: str, fla: str | None) -> list[str]:
    """wkv7's backends that run on `device`, the fastest production one first; not the fp64
    oracle (a step loop, minutes at T = 4096); fla when installed."""
    from rwkvx_cli.ops import get_op

    spec = get_op("wkv7")
    names = [b.name for b in spec.backends.values() if device in b.devices and b.name != spec.reference]
    names = [n for n in names if not spec.backends[n].peer]
    if device == "cpu":  # the Triton backends need CUDA here (the interpreter is not a benchmark)
        names = [n for n in names if "triton" not in n]
    if fla:
        names.append("fla")
    return names


def step_fused(device: str, quick: bool) -> Step:
    """The fused block ops' backends that run on the device (not Triton's interpreter on a CPU)
    against their reference, the unfused composition (`speedup` in the rows)."""
    from rwkvx_cli.ops import get_op, op_names

    step = Step("fused")
    shape = "1,64,1,16" if quick else BLOCK_SHAPE
    ops = [n for n in op_names() if get_op(n).family == "block"]
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("fp32",) if quick else ("bf16", "fp32"):
            for op in ops:
                spec = get_op(op)
                names = [
                    b.name
                    for b in spec.production_backends()
                    if device in b.devices and not (device == "cpu" and "triton" in b.name)
                ] + [spec.reference]
                out = Path(tmp) / f"{op}-{dtype}.json"
                cmd = _py("-m", "rwkvx_cli", "bench", "--op", op, "--shape", shape, "--dtype", dtype)
                cmd += ["--mode", "fwdbwd", "--device", device] + [x for n in names for x in ("--backend", n)]
                _run(step, [*cmd, "--json", str(out)], LIMITS["fused"], _env())
                if out.exists():
                    rows = json.loads(out.read_text())["rows"]
                    step.data.setdefault(dtype, []).extend(rows)
                    for row in rows:
                        if row.get("error"):
                            step.status = "FAIL"
                            step.detail += f"{op} {row['backend']} {dtype}: {row['error']}; "
    step.detail = step.detail.strip("; ")
    if step.status == "ok":
        step.detail = f"{', '.join(ops)} at {shape}"
    return step


def step_model(device: str, quick: bool) -> Step:
    """The fused training step against the unfused one (`rwkvx bench --model --vs-unfused`)."""
    step = Step("model")
    sets = ["model.n_layer=1", "model.n_embd=64", "train.ctx_len=32", "train.micro_batch=2"] if quick else []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model.json"
        cmd = _py("-m", "rwkvx_cli", "bench", "--model", str(TRAIN_CONFIG), "--vs-unfused", "--device", device)
        cmd += ["--steps", str(2 if quick else MODEL_STEPS), *[x for s in sets for x in ("--set", s)]]
        _run(step, [*cmd, "--json", str(out)], LIMITS["model"], _env())
        r = json.loads(out.read_text()) if out.exists() else None
    if r is None:
        step.status = "FAIL"
        step.detail = step.detail or "no result"
        return step
    plain = r["unfused"]
    step.data = {
        "config": str(TRAIN_CONFIG.relative_to(ROOT)),
        "precision": r["precision"],
        "tokens_per_s": r["tokens_per_s"],
        "unfused_tokens_per_s": plain["tokens_per_s"],
        "fused_speedup": r["fused_speedup"],
        "mfu_pct": r["mfu_pct"],
        "unfused_mfu_pct": plain["mfu_pct"],
        "activation_mb": r["activation_mb"],
        "unfused_activation_mb": plain["activation_mb"],
        "ops_per_block": r["ops_per_block"]["ops"],
        "unfused_ops_per_block": plain["ops_per_block"]["ops"],
    }
    if step.status == "ok":
        d = step.data
        step.detail = (
            f"fused {d['fused_speedup']:.2f}x the unfused tokens/s, activations {d['activation_mb']:,.0f} / "
            f"{d['unfused_activation_mb']:,.0f} MiB, ops per block {d['ops_per_block']:.0f} / "
            f"{d['unfused_ops_per_block']:.0f}"
        )
    return step


def step_train(device: str, quick: bool) -> Step:
    step = Step("train")
    with tempfile.TemporaryDirectory() as tmp:
        steps = 4 if quick else TRAIN_STEPS
        ctx, batch = (32, 2) if quick else (None, None)
        overrides = [f"run_dir={tmp}/run", f"train.device={device}", f"data.prepared_dir={tmp}/data"]
        if quick:
            overrides += ["model.n_layer=1", "model.n_embd=64", f"train.ctx_len={ctx}", f"train.micro_batch={batch}"]
            overrides += ["train.eval_tokens=256", "train.warmup_tokens=0"]
        from rwkvx_cli.config import load_config
        from rwkvx_cli.runs.layout import metrics_path

        cfg = load_config(TRAIN_CONFIG, overrides)
        tokens = steps * cfg.train.ctx_len * cfg.train.micro_batch * cfg.train.grad_accum
        overrides.append(f"train.tokens={tokens}")
        _run(step, _py("-m", "rwkvx_cli", "train", "--config", str(TRAIN_CONFIG), *overrides), LIMITS["train"], _env())
        log = metrics_path(Path(tmp) / "run")
        rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    rows = [r for r in rows if r.get("loss") is not None]
    if not rows:
        step.status = "FAIL"
        step.detail = step.detail or "no metrics were logged"
        return step
    later = rows[len(rows) // 5 :] or rows  # skip the warm-up steps (compilation, autotuning)
    tps = statistics.median(r["tokens_per_s"] for r in later)
    first, last = rows[0]["loss"], statistics.mean(r["loss"] for r in rows[-max(1, len(rows) // 10) :])
    step.data = {
        "steps": len(rows),
        "tokens_per_s": tps,
        "peak_mem_mb": max(r["peak_mem_mb"] for r in rows),
        "loss_first": first,
        "loss_last": last,
        "loss_falling": last < first,
        "mfu_pct": _mfu(cfg, tps, device),
        "config": str(TRAIN_CONFIG.relative_to(ROOT)),
        "overrides": overrides,
    }
    if step.status == "ok" and not last < first:
        step.status, step.detail = "FAIL", f"the loss did not fall ({first:.3f} -> {last:.3f})"
    if step.status == "ok":
        step.detail = f"{len(rows)} steps, {tps:,.0f} tokens/s, loss {first:.3f} -> {last:.3f}"
    return step


def _mfu(cfg, tokens_per_s: float, device: str) -> float | None:
    """MFU as `rwkvx bench --model` computes it: train FLOPs per token x tokens/s / matmul peak."""
    import torch

    from rwkvx_cli.models import build_model
    from rwkvx_cli.models.summary import model_summary
    from rwkvx_cli.runs.runtime import matmul_peak_gflops

    try:
        with torch.device("meta"):
            model = build_model(cfg.model, 0)
        flops = model_summary(model)["train_flops_per_token"]
        dev = torch.device(device)
        peak = matmul_peak_gflops(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    except Exception:  # noqa: BLE001 - MFU is a figure of the report, not a gate
        return None
    return tokens_per_s * flops / (peak * 1e9) * 100


def step_auto(device: str) -> Step:
    step = Step("auto")
    code = (
        "import json, torch; from rwkvx_cli.ops import get_op, op_names, resolve_backend; "
        f"d = torch.device({device!r}); "
        "print(json.dumps({n: resolve_backend(get_op(n), 'auto', d).name for n in op_names()}))"
    )
    proc = _run(step, _py("-c", code), LIMITS["auto"], _env())
    if proc is not None and proc.returncode == 0:
        step.data = json.loads(proc.stdout.strip().splitlines()[-1])
        step.detail = ", ".join(f"{k}: {v}" for k, v in step.data.items())
    return step


def step_compile(device: str, quick: bool) -> Step:
    step = Step("compile")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compile.json"
        cmd = _py("-m", "rwkvx_cli.tools.gpu_check", "--worker", "compile", "--device", device, "--json", str(out))
        # On the CPU (the test suite's quick run) the kernels run under Triton's interpreter.
        _run(step, [*cmd, *(["--quick"] if quick else [])], LIMITS["compile"], _env(interpret=device == "cpu"))
        results = json.loads(out.read_text()) if out.exists() else []
    step.data = {"backends": results}
    failed = [f"{r['op']} {r['backend']}: {r['error']}" for r in results if not r["passed"]]
    ran = [r for r in results if not r.get("skipped")]
    if failed:
        step.status, step.detail = "FAIL", "; ".join(failed)
    elif step.status == "ok" and not ran:
        step.status = "skipped"
        step.detail = "; ".join(sorted({r["skipped"] for r in results})) or "no Triton backend"
    elif step.status == "ok":
        names = ", ".join(f"{r['op']} {r['backend']} ({r['seconds']:.0f}s)" for r in ran)
        step.detail = f"compiled (fullgraph) = eager, forward and backward: {names}"
    return step


# -- the workers (each in its own process) ---------------------------------------------------------


def _worker_gradcheck(op: str, device: str, json_path: str) -> int:
    import torch

    from rwkvx_cli.ops import get_op
    from rwkvx_cli.tools.gradcheck import run_gradcheck

    spec = get_op(op)
    dev = torch.device(device)
    backends = [b for b in spec.production_backends() if device in b.devices and b.unavailable() is None]
    report = run_gradcheck(spec, backends, device=dev)
    result = {**report.to_dict(), "backends": [b.name for b in backends]}
    if not backends:
        result["passed"] = True  # nothing of this op runs on the device
    Path(json_path).write_text(json.dumps(result))
    return 0 if result["passed"] else 1


def compiled_matches_eager(op: str, backend: str, device: str) -> str | None:
    """None when torch.compile(fullgraph=True) of the backend's forward and the gradient of a fixed
    projection of its outputs equal eager's (fp32, the op's gradient-check case), else why not."""
    import torch

    from rwkvx_cli.ops import get_op

    spec = get_op(op)
    case = spec.fd_case
    tensors = spec.sample(case, torch.Generator().manual_seed(0))
    tensors = {k: v.to(device, torch.float32).requires_grad_(v.is_floating_point()) for k, v in tensors.items()}
    leaves = [t for t in tensors.values() if t.requires_grad]

    def loss(tensors):
        y, states = spec.call(spec.backends[backend], tensors, case)
        outs = (*y, *states)
        return sum((o * torch.linspace(-1, 1, o.numel(), device=o.device).view(o.shape)).sum() for o in outs)

    eager = loss(tensors)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(loss, fullgraph=True)(tensors)
    compiled_grads = torch.autograd.grad(compiled, leaves)
    try:
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        for got, want in zip(compiled_grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    except AssertionError as e:
        return str(e).strip().splitlines()[0]
    return None


def _worker_compile(device: str, json_path: str, quick: bool) -> int:
    """compiled_matches_eager for every Triton backend (quick: wkv7 `triton` only); a backend that
    raises is a failure with the exception's first line."""
    from rwkvx_cli.ops import get_op, op_names

    results = []
    for op in op_names():
        for bk in get_op(op).backends.values():
            if "triton" not in bk.name or bk.peer or (quick and (op, bk.name) != ("wkv7", "triton")):
                continue
            if device not in bk.devices or bk.unavailable() is not None:
                results.append(
                    {
                        "op": op,
                        "backend": bk.name,
                        "passed": True,
                        "error": None,
                        "seconds": 0.0,
                        "skipped": bk.unavailable() or f"does not run on {device}",
                    }
                )
                continue
            start = time.perf_counter()
            try:
                error = compiled_matches_eager(op, bk.name, device)
            except Exception as e:  # noqa: BLE001 - reported per backend, the others still run
                error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            seconds = time.perf_counter() - start
            results.append({"op": op, "backend": bk.name, "passed": error is None, "error": error, "seconds": seconds})
            Path(json_path).write_text(json.dumps(results))  # after each: a crash keeps what ran
    Path(json_path).write_text(json.dumps(results))
    return 0 if all(r["passed"] for r in results) else 1


# -- the report ------------------------------------------------------------------------------------


def environment(device: str) -> dict:
    import platform

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# rwkvx gpu-check",
        "",
        f"{env.get('gpu', env['device'])} · torch {env['torch']} · triton {env['triton']} · "
        f"{'PASS' if report['passed'] else 'FAIL'} in {report['seconds']:.0f}s",
        "",
        "| step | status | seconds | detail |",
        "|---|---|---|---|",
    ]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {s['detail']} |" for s in report["steps"]]
    bench = next((s for s in report["steps"] if s["name"] == "bench"), None)
    if bench and any(k in bench["data"] for k in ("bf16", "fp32")):
        lines += ["", f"## wkv7 at B,T,H,N = {BENCH_SHAPE if not report['quick'] else '1,64,1,16'}", ""]
        lines += ["| backend | dtype | mode | ms |", "|---|---|---|---|"]
        for dtype in ("bf16", "fp32"):
            for row in bench["data"].get(dtype, {}).get("rows", []):
                ms = row.get("median_ms")
                ms_text = f"{ms:.3f}" if isinstance(ms, (int, float)) else str(row.get("error", "–"))
                lines.append(f"| {row.get('backend')} | {dtype} | {row.get('mode')} | {ms_text} |")
        if "fla" in bench["data"]:
            lines += ["", f"fla: {bench['data']['fla']}"]
    fused = next((s for s in report["steps"] if s["name"] == "fused"), None)
    if fused and fused["data"]:
        lines += ["", f"## fused block ops at B,T,H,N = {BLOCK_SHAPE if not report['quick'] else '1,64,1,16'}", ""]
        lines += ["| op | backend | dtype | ms | x reference |", "|---|---|---|---|---|"]
        for dtype in ("bf16", "fp32"):
            for row in fused["data"].get(dtype, []):
                ms, up = row.get("median_ms"), row.get("speedup")
                ms_text = f"{ms:.3f}" if isinstance(ms, (int, float)) else str(row.get("error", "–"))
                up_text = f"{up:.2f}" if isinstance(up, (int, float)) else "–"
                lines.append(f"| {row.get('op')} | {row.get('backend')} | {dtype} | {ms_text} | {up_text} |")
    model = next((s for s in report["steps"] if s["name"] == "model"), None)
    if model and model["data"]:
        d = model["data"]
        lines += [
            "",
            f"## fused vs unfused training step ({d['config']}, {d['precision']})",
            "",
            f"tokens/s {d['tokens_per_s']:,.0f} vs {d['unfused_tokens_per_s']:,.0f} ({d['fused_speedup']:.2f}x) · "
            f"MFU {d['mfu_pct']:.1f}% vs {d['unfused_mfu_pct']:.1f}% · activations {d['activation_mb']:,.0f} vs "
            f"{d['unfused_activation_mb']:,.0f} MiB · ops per block {d['ops_per_block']:.0f} vs "
            f"{d['unfused_ops_per_block']:.0f}",
        ]
    train = next((s for s in report["steps"] if s["name"] == "train"), None)
    if train and train["data"]:
        d = train["data"]
        mfu = f"{d['mfu_pct']:.1f}%" if d.get("mfu_pct") is not None else "–"
        lines += [
            "",
            f"## training ({d['config']}, {d['steps']} steps, bf16)",
            "",
            f"tokens/s {d['tokens_per_s']:,.0f} · MFU {mfu} · peak memory {d['peak_mem_mb']:,.0f} MB · "
            f"loss {d['loss_first']:.3f} -> {d['loss_last']:.3f}",
        ]
    return "\n".join(lines) + "\n"


STEPS = ("gradcheck", "bench", "fused", "model", "train", "auto", "compile")


def _steps(text: str) -> list[str]:
    names = [s for s in text.split(",") if s]
    bad = [s for s in names if s not in STEPS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(STEPS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m rwkvx_cli.tools.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="tiny sizes (the test suite's CPU run)")
    p.add_argument("--out", default="bench", help="folder for gpu.json and gpu.md")
    p.add_argument("--ops", default="", help="comma-separated ops to gradcheck (default: all)")
    p.add_argument("--steps", type=_steps, default=",".join(STEPS), help="comma-separated steps to run")
    p.add_argument("--force", action="store_true", help="replace gpu.json and gpu.md in --out if they exist")
    p.add_argument("--fla-wheels", default=os.environ.get("FLA_WHEELS"), help="local folder of fla wheels")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--op", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "gradcheck":
        return _worker_gradcheck(args.op, args.device, args.json)
    if args.worker == "compile":
        return _worker_compile(args.device, args.json, args.quick)
    out = Path(args.out)
    for name in ("gpu.json", "gpu.md"):
        check_output(out / name, args.force, "--out")  # before minutes of checks

    from rwkvx_cli.ops import op_names
    from rwkvx_cli.runs.runtime import resolve_device

    resolve_device(args.device, setting="--device")  # cuda without a GPU: one line here, not a failure in each step

    start = time.perf_counter()
    ops = [o for o in args.ops.split(",") if o] or op_names()
    steps = []
    for name in args.steps:
        if name == "gradcheck":
            steps.append(step_gradcheck(args.device, ops, args))
        elif name == "bench":
            steps.append(step_bench(args.device, args.quick, args.fla_wheels))
        elif name == "fused":
            steps.append(step_fused(args.device, args.quick))
        elif name == "model":
            steps.append(step_model(args.device, args.quick))
        elif name == "train":
            steps.append(step_train(args.device, args.quick))
        elif name == "auto":
            steps.append(step_auto(args.device))
        elif name == "compile":
            steps.append(step_compile(args.device, args.quick))
    report = {
        "environment": environment(args.device),
        "quick": args.quick,
        "passed": all(s.status != "FAIL" for s in steps),
        "failed": [s.name for s in steps if s.status == "FAIL"],
        "seconds": time.perf_counter() - start,
        "steps": [asdict(s) for s in steps],
    }
    write_output(out / "gpu.json", json.dumps(report, indent=2) + "\n", force=args.force, flag="--out")
    write_output(out / "gpu.md", markdown(report), force=args.force, flag="--out")
    sys.stdout.write(markdown(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    run_main(main)
