"""A JSON file nested past Python's stack (json recurses per level) is a damaged file: one line, never a
RecursionError's traceback, wherever rwkvx reads JSON."""

import struct

import pytest

from rwkvx_cli.checkpoints.store import read_meta
from rwkvx_cli.config import load_config
from rwkvx_cli.data import DataError, load_tokenizer
from rwkvx_cli.data.prepare import _load_state, _prepared_here, read_prepared_meta
from rwkvx_cli.errors import CheckpointError
from rwkvx_cli.formats.errors import FormatError
from rwkvx_cli.formats.hf import read_hf_config
from rwkvx_cli.formats.tensors import hf_shards, read_safetensors_header
from rwkvx_cli.runs.data import check_prepared_as_asked
from rwkvx_cli.runs.tokenizers import dir_tokenizer
from rwkvx_cli.train.metrics import MetricsLog

DEEP = "[" * 100_000 + "]" * 100_000


def test_deeply_nested_json_files_are_refused_in_one_line(tmp_path):
    (tmp_path / "meta.json").write_text(DEEP)
    (tmp_path / "tokenizer.json").write_text(DEEP)
    (tmp_path / "config.json").write_text(DEEP)
    (tmp_path / "model.safetensors.index.json").write_text(DEEP)
    (tmp_path / "state.json").write_text(DEEP)
    body = DEEP.encode()
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(DataError, match="nested too deeply"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="is not valid JSON"):
        read_prepared_meta(tmp_path)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        read_meta(tmp_path)
    with pytest.raises(FormatError, match="nested too deeply"):
        read_hf_config(tmp_path)
    with pytest.raises(FormatError, match="not a safetensors index"):
        hf_shards(tmp_path)
    with pytest.raises(FormatError, match="header is not JSON"):
        read_safetensors_header(tmp_path / "w.safetensors")
    assert _load_state(tmp_path, {}) is None  # nothing to resume: a fresh prepare
    assert not _prepared_here(tmp_path)
    check_prepared_as_asked(load_config(None, []), tmp_path)  # unreadable: open_data says why
    with pytest.raises(DataError, match="nested too deeply"):
        dir_tokenizer(tmp_path)  # meta.json unreadable: the tokenizer's own error
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n' + DEEP + "\n")
    MetricsLog(tmp_path / "metrics.jsonl").truncate(5)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
