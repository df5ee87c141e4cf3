"""Training on the data RWKV users already have: a bare RWKV-LM binidx prefix with the World tokenizer,
weighted mixtures, one pass per epoch (exact resume mid-epoch and across epochs), and their bad input."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.data import WorldTokenizer, open_tokens, write_binidx
from tests.train.helpers import losses, rollback_to, rows, run_cli, tiny_args

runner = CliRunner()

DOCS = [
    "The quick brown fox jumps over the lazy dog.\n" * 3,
    "def f(x):\r\n    return x * 2  # code\n",
    "中文混合 English 文本, emoji 🙂🚀 and numbers 12345.",
    "Long   runs      of spaces and\ttabs.\n\n\nNew paragraph.",
] * 12


def make_data_binidx(prefix, texts):
    """A prefix laid out as RWKV-LM's make_data.py writes it: World tokens, uint16, a 0 after every document."""
    tok = WorldTokenizer()
    write_binidx(prefix, [np.array([*tok.encode(t), 0], dtype=np.uint16) for t in texts], np.uint16)
    return prefix


def train(*args):
    result = runner.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    return result


def world_args(run_dir, prefix, *extra):
    """A tiny model: vocab 65536 makes the embedding and head the bulk of it."""
    return [
        f"run_dir={run_dir}",
        f"data.binidx={prefix}",
        "data.val_tokens=200",
        "data.tokenizer=world",
        "model.vocab_size=65536",
        "model.n_layer=1",
        "model.n_embd=32",
        "model.head_size=32",
        "train.ctx_len=16",
        "train.micro_batch=2",
        "train.tokens=192",  # 6 steps
        "train.eval_interval=3",
        "train.eval_tokens=64",
        "train.ckpt_interval=3",
        "train.warmup_tokens=32",
        "train.lr=3e-3",
        *extra,
    ]


def test_rwkv_lm_binidx_with_the_world_tokenizer_trains_resumes_exactly_and_evaluates(tmp_path):
    prefix = make_data_binidx(tmp_path / "corpus_text_document", DOCS)
    assert open_tokens(prefix).dtype == np.uint16
    full = tmp_path / "full"
    train(*world_args(full, prefix))
    reference = losses(full)
    assert len(reference) == 6
    source = json.loads((full / "data" / "source.json").read_text())  # the split, stated in the run
    assert source["val"]["tokens"] == 200 and source["train"]["held_out_tokens"] == 200
    assert source["train"]["dtype"] == "uint16" and source["tokenizer"] == "world"
    assert json.loads((full / "tokenizer.json").read_text())["type"] == "world"

    rollback_to(full, 3)
    result = train(*world_args(full, prefix), "--resume")
    assert "resumed from step 3" in result.output
    assert losses(full) == reference

    result = runner.invoke(app, ["eval", "--checkpoint", str(full), "--json", "--generate", "中文", "--tokens", "4"])
    assert result.exit_code == 0, result.output
    ev = json.loads(result.stdout)
    assert ev["step"] == 6 and ev["bpb"] > 0 and ev["tokens"] > 0 and ev["sample"].startswith("中文")


def test_epoch_sampler_resumes_exactly_mid_epoch_and_across_epochs(tmp_path):
    corpus = tmp_path / "small.txt"
    corpus.write_text("".join(f"line {i}: a small corpus, read several times over.\n" for i in range(40)))
    args = ("train.micro_batch=8", "train.tokens=3584", "train.ckpt_interval=5", "train.eval_interval=7")
    full = tmp_path / "full"
    train(*tiny_args(full, corpus, *args))  # 14 steps of 8 windows over ~59 windows: into the second epoch
    reference, epochs = losses(full), [r["epoch"] for r in rows(full)]
    assert len(reference) == 14 and epochs == sorted(epochs) and epochs[0] == 0 and epochs[-1] == 1
    assert epochs[4] == 0 and epochs[9] == 1  # the checkpoint at step 5 is mid-epoch, at step 10 past the boundary
    for step in (10, 5):
        rollback_to(full, step)
        train(*tiny_args(full, corpus, *args), "--resume")
        assert losses(full) == reference and [r["epoch"] for r in rows(full)] == epochs
    # The old sampler is still there, and draws other windows.
    other = tmp_path / "random"
    train(*tiny_args(other, corpus, *args, "train.sampler=random"))
    assert losses(other) != reference


