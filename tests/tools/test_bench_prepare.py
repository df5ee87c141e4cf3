"""The prepare benchmark runs end to end on a small generated corpus, and its ratios are the per-round medians."""

import json

from rwkvx_cli.tools import bench_prepare


def test_bench_prepare_reports_rounds_and_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--mb", "0.4", "--tokenizers", "byte,world", "--repeat", "2", "--json", str(out), "--dir", str(tmp_path)]
    assert bench_prepare.main(args) == 0
    report = json.loads(out.read_text())
    assert report["corpus"]["bytes"] >= 400_000 and report["machine"]["cores_available"] >= 1
    world = report["tokenizers"]["world"]
    assert world["alone"]["engine"] in ("native", "rust", "python")
    for entry in report["tokenizers"].values():
        assert set(entry["prepare"]) == {"1", "2"}
        for key in ("workers_1_vs_alone", "workers_2_vs_1", "alone_2_at_once_vs_1"):
            rounds = entry["ratios_by_round"][key]
            assert len(rounds) == 2 and round(entry[key], 3) == sorted(rounds)[1]  # the median round (upper of two)
        assert entry["prepare"]["1"]["tokens"] == entry["prepare"]["2"]["tokens"] > 0  # same output either way
        assert len(entry["prepare"]["1"]["runs_text_mb_per_s"]) == 2
    assert "tokenizer alone in 2 processes at once" in capsys.readouterr().out
    assert not list(tmp_path.glob("corpus-*"))  # the corpus is removed unless --keep
