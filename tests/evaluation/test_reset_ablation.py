"""The document-boundary ablation's tools: the short-document corpus (tools/short_documents.py) and
the position of each token in its document (evaluation/reset_ablation.py)."""

import json

import numpy as np

from rwkvx_cli.evaluation.reset_ablation import document_positions
from rwkvx_cli.tools.short_documents import main, paragraphs, short_documents


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
    main([str(src), "--out", str(out), "--seed", "3"])
    assert out.read_bytes() == first


def test_document_positions_count_from_the_token_after_each_end_of_document():
    eod = 0
    tokens = np.array([5, 6, 0, 7, 0, 0, 8, 9, 9])
    assert document_positions(tokens, eod).tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2]