def test_a_weighted_mixture_of_a_prepared_directory_and_a_prefix_trains(tmp_path, corpus):
    prepared = tmp_path / "prepared"
    assert runner.invoke(app, ["data", "prepare", str(corpus), "--out", str(prepared)]).exit_code == 0
    mix = f"data.mix=[{{path: {prepared}, weight: 3}}, {{path: {prepared / 'val'}, weight: 1}}]"
    run = tmp_path / "run"
    train(*tiny_args(run, corpus, "train.tokens=384")[2:], f"run_dir={run}", mix)
    assert len(losses(run)) == 3
    source = json.loads((run / "data" / "source.json").read_text())
    assert [m["weight"] for m in source["mix"]] == [3.0, 1.0] and source["val"]["path"].endswith("val")
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])
    assert result.exit_code == 0, result.output


def bad(tmp_path, *args):
    result = runner.invoke(app, ["train", f"run_dir={tmp_path / 'run'}", *args])
    assert "Traceback" not in result.output and result.exc_info[0] is SystemExit, result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result


@pytest.fixture
def byte_prefix(tmp_path):
    prefix = tmp_path / "bytes"
    write_binidx(prefix, [np.frombuffer(t.encode(), np.uint8).astype(np.uint16) + 1 for t in DOCS], np.uint16)
    return prefix


@pytest.mark.parametrize(
    "extra,code,message",
    [
        (["data.tokenizer=world"], 2, "model.vocab_size: 257 is smaller than the tokenizer's 65536"),
        (["data.tokenizer=wrold"], 2, "'wrold' is not a tokenizer name (byte, world)"),
        (["data.val_tokens=0"], 2, "data.binidx: needs a validation split"),
        (["data.val_tokens=100000"], 2, "leaves no training data"),
        (["data.tokenizer=bpe"], 2, "data.tokenizer: bpe is trained on a corpus"),
    ],
)
def test_bad_prefix_settings_are_one_line(tmp_path, byte_prefix, extra, code, message):
    result = bad(tmp_path, f"data.binidx={byte_prefix}", "data.val_tokens=100", *extra)
    assert result.exit_code == code and message in result.stderr


def test_ids_beyond_the_vocabulary_are_one_line(tmp_path):
    prefix = tmp_path / "wide"
    write_binidx(prefix, [np.arange(1, 400, dtype=np.uint16)], np.uint16)
    result = bad(tmp_path, f"data.binidx={prefix}", "data.val_tokens=50")
    assert result.exit_code == 1 and "token id 257" in result.stderr and "outside the vocabulary" in result.stderr


