"""`rwkvx explain` end to end on a tiny trained run: table, JSON and HTML; refusals are one line."""

import json

from tests.train.helpers import run_cli, tiny_args


def _corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 200)
    return corpus


def test_explain_writes_table_json_and_html(tmp_path):
    run = tmp_path / "run"
    r = run_cli("train", *tiny_args(run, _corpus(tmp_path), "train.tokens=256"))
    assert r.returncode == 0, r.stderr
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    r = run_cli(
        "explain", "--checkpoint", str(run), "--text", "the cat", "--json", str(out_json), "--html", str(out_html)
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(out_json.read_text())
    tokens = data["tokens"]
    assert len(tokens) == len("the cat")  # byte tokenizer: one token per character
    assert len(data["relevance"]) == len(tokens)
    html = out_html.read_text()
    assert "<html" in html.lower()
    assert html.count('<span style="background:') >= len(tokens)  # every token coloured


def test_explain_refuses_unsupported_block_kinds_in_one_line(tmp_path):
    run = tmp_path / "run"
    r = run_cli("init", *tiny_args(run, _corpus(tmp_path), "model.layers=gdn*2"))
    assert r.returncode == 0, r.stderr
    r = run_cli("explain", "--checkpoint", str(run), "--text", "the cat")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "gdn" in r.stderr
