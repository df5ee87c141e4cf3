"""The optimizer and schedule ablation (docs/training.md#muon-and-wsd-measured): AdamW + cosine (RWKV-LM's
recipe, the baseline), Muon + cosine, AdamW + WSD and Muon + WSD, each over a learning-rate sweep, then a
second seed at each recipe's best rate, at the sizes of SIZES, on the CPython standard library's sources.

    python -m rwkvx_cli.tools.optimizer_ablation corpus runs/ablation/stdlib.jsonl
    python -m rwkvx_cli.tools.optimizer_ablation run runs/ablation --size L4-D128 --tokens 3000000 \\
        --lrs 1e-3,2e-3,4e-3 [--recipes adamw+cosine,muon+cosine,...] [--seeds 0,1] [--branches 0.5]
    python -m rwkvx_cli.tools.optimizer_ablation keep runs/ablation bench/ablation
    python -m rwkvx_cli.tools.optimizer_ablation report bench/ablation [runs/ablation ...] \\
        [--png PATH] [--json PATH] [--force]

`corpus` writes one JSONL document per `.py` file of this Python's standard library (sorted by path,
site-packages left out): about 31 MB of code that ships with every Python, nothing downloaded. Every
run trains configs/ablation.yaml (which prepares it once, with a BPE of 4,096 ids trained on it, into
runs/ablation/data; every seed validates on the held-out documents of split seed 0) at one size, recipe, rate
and seed, in `WORKDIR/<size>/<recipe>-lr<rate>-s<seed>`,
through `rwkvx train ... --resume`: a run already finished is not trained again, an interrupted one
continues. The rate also sets lr_final (a twentieth of it); the warmup is 5% of the tokens. With
`--branches 0.5` each WSD run also branches a decay (`train.decay_from`) from its checkpoint
at that fraction of the tokens, which gives the recipe's annealed loss at a shorter run for a fifth of
that run's tokens; those runs are `<recipe>-lr<rate>-s<seed>-at<fraction>`.

`keep` copies what `report` reads of each finished run (its config.yaml and metrics.jsonl, a few
kB; no checkpoint) to OUT/<size>/<run>: the repository keeps them in bench/ablation, so the tables
in the docs can be reported again, and a later sweep added to them, without the runs.

`report` reads every finished run under each WORKDIR (a run found in two of them must hold the same
curve): per size, each recipe's final validation loss per rate, its
best rate (seed 0), the seeds at the best rate, and the tokens it needs to reach the baseline's final
validation loss (the mean over the baseline's seeds): where its validation curve first reaches it
(linear between evaluations; a run's curve before its decay is not annealed, so this overstates what
a run planned that short would need), and for WSD the annealed losses of its branches. The picture:
validation loss against tokens, one panel per size, each recipe at its best rate.
"""

from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

import yaml

from rwkvx_cli.entry import ArgumentParser, at_least, run_main
from rwkvx_cli.errors import RwkvxError, UsageError
from rwkvx_cli.fsio import check_output, check_writable_dir, claim_dir, open_append, write_output

PROG = "python -m rwkvx_cli.tools.optimizer_ablation"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ablation.yaml"
SIZES = {"L4-D128": (4, 128), "L6-D256": (6, 256), "L8-D384": (8, 384), "L8-D512": (8, 512)}
RECIPES = ("adamw+cosine", "muon+cosine", "adamw+wsd", "muon+wsd")
BASELINE = "adamw+cosine"
TOKENS_PER_STEP = 512 * 8 * 4  # configs/ablation.yaml's ctx_len x micro_batch x grad_accum
MARKER = ".rwkvx-ablation"  # a workdir rwkvx made: it writes runs and commands.txt only into one


