"""The document-boundary ablation's tools: the short-document corpus (tools/short_documents.py) and
the position of each token in its document (evaluation/reset_ablation.py)."""

import json
import os

import numpy as np
import pytest

from rwkvx_cli.entry import run_main
from rwkvx_cli.evaluation import reset_ablation
from rwkvx_cli.evaluation.reset_ablation import DOC_BUCKETS, document_positions
from rwkvx_cli.tools.short_documents import main, paragraphs, short_documents


def _exit(main, argv) -> int:
    """`python -m`'s way out (entry.run_main), in this process: the exit code."""
    with pytest.raises(SystemExit) as e:
        run_main(main, argv)
    return e.value.code


def test_paragraphs_become_shuffled_documents_the_same_for_a_seed(tmp_path):
    text = "A:\none\n\n\nB:\ntwo\nlines\n\n  \nC:\nthree\n"
    assert paragraphs(text) == ["A:\none", "B:\ntwo\nlines", "C:\nthree"]
    docs = short_documents(text * 20, seed=3)
    assert sorted(docs) == sorted(paragraphs(text * 20)) and docs != paragraphs(text * 20)
    src, out = tmp_path / "t.txt", tmp_path / "d.jsonl"
    src.write_text(text * 20)
    main([str(src), "--out", str(out), "--seed", "3"])
    first = out.read_bytes()
    assert [json.loads(line)["text"] for line in first.decode().splitlines()] == docs
    main([str(src), "--out", str(out), "--seed", "3", "--force"])
    assert out.read_bytes() == first


def test_short_documents_replaces_an_output_only_with_force_and_never_through_a_link(tmp_path, capsys):
    src, mine = tmp_path / "t.txt", tmp_path / "mine.txt"
    src.write_text("A:\none\n\nB:\ntwo\n")
    mine.write_bytes(b"the user's\n")
    out = tmp_path / "d.jsonl"
    os.symlink(mine, out)
    assert _exit(main, [str(src), "--out", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err and out.is_symlink()
    assert _exit(main, [str(src), "--out", str(out), "--force"]) == 0
    assert not out.is_symlink() and len(out.read_text().splitlines()) == 2  # the link replaced, not followed
    assert mine.read_bytes() == b"the user's\n"


def _result(run: str, trained_reset: bool, loss: float) -> dict:
    """One run's figures as --json writes them (evaluate_run's keys)."""
    buckets = [{"lo": lo, "hi": 2 * lo, "tokens": 10, "loss": loss + 0.1 * i} for i, lo in enumerate((32, 64, 128))]
    figures = {
        "loss": loss, "by_document_position": [loss + 0.01 * i for i in range(len(DOC_BUCKETS))],
        "whole_read_loss": loss - 0.1, "cut_share": 0.3, "cut_loss": loss + 0.2, "cut_whole_read_loss": loss,
        "by_stream_position": buckets, "stream_len": 256, "step": 10,
    }
    reset = {**figures, "loss": loss + 0.05}
    return {"run": run, "trained_reset": trained_reset, "eval_carry": figures, "eval_reset": reset}


def test_reset_ablation_redraws_from_its_json_and_replaces_outputs_only_with_force(tmp_path, capsys):
    results = [_result("a", False, 1.5), _result("b", False, 1.6), _result("c", True, 1.4)]
    src, png, again = tmp_path / "in.json", tmp_path / "p.png", tmp_path / "again.json"
    src.write_text(json.dumps(results))
    assert _exit(reset_ablation.main, ["--from-json", str(src), "--png", str(png), "--json", str(again)]) == 0
    table = capsys.readouterr().out
    assert "| carried | carried | 2 | 1.5500 ± 0.0707 |" in table and f"wrote {png}" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and json.loads(again.read_text()) == results
    png.write_bytes(b"the user's")
    assert _exit(reset_ablation.main, ["--from-json", str(src), "--png", str(png)]) == 2
    assert "--png" in capsys.readouterr().err and png.read_bytes() == b"the user's"
    assert _exit(reset_ablation.main, ["--from-json", str(src), "--png", str(png), "--force"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_document_positions_count_from_the_token_after_each_end_of_document():
    eod = 0
    tokens = np.array([5, 6, 0, 7, 0, 0, 8, 9, 9])
    assert document_positions(tokens, eod).tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2]
