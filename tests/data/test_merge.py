"""`data merge`: shards -> one prepared directory, each document once, in the order the list of shards reads."""

import json
import subprocess
import sys

import numpy as np
import pytest

from rwkvx_cli.data import BinIdx, DataError, open_prepared, prepare
from rwkvx_cli.data.merge import merge_prepared
from rwkvx_cli.data.prepare import read_prepared_meta
from rwkvx_cli.errors import UsageError

from .test_prepare_parallel import _docs, _env, golden_corpus


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    paths = golden_corpus(root / "in")
    dirs = [root / f"s{i}" for i in range(3)]
    for i, d in enumerate(dirs):
        prepare(paths, d, "world", val_fraction=0.1, num_shards=3, shard_index=i, workers=1)
    return dirs


def test_merged_shards_are_the_shards_one_after_another(tmp_path, shards):
    stats = merge_prepared([shards[2], shards[0], shards[1]], tmp_path / "m")  # read by shard index, as training does
    corpus = open_prepared(shards)
    for split in ("train", "val"):
        merged = BinIdx(tmp_path / "m" / split)
        parts = [BinIdx(d / split) for d in corpus.dirs]
        np.testing.assert_array_equal(np.asarray(merged.tokens), np.concatenate([np.asarray(p.tokens) for p in parts]))
        np.testing.assert_array_equal(merged.doc_sizes, np.concatenate([p.doc_sizes for p in parts]))
    assert sorted(_docs(tmp_path / "m")) == sorted(d for s in shards for d in _docs(s))
    meta = read_prepared_meta(tmp_path / "m")  # as training checks it
    metas = [json.loads((d / "meta.json").read_text()) for d in corpus.dirs]
    assert "shard" not in meta and [m["dir"] for m in meta["merged"]] == [str(d.resolve()) for d in corpus.dirs]
    assert meta["documents"] == sum(m["documents"] for m in metas) and meta["val_fraction"] == 0.1
    assert meta["train"]["tokens"] == stats.train_tokens == sum(m["train"]["tokens"] for m in metas)
    assert (tmp_path / "m" / "tokenizer.json").read_bytes() == (shards[0] / "tokenizer.json").read_bytes()
    assert open_prepared(tmp_path / "m").weights == [stats.train_tokens]
    again = merge_prepared(shards, tmp_path / "m")  # a merged directory is rwkvx's: merged again in place
    assert again == stats


def test_merge_refuses_what_is_not_one_corpus(tmp_path, shards):
    with pytest.raises(DataError, match=r"shard 1 of 3 is missing"):
        merge_prepared([shards[0], shards[2]], tmp_path / "m")
    assert not (tmp_path / "m").exists()  # refused before anything is written
    with pytest.raises(UsageError, match="is one of the directories to merge"):
        merge_prepared(shards, shards[1])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="notes.txt"):
        merge_prepared(shards, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cli_merge(tmp_path, shards):
    base = [sys.executable, "-m", "rwkvx_cli", "data", "merge"]
    ok = subprocess.run([*base, str(shards[0].parent / "s*"), "--out", str(tmp_path / "m")], env=_env(),
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("merged 3 prepared directories into"), ok.stderr
    bad = subprocess.run([*base, str(shards[0]), "--out", str(tmp_path / "x")], env=_env(), capture_output=True,
                         text=True)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: ") and "missing" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_merge_removes_what_a_killed_prepare_or_merge_left(tmp_path, shards):
    dead = subprocess.Popen(["true"])
    dead.wait()
    merge_prepared(shards, tmp_path / "m")
    left = [f".train.bin.tmp{dead.pid}", f".val.idx.tmp{dead.pid}", f".meta.json.tmp{dead.pid}"]
    for name in left:
        (tmp_path / "m" / name).write_bytes(b"x" * 100)  # as kill -9 mid-merge leaves them
    merge_prepared(shards, tmp_path / "m")
    assert not [n for n in left if (tmp_path / "m" / n).exists()]


def test_a_full_disk_names_the_file_and_leaves_the_inputs_intact(tmp_path, shards, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # as copy_file_range says it: no file named

    monkeypatch.setattr("rwkvx_cli.data.merge.copy_range", full)
    out = tmp_path / "m"
    with pytest.raises(Exception) as e:
        merge_prepared(shards, out)
    assert str(e.value) == (
        f"cannot write {out / 'train.bin'}: No space left on device; the directories merged are intact; {out} holds "
        "no finished merge (no meta.json): free space and merge again"
    ) and e.value.exit_code == 1
    assert sorted(p.name for p in out.iterdir()) == [".rwkvx-data"]
    open_prepared(shards)  # intact