# -- the corpus ---------------------------------------------------------------------------------------
def stdlib_sources(root: Path | None = None) -> list[Path]:
    """Every `.py` file of the standard library, sorted, without site-packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file())


def write_corpus(out: Path, force: bool, root: Path | None = None) -> dict:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    lines, total = [], 0
    for path in stdlib_sources(root):
        text = path.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            lines.append(json.dumps({"text": text}, ensure_ascii=False))
            total += len(text.encode("utf-8"))
    if not lines:
        raise UsageError(f"no Python sources under {root}")
    write_output(out, "\n".join(lines) + "\n", force=force)
    python = sys.version.split()[0]
    return {"out": str(out), "documents": len(lines), "bytes": total, "root": str(root), "python": python}


# -- the runs -----------------------------------------------------------------------------------------
def run_name(recipe: str, lr: float, seed: int, at: float | None = None) -> str:
    return f"{recipe}-lr{lr:g}-s{seed}" + (f"-at{at:g}" if at is not None else "")


def overrides(size: str, recipe: str, lr: float, seed: int, tokens: int, run_dir: Path) -> list[str]:
    layers, embd = SIZES[size]
    optimizer, schedule = recipe.split("+")
    return [
        f"run_dir={run_dir}",
        f"model.n_layer={layers}",
        f"model.n_embd={embd}",
        f"train.optimizer={optimizer}",
        f"train.lr_schedule={schedule}",
        f"train.lr={lr:g}",
        f"train.lr_final={lr / 20:g}",
        f"train.warmup_tokens={tokens // 20}",
        f"train.tokens={tokens}",
        f"train.ckpt_interval={max(tokens // TOKENS_PER_STEP // 10, 1)}",  # the decays branch from these
        f"train.seed={seed}",
        "data.split_seed=0",  # every seed validates on the same held-out documents
    ]


def _train(args: list[str], log) -> None:
    command = [sys.executable, "-m", "rwkvx_cli", "train", "-c", str(CONFIG), *args, "--resume"]
    print(" ".join(command[2:]), file=log, flush=True)
    # the trainer's progress lines reach the terminal (a run takes minutes to hours); its error is kept
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RwkvxError(f"a run failed ({' '.join(args[:1])}): {tail}")


def run_plan(work: Path, size: str, tokens: int, lrs, recipes, seeds, branches) -> list[str]:
    """Train what the plan asks for and is not finished yet; returns the run names, in order."""
    names = []
    with open_append(work / "commands.txt") as log:
        for seed in seeds:
            for recipe in recipes:
                for lr in lrs:
                    run = work / size / run_name(recipe, lr, seed)
                    names.append(run.name)
                    print(f"[{size}] {run.name} ...", file=sys.stderr, flush=True)
                    _train(overrides(size, recipe, lr, seed, tokens, run), log)
                    for at in branches if recipe.endswith("+wsd") else ():
                        step = _step_at(run, at)
                        branch = work / size / run_name(recipe, lr, seed, at)
                        base = overrides(size, recipe, lr, seed, tokens, branch)
                        decay = f"train.decay_tokens={int(at * tokens) // 4}"  # a fifth of the branch's length
                        source = run / "checkpoints" / f"step_{step:08d}"
                        _train([*base, decay, f"train.decay_from={source}"], log)
                        names.append(branch.name)
    return names


def _step_at(run: Path, fraction: float) -> int:
    """The step of the run's checkpoint nearest `fraction` of its steps (each run checkpoints every
    tenth of its steps and keeps them all)."""
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*") if p.name[5:].isdigit())
    if not steps:
        raise RwkvxError(f"{run} has no checkpoints to branch from")
    want = fraction * steps[-1]
    return min(steps, key=lambda s: abs(s - want))


# -- the report ---------------------------------------------------------------------------------------
def read_runs(work: Path) -> list[dict]:
    found = []
    for config in sorted(work.glob("*/*/config.yaml")):
        run = config.parent
        metrics = run / "metrics.jsonl"
        if not metrics.is_file():
            continue
        cfg = yaml.safe_load(config.read_text())
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        val = [(r["tokens"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        t = cfg["train"]
        if not val or val[-1][0] < t["tokens"] - t["ctx_len"] * t["micro_batch"] * t["grad_accum"]:
            continue  # not finished
        found.append({
            "run": run.name,
            "size": run.parent.name,
            "recipe": f"{t['optimizer']}+{t['lr_schedule']}",
            "lr": t["lr"],
            "seed": t["seed"],
            "branch": "-at" in run.name,
            "tokens": t["tokens"],
            "val": val,
            "final": val[-1][1],
        })
    return found


def read_all(workdirs: list[Path]) -> list[dict]:
    """The finished runs of every workdir; a run (size and name) found twice counts once, and only
    where both hold the same curve."""
    found: dict[tuple[str, str], tuple[dict, Path]] = {}
    for work in workdirs:
        for run in read_runs(work):
            key = (run["size"], run["run"])
            if key in found:
                if found[key][0]["val"] != run["val"]:
                    raise UsageError(f"{run['size']}/{run['run']} differs between {found[key][1]} and {work}")
                continue
            found[key] = (run, work)
    return [run for run, _ in found.values()]


KEPT = ("config.yaml", "metrics.jsonl")


def keep_runs(work: Path, out: Path) -> list[str]:
    """Copy KEPT of every finished run under `work` to out/<size>/<run>; returns what it copied
    ("size/run"), leaving out the runs `out` already holds with the same files. Refused before
    anything is written (`out` is claimed only then): a `work` without finished runs, a run that `out`
    holds with other files (nothing is replaced), a symbolic link at out/<size> or out/<size>/<run>."""
    runs = read_runs(work)
    if not runs:
        raise UsageError(f"{work} holds no finished ablation run (<size>/<run>/metrics.jsonl)")
    todo = []
    for run in runs:
        src, dst = work / run["size"] / run["run"], out / run["size"] / run["run"]
        for d in (dst.parent, dst):  # a planted link would take the copies somewhere else
            if d.is_symlink():
                raise UsageError(f"{d} is a symbolic link; keep writes only into directories it makes")
        same = [(dst / f).is_file() and (dst / f).read_bytes() == (src / f).read_bytes() for f in KEPT]
        if all(same):
            continue
        if any((dst / f).exists() for f in KEPT):
            raise UsageError(f"{dst} already holds another {run['run']}; remove it to keep this one")
        todo.append((src, dst))
    claim_dir(out, MARKER)
    for src, dst in todo:
        for f in KEPT:
            write_output(dst / f, (src / f).read_bytes(), flag="keep")
    return [f"{dst.parent.name}/{dst.name}" for _, dst in todo]


def tokens_to_reach(val: list[tuple[int, float]], target: float) -> float | None:
    """The tokens where the curve first reaches `target`, linear between evaluations (None: never)."""
    if val and val[0][1] <= target:
        return val[0][0]  # already there at the first evaluation (nothing before it to read)
    for (t0, v0), (t1, v1) in zip(val, val[1:], strict=False):
        if v1 <= target:
            return t0 + (t1 - t0) * (v0 - target) / (v0 - v1)  # v0 > target >= v1
    return None


def summarise(runs: list[dict]) -> dict:
    """Per size: each recipe's finals per rate (seed 0), its best rate, the seeds there, and the tokens
    it needs to reach the baseline's final loss."""
    report = {}
    for size in sorted({r["size"] for r in runs}, key=lambda s: list(SIZES).index(s) if s in SIZES else 99):
        mine = [r for r in runs if r["size"] == size]
        rows = {}
        for recipe in RECIPES:
            sweep = {r["lr"]: r["final"] for r in mine if r["recipe"] == recipe and r["seed"] == 0 and not r["branch"]}
            if not sweep:
                continue
            best = min(sweep, key=sweep.get)
            seeds = [r for r in mine if r["recipe"] == recipe and r["lr"] == best and not r["branch"]]
            branches = [r for r in mine if r["recipe"] == recipe and r["lr"] == best and r["branch"]]
            rows[recipe] = {"sweep": sweep, "best_lr": best, "seeds": seeds, "branches": branches}
        if BASELINE in rows:
            target = statistics.fmean(r["final"] for r in rows[BASELINE]["seeds"])
            budget = rows[BASELINE]["seeds"][0]["tokens"]
            for row in rows.values():
                reach = [tokens_to_reach(r["val"], target) for r in row["seeds"]]
                row["reach"] = reach
                row["ratio"] = [None if x is None else x / budget for x in reach]
                row["branch_points"] = sorted((r["tokens"], r["final"]) for r in row["branches"])
            report[size] = {"target": target, "budget": budget, "recipes": rows}
        else:
            report[size] = {"target": None, "budget": None, "recipes": rows}
    return report