def test_a_prefix_whose_bin_disagrees_with_its_idx_is_one_line(tmp_path, byte_prefix):
    bin_path = byte_prefix.with_name("bytes.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    result = bad(tmp_path, f"data.binidx={byte_prefix}", "data.val_tokens=100")
    assert result.exit_code == 1 and "truncated" in result.stderr


@pytest.mark.parametrize(
    "mix,message",
    [
        ("[]", "data.mix: the mixture is empty"),
        ("[{path: PREFIX, weight: 0}]", "data.mix: every weight is 0"),
        ("[{path: PREFIX, weight: -1}]", "data.mix[0].weight: must be >= 0"),
        ("[{path: PREFIX, wieght: 1}]", "did you mean 'weight'"),
        ("[{path: PREFIX}]", "data.mix: no source is a prepared directory"),
    ],
)
def test_bad_mixtures_are_one_line(tmp_path, byte_prefix, mix, message):
    result = bad(tmp_path, f"data.mix={mix.replace('PREFIX', str(byte_prefix))}")
    assert result.exit_code == 2 and message in result.stderr


def test_a_mixture_directory_that_is_not_prepared_is_one_line(tmp_path, corpus):
    result = bad(tmp_path, f"data.mix=[{{path: {corpus.parent}}}]")
    assert result.exit_code == 1 and "without meta.json" in result.stderr and "rwkvx data prepare" in result.stderr


def test_sources_are_given_one_way_and_the_sampler_is_named(tmp_path, byte_prefix, corpus):
    result = bad(tmp_path, f"data.corpus=[{corpus}]", f"data.binidx={byte_prefix}", "data.val_tokens=100")
    assert result.exit_code == 2 and "data.corpus and data.binidx both give the training data" in result.stderr
    result = bad(tmp_path, "train.sampler=epochs")
    assert result.exit_code == 2 and "train.sampler: 'epochs' is not one of epoch, random, documents" in result.stderr
    result = bad(tmp_path, "train.sampelr=epoch")
    assert result.exit_code == 2 and "did you mean 'sampler'" in result.stderr


def test_a_corpus_folder_without_meta_json_is_prepared(tmp_path, corpus):
    run = tmp_path / "run"
    train(*tiny_args(run, corpus.parent, "train.tokens=128"))  # a folder of .txt: a corpus, not prepared data
    assert (run / "data" / "meta.json").is_file()


def test_multi_process_train_on_unprepared_data_stops_at_once_naming_the_command(tmp_path, corpus):
    run = tmp_path / "run"
    result = run_cli("train", *tiny_args(run, corpus, "train.micro_batch=2", "train.grad_accum=2"), nproc=2)
    assert result.returncode != 0
    # Each rank says it in one line (torchrun then reports the failed launch; none of our frames show).
    assert result.stderr.count("error: the corpus is not prepared") == 2, result.stderr[-2000:]
    assert "rwkvx data prepare" in result.stderr and "rwkvx_cli/" not in result.stderr
    assert not (run / "data").exists() and not (run / "checkpoints").exists()


def test_data_prepare_world_jsonl_text_field_and_skip_bad(tmp_path):
    src = tmp_path / "docs.jsonl"
    records = [json.dumps({"body": t}) for t in DOCS[:8]]
    src.write_text("\n".join([*records[:3], "{not json", *records[3:]]) + "\n")
    out = tmp_path / "out"
    args = ["data", "prepare", str(src), "--out", str(out), "--tokenizer", "world", "--text-field", "body"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "docs.jsonl" in result.stderr and not (out / "meta.json").exists()
    result = runner.invoke(app, [*args, "--skip-bad"])
    assert result.exit_code == 0, result.output
    assert "skipped 1 bad records" in result.stderr and "world tokenizer, vocab 65,536" in result.stdout
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "world" and meta["documents"] == 8 and meta["skipped_records"] == 1
    result = runner.invoke(app, [*args, "--skip-bad", "--eod-id", "5"])
    assert result.exit_code == 2 and "eod_id" in result.stderr


def test_the_new_keys_round_trip_through_a_saved_config():
    from rwkvx_cli.config import config_from_dict, config_to_dict, load_config

    for overrides in (
        ["data.binidx=p", "data.val_tokens=10", "data.tokenizer=world", "model.vocab_size=65536"],
        ["data.mix=[{path: a, weight: 2}, {path: b}]", "data.val_binidx=v", "train.sampler=epoch"],
        ["train.sampler=random", "data.tokenizer=tok.json", "data.eod_id=3"],
    ):
        cfg = load_config(None, overrides)
        assert config_from_dict(config_to_dict(cfg)) == cfg  # what eval reads back from a checkpoint


def test_sharded_prepares_train_as_one_corpus(tmp_path, corpus):
    """`data prepare --num-shards 2 --shard-index i` twice (two machines), then data.corpus names both
    shards (or a glob): training reads every shard's tokens, validation spans them all, eval reads them."""
    from rwkvx_cli.config import load_config
    from rwkvx_cli.data import prepare
    from rwkvx_cli.runs.data import open_data

    lines = corpus.read_text().splitlines(keepends=True)
    inputs = [tmp_path / "in" / "a.txt", tmp_path / "in" / "b.txt"]
    inputs[0].parent.mkdir()
    inputs[0].write_text("".join(lines[: len(lines) // 2]))
    inputs[1].write_text("".join(lines[len(lines) // 2 :]))
    shards = [tmp_path / "shards" / f"s{i}" for i in range(2)]
    for i, out in enumerate(shards):
        prepare(inputs, out, tokenizer_kind="byte", num_shards=2, shard_index=i, workers=1, val_fraction=0.2)
    lengths = [len(open_tokens(s / "train.bin").tokens) for s in shards]
    assert min(lengths) > 0
    for given in ([str(s) for s in shards], [str(tmp_path / "shards" / "s*")]):
        cfg = load_config(None, tiny_args(tmp_path / "run", corpus, f"data.corpus={json.dumps(given)}"))
        data = open_data(cfg, tmp_path / "run")
        assert len(data.train.tokens) == sum(lengths) and data.data_dir == shards[0]
        val = sum(len(open_tokens(s / "val.bin").tokens) for s in shards)
        assert len(data.val.tokens) == val
    run = tmp_path / "run"
    train(*tiny_args(run, corpus, f"data.corpus=[{shards[0]},{shards[1]}]"))
    assert not (run / "data").exists()  # nothing prepared or copied
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["tokens"] > 0
    (shards[1] / "tokenizer.json").write_text(WorldTokenizer().to_json())
    result = runner.invoke(
        app, ["train", *tiny_args(tmp_path / "run2", corpus, f"data.corpus=[{shards[0]},{shards[1]}]")]
    )
    assert result.exit_code == 1 and "different tokenizers" in result.stderr
