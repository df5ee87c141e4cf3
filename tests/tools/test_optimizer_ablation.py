"""The optimizer ablation's report (docs/training.md#muon-and-wsd-measured): which rate is best, the
baseline's target, the tokens each recipe needs to reach it, and the kept copies of finished runs that
the repository holds (bench/ablation), on runs written here with known curves."""

import json

import pytest
import yaml

from rwkvx_cli.errors import UsageError
from rwkvx_cli.tools import optimizer_ablation as ab

TOKENS = 1000  # each fake run's budget; it validates every 250 tokens


def fake_run(work, size, recipe, lr, seed, losses, at=None, tokens=TOKENS):
    """A run directory as `rwkvx train` leaves it, holding what `report` reads: its config and a
    validation loss at each of `losses`' evaluations (250 tokens apart)."""
    optimizer, schedule = recipe.split("+")
    run = work / size / ab.run_name(recipe, lr, seed, at)
    run.mkdir(parents=True)
    train = {"tokens": tokens, "ctx_len": 10, "micro_batch": 2, "grad_accum": 1, "optimizer": optimizer,
             "lr_schedule": schedule, "lr": lr, "seed": seed}
    (run / "config.yaml").write_text(yaml.safe_dump({"run_dir": str(run), "train": train}))
    rows = [{"step": i, "tokens": 250 * (i + 1), "loss": v + 0.1, "val_loss": v} for i, v in enumerate(losses)]
    rows.insert(1, {"step": 0, "tokens": 260, "loss": 9.0, "val_loss": None})  # a training row, no evaluation
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "weights.safetensors").write_bytes(b"not kept")
    return run


def sweep(work):
    """The baseline at two rates and two seeds at its best, Muon at two rates, and an unfinished run."""
    fake_run(work, "L4-D128", "adamw+cosine", 1e-3, 0, [5.0, 4.5, 4.2, 4.0])
    fake_run(work, "L4-D128", "adamw+cosine", 2e-3, 0, [5.0, 4.4, 4.0, 3.8])
    fake_run(work, "L4-D128", "adamw+cosine", 2e-3, 1, [5.0, 4.5, 4.1, 3.9])  # target: (3.8 + 3.9) / 2
    fake_run(work, "L4-D128", "muon+cosine", 2e-3, 0, [5.0, 4.0, 3.5, 3.4])
    fake_run(work, "L4-D128", "muon+cosine", 4e-3, 0, [5.0, 4.2, 3.85, 3.6])
    fake_run(work, "L4-D128", "muon+cosine", 8e-3, 0, [5.0, 4.6])  # stopped halfway: not reported


def test_tokens_to_reach_reads_the_curve_linearly_between_evaluations():
    curve = [(250, 5.0), (500, 4.0), (750, 3.5)]
    assert ab.tokens_to_reach(curve, 4.5) == pytest.approx(375)
    assert ab.tokens_to_reach(curve, 3.5) == pytest.approx(750)
    assert ab.tokens_to_reach(curve, 3.4) is None
    assert ab.tokens_to_reach(curve, 6.0) == 250  # the first evaluation is already there
    assert ab.tokens_to_reach([(250, 4.0), (500, 5.0), (750, 3.0)], 4.5) == 250  # first, not best


def test_the_report_picks_the_best_rate_and_the_baselines_mean_target(tmp_path):
    sweep(tmp_path)
    runs = ab.read_runs(tmp_path)
    assert sorted(r["run"] for r in runs) == sorted(
        ["adamw+cosine-lr0.001-s0", "adamw+cosine-lr0.002-s0", "adamw+cosine-lr0.002-s1",
         "muon+cosine-lr0.002-s0", "muon+cosine-lr0.004-s0"])
    report = ab.summarise(runs)["L4-D128"]
    assert report["target"] == pytest.approx(3.85) and report["budget"] == TOKENS
    base, muon = report["recipes"]["adamw+cosine"], report["recipes"]["muon+cosine"]
    assert base["sweep"] == {1e-3: 4.0, 2e-3: 3.8} and base["best_lr"] == 2e-3
    assert sorted(r["seed"] for r in base["seeds"]) == [0, 1]
    # seed 0 crosses 3.85 between 750 (4.0) and 1000 (3.8); seed 1 ends at 3.9, above it
    assert sorted(base["ratio"], key=lambda x: x is None) == [pytest.approx(0.9375), None]
    assert muon["best_lr"] == 2e-3 and muon["ratio"] == [pytest.approx((500 + 250 * 0.15 / 0.5) / TOKENS)]
    lines = ab.table(ab.summarise(runs))
    assert any("muon+cosine" in line and f"{muon['ratio'][0]:.2f}x" in line for line in lines), lines


def test_kept_runs_report_what_the_runs_did_and_keeping_twice_copies_nothing(tmp_path):
    work, kept = tmp_path / "work", tmp_path / "kept"
    sweep(work)
    assert ab.main(["keep", str(work), str(kept)]) == 0
    copied = sorted(p.relative_to(kept).as_posix() for p in kept.rglob("*") if p.is_file())
    assert copied == sorted([ab.MARKER] + [f"L4-D128/{r['run']}/{f}" for r in ab.read_runs(work) for f in ab.KEPT])
    assert ab.keep_runs(work, kept) == []
    assert ab.summarise(ab.read_all([kept])) == ab.summarise(ab.read_runs(work))
    # a later run joins the kept ones in one report; the runs found in both count once
    fake_run(work, "L4-D128", "muon+wsd", 2e-3, 0, [5.0, 3.9, 3.3, 3.2])
    both = ab.summarise(ab.read_all([kept, work]))["L4-D128"]["recipes"]
    assert len(both["adamw+cosine"]["seeds"]) == 2 and both["muon+wsd"]["sweep"] == {2e-3: 3.2}
    assert ab.keep_runs(work, kept) == ["L4-D128/muon+wsd-lr0.002-s0"]


def test_a_run_kept_with_another_curve_is_refused_and_left_as_it_was(tmp_path):
    work, kept = tmp_path / "work", tmp_path / "kept"
    fake_run(kept, "L4-D128", "adamw+cosine", 2e-3, 0, [5.0, 4.4, 4.0, 3.8])
    fake_run(work, "L4-D128", "adamw+cosine", 2e-3, 0, [5.0, 4.4, 4.0, 3.7])
    before = {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    with pytest.raises(UsageError, match="already holds another adamw"):
        ab.keep_runs(work, kept)
    with pytest.raises(UsageError, match="differs between"):
        ab.read_all([kept, work])
    assert {p: p.read_bytes() for p in kept.rglob("*") if p.is_file()} == before


def test_keep_never_writes_through_a_link_planted_in_its_directory(tmp_path):
    work, kept, elsewhere = tmp_path / "work", tmp_path / "kept", tmp_path / "elsewhere"
    fake_run(work, "L4-D128", "adamw+cosine", 2e-3, 0, [5.0, 4.4, 4.0, 3.8])
    elsewhere.mkdir()
    kept.mkdir()
    (kept / "L4-D128").symlink_to(elsewhere)
    with pytest.raises(UsageError, match="is a symbolic link"):
        ab.keep_runs(work, kept)
    assert list(elsewhere.iterdir()) == []