def table(report: dict) -> list[str]:
    cols = ("size", "recipe", "final val loss by lr (seed 0)", "best lr", "final at best (seeds)")
    cols += ("tokens to baseline's final",)
    lines = ["| " + " | ".join(cols) + " |", "|---|---|---|---|---|---|"]
    for size, s in report.items():
        for recipe, row in s["recipes"].items():
            sweep = ", ".join(f"{lr:g}: {v:.4f}" for lr, v in sorted(row["sweep"].items()))
            finals = ", ".join(f"{r['final']:.4f}" for r in row["seeds"])
            ratio = row.get("ratio") or []
            reach = ", ".join("not reached" if x is None else f"{x:.2f}x" for x in ratio) or "–"
            if row.get("branch_points"):
                reach += "; decays: " + ", ".join(f"{t / 1e6:.2f}M: {v:.4f}" for t, v in row["branch_points"])
            lines.append(f"| {size} | {recipe} | {sweep} | {row['best_lr']:g} | {finals} | {reach} |")
    return lines


def plot(report: dict, runs: list[dict], path: Path, force: bool) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(report)
    fig, axes = plt.subplots(1, len(sizes), figsize=(max(6.5, 5.5 * len(sizes)), 4.6), squeeze=False)
    colours = dict(zip(RECIPES, ("black", "tab:red", "tab:gray", "tab:orange"), strict=True))
    for ax, size in zip(axes[0], sizes, strict=True):
        s = report[size]
        for recipe, row in s["recipes"].items():
            for i, r in enumerate(row["seeds"]):
                tokens, loss = zip(*r["val"], strict=True)
                style = "--" if recipe.endswith("wsd") else "-"
                label = f"{recipe} (lr {row['best_lr']:g})" if i == 0 else None
                ax.plot([t / 1e6 for t in tokens], loss, style, color=colours[recipe], lw=1.2, alpha=0.85, label=label)
            for t, v in row.get("branch_points", []):
                ax.plot(t / 1e6, v, "o", color=colours[recipe], ms=5)
        if s["target"] is not None:
            ax.axhline(s["target"], color="black", lw=0.6, ls=":", label="baseline's final")
            lowest = min((r["final"] for row in s["recipes"].values() for r in row["seeds"]), default=s["target"])
            ax.set_ylim(min(s["target"] - 0.25, lowest - 0.05), s["target"] + 0.6)
        ax.set_title(size, fontsize=10)
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("validation loss (nats per token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Muon and WSD against RWKV-LM's AdamW + cosine\n(best rate of each; dots: WSD decays)", fontsize=10)
    fig.tight_layout()
    try:
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=100, format="png")
        return write_output(path, buffer.getvalue(), force=force, flag="--png")
    finally:
        plt.close(fig)


