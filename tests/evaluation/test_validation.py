"""Validation figures (evaluation/validation.py): bits per byte is the loss over exactly the UTF-8 bytes
of the tokens predicted, and not defined where they decode to none."""

import json
import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.config import ModelConfig
from rwkvx_cli.data import ByteTokenizer, write_binidx
from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.evaluation.validation import evaluate, evaluate_documents
from rwkvx_cli.models import build_model
from rwkvx_cli.runs.runtime import Runtime

runner = CliRunner()
CPU = Runtime(torch.device("cpu"), "fp32")


def test_bits_per_byte_is_the_loss_over_the_bytes_and_not_defined_over_none():
    model = build_model(ModelConfig(vocab_size=257, n_layer=1, n_embd=32, head_size=16), 0)
    tok = ByteTokenizer()
    text = np.array([0, *tok.encode("ab"), 0, *tok.encode("cd é")], dtype=np.int64)  # é: two bytes
    ev = evaluate(model, text, 4, 2, 1000, tok, CPU)
    bytes_predicted = len("abcd é".encode())  # the first token is never predicted; the eod is no byte
    assert ev["tokens"] == len(text) - 1
    assert ev["bpb"] == pytest.approx(ev["loss"] * ev["tokens"] / math.log(2) / bytes_predicted, rel=1e-12)
    only_eod = np.zeros(40, dtype=np.int64)
    ev = evaluate(model, only_eod, 4, 2, 1000, tok, CPU)
    assert ev["tokens"] == 39 and math.isfinite(ev["loss"]) and ev["bpb"] is None


@pytest.mark.parametrize("read", ["windows", "documents"])
def test_a_loss_that_is_not_finite_is_one_line_before_any_figure(read):
    """Damaged weights: both ways of reading a split refuse the first batch whose loss is not finite,
    before its progress is reported, naming where."""
    model = build_model(ModelConfig(vocab_size=257, n_layer=1, n_embd=32, head_size=16), 0)
    with torch.no_grad():
        model.head.weight.fill_(float("nan"))
    tok = ByteTokenizer()
    text = np.array([0, *tok.encode("ab"), 0, *tok.encode("cd e"), 0], dtype=np.int64)
    seen = []
    run = evaluate if read == "windows" else evaluate_documents
    with pytest.raises(RwkvxError, match=r"the loss on validation (window 1|documents 1-2) is nan: .* damaged"):
        run(model, text, 4, 2, 1000, tok, CPU, on_progress=lambda *a: seen.append(a[1]))
    assert seen == [0]  # the start, nothing after


def test_eval_of_a_split_of_end_of_document_tokens_says_bits_per_byte_is_not_defined(tmp_path):
    tok = ByteTokenizer()
    docs = [f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60)]
    write_binidx(tmp_path / "train", [np.array([*tok.encode(d), 0], dtype=np.uint16) for d in docs], np.uint16)
    write_binidx(tmp_path / "val", [np.zeros(1, dtype=np.uint16)] * 200, np.uint16)
    run = tmp_path / "run"
    args = [f"run_dir={run}", f"data.binidx={tmp_path / 'train'}", f"data.val_binidx={tmp_path / 'val'}"]
    args += ["model.n_layer=1", "model.n_embd=32", "model.head_size=16", "train.ctx_len=16", "train.micro_batch=2"]
    assert runner.invoke(app, ["init", *args]).exit_code == 0
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["bpb"] is None and figures["tokens"] > 0 and math.isfinite(figures["loss"])
    result = runner.invoke(app, ["eval", "--checkpoint", str(run)])
    assert result.exit_code == 0, result.output
    line = " ".join(result.stdout.split())
    assert "bits/byte not defined (the tokens predicted decode to no bytes)" in line
