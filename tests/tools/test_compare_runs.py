"""tools/compare_runs.py: the table and picture of docs/model.md's ablation, from run directories as `rwkvx
train` writes them (config.yaml, metrics.jsonl)."""

import json

import pytest
import yaml

from rwkvx_cli.tools.compare_runs import compare, main, summary


def fake_run(path, gain, width, finals, losses):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"model": {"ffn_key_gain": gain, "n_embd": width}}))
    rows = [{"step": i + 1, "tokens": 1000 * (i + 1), "loss": loss, "val_bpb": None} for i, loss in enumerate(losses)]
    for i, v in enumerate(finals):
        rows[(i + 1) * len(rows) // len(finals) - 1]["val_bpb"] = v
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_groups_by_a_setting_per_panel_with_mean_and_spread(tmp_path, capsys):
    runs = [
        fake_run(tmp_path / "a", 1.0, 128, [3.0, 2.5], [2.0] * 60 + [1.0] * 50),
        fake_run(tmp_path / "b", 1.0, 128, [3.0, 2.7], [1.5] * 110),
        fake_run(tmp_path / "c", 2.0, 128, [2.9, 2.4], [1.2] * 110),
        fake_run(tmp_path / "d", 2.0, 256, [2.8, 2.2], [1.1] * 110),
    ]
    groups = compare(runs, "model.ffn_key_gain", "model.n_embd")
    assert sorted(groups) == [128, 256] and sorted(groups[128]) == [1.0, 2.0]
    rows = summary(groups, "model.ffn_key_gain", "model.n_embd")
    assert rows[2] == "| 128 | 1.0 | 2 | 2.5000, 2.7000 | 2.6000 ± 0.1414 | 1.2500 |"  # last 50 steps: 1.0 and 1.5
    assert rows[3].startswith("| 128 | 2.0 | 1 | 2.4000 | 2.4000 ± 0.0000 |")
    args = ["--by", "model.ffn_key_gain", "--panel", "model.n_embd", "--png", str(tmp_path / "p.png")]
    assert main([*map(str, runs), *args]) == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2.6000 ± 0.1414" in capsys.readouterr().out


def test_a_run_without_a_validation_result_is_named(tmp_path):
    run = fake_run(tmp_path / "x", 1.0, 128, [], [1.0] * 5)
    with pytest.raises(ValueError, match="holds no validation result"):
        compare([run], "model.ffn_key_gain", None)


def test_a_path_that_is_no_run_is_one_line(tmp_path, capsys):
    (tmp_path / "a.log").write_text("x")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "a.log"), "--by", "model.ffn_key_gain"])
    assert e.value.code == 2 and "is not a run directory" in capsys.readouterr().err