# -- the command line ---------------------------------------------------------------------------------
def _fractions(text: str, flag: str) -> list[float]:
    """A comma-separated list of numbers between 0 and 1 (learning rates, or fractions of a run)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: {text!r} is not a comma-separated list of numbers") from None
    if not values or not all(0 < v < 1 for v in values):
        raise UsageError(f"{flag}: {text!r}: give numbers between 0 and 1")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("corpus", help="write the standard library's sources as JSONL")
    c.add_argument("out", type=Path)
    c.add_argument("--force", action="store_true", help="replace OUT if it exists")
    r = sub.add_parser("run", help="train the runs of a plan that are not finished")
    r.add_argument("workdir", type=Path)
    r.add_argument("--size", required=True, choices=list(SIZES))
    r.add_argument("--tokens", type=at_least(1), required=True)
    r.add_argument("--lrs", required=True, help="comma-separated learning rates")
    r.add_argument("--recipes", default=",".join(RECIPES))
    r.add_argument("--seeds", default="0")
    r.add_argument("--branches", default="", help="WSD: decays branched at these fractions of the run")
    k = sub.add_parser("keep", help="copy each finished run's config and metrics (no checkpoint) to OUT")
    k.add_argument("workdir", type=Path)
    k.add_argument("out", type=Path)
    p = sub.add_parser("report", help="the table (and picture) of the finished runs")
    p.add_argument("workdir", type=Path, nargs="+")
    p.add_argument("--png", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--force", action="store_true", help="replace --png / --json if they exist")
    args = ap.parse_args(argv)
    if args.command == "corpus":
        check_output(args.out, args.force)
        done = write_corpus(args.out, args.force)
        mb = done["bytes"] / 1e6
        print(f"wrote {done['out']}: {done['documents']:,} files, {mb:.1f} MB of Python {done['python']}")
        return 0
    if args.command == "run":
        recipes = [x for x in args.recipes.split(",") if x]
        for recipe in recipes:
            if recipe not in RECIPES:
                ap.error(f"--recipes: {recipe!r} is not one of {', '.join(RECIPES)}")
        try:
            seeds = [int(x) for x in args.seeds.split(",") if x]
        except ValueError:
            ap.error(f"--seeds: {args.seeds!r} is not a comma-separated list of whole numbers")
        lrs = _fractions(args.lrs, "--lrs")
        branches = _fractions(args.branches, "--branches") if args.branches else []
        check_writable_dir(args.workdir, MARKER, what="workdir")
        claim_dir(args.workdir, MARKER)
        run_plan(args.workdir, args.size, args.tokens, lrs, recipes, seeds, branches)
        return 0
    if args.command == "keep":
        if not args.workdir.is_dir():
            raise UsageError(f"{args.workdir} is not a directory")
        check_writable_dir(args.out, MARKER, what="out")
        kept = keep_runs(args.workdir, args.out)  # refuses before anything is written
        print(f"kept {len(kept)} run(s) in {args.out}" + "".join(f"\n  {name}" for name in kept))
        return 0
    for out, flag in ((args.png, "--png"), (args.json, "--json")):
        if out is not None:
            check_output(out, args.force, flag)
    for work in args.workdir:
        if not work.is_dir():
            raise UsageError(f"{work} is not a directory")
    runs = read_all(args.workdir)
    if not runs:
        where = " or ".join(str(w) for w in args.workdir)
        raise UsageError(f"{where} holds no finished ablation run (<size>/<run>/metrics.jsonl)")
    report = summarise(runs)
    print("\n".join(table(report)))
    if args.json is not None:
        write_output(args.json, json.dumps(report, indent=1, default=str) + "\n", force=args.force, flag="--json")
    if args.png is not None:
        print(f"wrote {plot(report, runs, args.png, args.force)}")
    return 0


if __name__ == "__main__":
    run_main(main)
