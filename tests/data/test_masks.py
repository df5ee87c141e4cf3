"""Loss masks from `data prepare`: each record shape's mask, aligned with its tokens through the split, any number
of workers, shards and merge, an interrupted and resumed prepare; refusals in one line."""

import json
import shutil
import time

import numpy as np
import pytest

from rwkvx_cli.data import BinIdx, DataError, WorldTokenizer, corpus, open_prepared, prepare
from rwkvx_cli.data import encode as encode_module
from rwkvx_cli.data.masks import count, mask_path, open_mask
from rwkvx_cli.data.merge import merge_prepared
from rwkvx_cli.data.prepare import read_prepared_meta
from rwkvx_cli.data.template import load_template
from rwkvx_cli.errors import UsageError
from tests.data.chats import write_chats

G1 = load_template("g1")
WORLD = WorldTokenizer()


def expected(records: list[dict], tok=WORLD) -> tuple[np.ndarray, np.ndarray]:
    """The tokens and mask of records rendered by G1 (a text record: every token), one after another."""
    ids, mask = [], []
    for r in records:
        shape = "messages" if "messages" in r else "prompt" if "prompt" in r else "text"
        spans = G1.record_spans(r, shape, "text")
        for text, loss in spans:
            part = tok.encode(text)
            ids += part
            mask += [loss] * len(part)
        ids.append(0)
        mask.append(spans[-1][1])
    return np.array(ids), np.array(mask, dtype=np.uint8)


def split_of(d, split="train"):
    return np.fromfile(d / f"{split}.bin", np.uint16), np.fromfile(d / f"{split}.mask", np.uint8)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    root = tmp_path_factory.mktemp("chats")
    records = write_chats(root / "a.jsonl", 400, seed=1)
    records += write_chats(root / "b.jsonl", 150, seed=2, shape="prompt")
    records += write_chats(root / "c.jsonl", 50, seed=3, shape="text")
    (root / "d.txt").write_text("A plain text file.\n\nIts every token carries loss.\n")
    return root, records


def test_each_shape_gets_its_mask_beside_its_tokens(tmp_path, chats):
    root, records = chats
    inputs = [root / n for n in ("a.jsonl", "b.jsonl", "c.jsonl", "d.txt")]
    stats = prepare(inputs, tmp_path / "out", "world", val_fraction=0, workers=1)
    tokens, mask = split_of(tmp_path / "out")
    want_tokens, want_mask = expected(records)
    text = WORLD.encode((root / "d.txt").read_text()) + [0]
    np.testing.assert_array_equal(tokens, np.concatenate([want_tokens, text]))
    np.testing.assert_array_equal(mask, np.concatenate([want_mask, np.ones(len(text), np.uint8)]))
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["template"]["name"] == "g1" and meta["template"]["sha256"] == G1.sha256
    assert meta["mask"] == {"suffix": ".mask", "dtype": "uint8"}
    assert meta["train"]["loss_tokens"] == int(mask.sum()) == stats.train_loss_tokens and stats.template == "g1"
    assert 0.2 < mask.mean() < 0.8  # replies, their turn ends and eods: not everything, not nothing
    # what carries loss decodes to the replies (with their space and turn end), nothing of the prompts
    first = records[0]["messages"]
    doc_end = int(np.flatnonzero(tokens == 0)[0]) + 1
    replies = "".join(f" {m['content']}\n\n" for m in first if m["role"] == "assistant")
    got = WORLD.decode(tokens[:doc_end][mask[:doc_end] == 1].tolist())
    assert got == replies and "User:" not in got


def test_documents_alone_write_no_mask_and_the_same_files(tmp_path, chats):
    root, _ = chats
    prepare([root / "c.jsonl"], tmp_path / "g1", "world", workers=1)
    prepare([root / "c.jsonl"], tmp_path / "none", "world", workers=1, template=None)
    assert not mask_path(tmp_path / "g1" / "train").exists()
    for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
        assert (tmp_path / "g1" / name).read_bytes() == (tmp_path / "none" / name).read_bytes()
    assert "template" not in json.loads((tmp_path / "g1" / "meta.json").read_text())


def _split_docs(d, split):
    data = BinIdx(d / split)
    mask = open_mask(d / split, len(data))
    ends = np.cumsum(data.doc_sizes)
    return {
        np.asarray(data.tokens[e - n : e]).tobytes(): np.asarray(mask[e - n : e]).tobytes()
        for n, e in zip(data.doc_sizes.tolist(), ends.tolist(), strict=True)
    }


def test_masks_are_the_same_bytes_for_any_workers_shards_and_merge(tmp_path, chats):
    root, records = chats
    inputs = [root / n for n in ("a.jsonl", "b.jsonl", "c.jsonl")]
    small = {"batch_bytes": 4_000, "unit_bytes": 9_000}
    prepare(inputs, tmp_path / "w1", "world", workers=1, val_fraction=0.2)
    prepare(inputs, tmp_path / "w2", "world", workers=2, val_fraction=0.2, **small)
    for name in ("train.bin", "train.mask", "val.bin", "val.mask", "train.idx"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    # every document keeps its own mask through the split (the validation documents are chosen at random)
    want_tokens, want_mask = expected(records[:600])
    ends = np.flatnonzero(want_tokens == 0) + 1
    wanted = {t.tobytes(): m.tobytes() for t, m in zip(np.split(want_tokens.astype(np.uint16), ends[:-1]),
                                                       np.split(want_mask, ends[:-1]), strict=True)}
    got = _split_docs(tmp_path / "w1", "train") | _split_docs(tmp_path / "w1", "val")
    assert got == wanted
    # three shards, merged, with no validation split: the corpus in order
    whole = prepare(inputs, tmp_path / "whole", "world", workers=1, val_fraction=0)
    for i in range(3):
        prepare(inputs, tmp_path / f"s{i}", "world", workers=2, val_fraction=0, num_shards=3, shard_index=i, **small)
    merged = merge_prepared([tmp_path / f"s{i}" for i in range(3)], tmp_path / "merged")
    assert merged.train_tokens == whole.train_tokens
    for name in ("train.bin", "train.mask"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    meta = read_prepared_meta(tmp_path / "merged")
    assert meta["train"]["loss_tokens"] == whole.train_loss_tokens and meta["template"]["name"] == "g1"
    corpus = open_prepared([tmp_path / f"s{i}" for i in range(3)])  # read as one, nothing copied
    np.testing.assert_array_equal(np.concatenate(corpus.train_masks), split_of(tmp_path / "whole")[1])


def test_an_interrupted_prepare_resumes_to_the_same_masks(tmp_path, chats, monkeypatch):
    root, _ = chats
    inputs = [root / "a.jsonl", root / "b.jsonl"]
    options = {"batch_bytes": 4_000, "unit_bytes": 9_000, "workers": 1}
    prepare(inputs, tmp_path / "ref", "world", **options)
    calls = 0
    run = encode_module.Encoder.run

    state_file = tmp_path / "out" / ".prepare" / "state.json"

    def recorded() -> int:
        return json.loads(state_file.read_text())["units_done"] if state_file.exists() else 0

    def interrupted(self, task):
        nonlocal calls
        calls += 1
        if calls == 12:  # mid-way; a unit's state is written by a thread: interrupt once it is on disk
            deadline = time.monotonic() + 60
            while recorded() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise KeyboardInterrupt
        return run(self, task)

    monkeypatch.setattr(encode_module.Encoder, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(inputs, tmp_path / "out", "world", **options)
    monkeypatch.setattr(encode_module.Encoder, "run", run)
    state = json.loads((tmp_path / "out" / ".prepare" / "state.json").read_text())
    assert state["units_done"] >= 1
    stats = prepare(inputs, tmp_path / "out", "world", resume=True, **options)
    assert stats.resumed_bytes > 0
    for name in ("train.bin", "train.mask", "val.bin", "val.mask", "meta.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name


def test_open_prepared_reads_masked_and_plain_directories_and_refuses_two_templates(tmp_path, chats):
    root, _ = chats
    prepare([root / "b.jsonl"], tmp_path / "chat", "world", workers=1)
    prepare([root / "c.jsonl"], tmp_path / "plain", "world", workers=1)
    corpus = open_prepared([tmp_path / "chat", tmp_path / "plain"])
    plain = corpus.train_masks[1]
    assert corpus.masked and len(plain) == len(corpus.train[1]) and plain.all()  # documents carry loss
    assert len(corpus.val_mask) == len(corpus.val)
    other = tmp_path / "other.yaml"
    spec = G1.as_dict()
    spec["name"], spec["turn_end"] = "g1-single", "\n"
    other.write_text(json.dumps(spec))
    prepare([root / "b.jsonl"], tmp_path / "chat2", "world", workers=1, template=other)
    with pytest.raises(DataError, match="different chat templates \\(g1 and g1-single\\)"):
        open_prepared([tmp_path / "chat", tmp_path / "chat2"])
    merged = merge_prepared([tmp_path / "chat", tmp_path / "plain"], tmp_path / "merged")
    _, mask = split_of(tmp_path / "merged")
    assert len(mask) == merged.train_tokens and mask[-len(plain) :].all()


def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def test_a_record_of_another_shape_or_a_bad_one_names_its_line(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"prompt": "q", "response": "a"},
        {"messages": [{"role": "robot", "content": "x"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    for workers in (1, 2):
        with pytest.raises(DataError) as e:
            prepare([path], tmp_path / "out", "world", workers=workers)
        assert _one_line(e) == (
            f'{path}:2: a prompt/response pair ("prompt", "response"), in a file of conversations (its first '
            "record's shape): one shape per file"
        )
    stats = prepare([path], tmp_path / "out", "world", skip_bad=True, val_fraction=0)
    assert stats.skipped_records == 2 and stats.first_skipped.startswith(f"{path}:2: ")
    text = tmp_path / "text.jsonl"
    text.write_text('{"text": "a"}\n{"messages": []}\n')
    with pytest.raises(DataError) as e:
        prepare([text, path], tmp_path / "out2", "world")
    assert _one_line(e) == (
        f"{text}:2: a conversation (\"messages\"), in a file of documents (its first record's shape): one shape "
        "per file"
    )


def test_bad_options_are_one_line(tmp_path, chats):
    root, _ = chats
    with pytest.raises(UsageError) as e:
        prepare([root / "a.jsonl"], tmp_path / "out", "bpe", vocab_size=300)
    assert "a BPE is trained on documents, not conversations" in _one_line(e)
    with pytest.raises(UsageError) as e:
        prepare([root / "c.jsonl"], tmp_path / "out", "world", template="chatml")
    assert "template 'chatml' is neither a template name (g1) nor a file" in _one_line(e)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_an_edited_mask_or_meta_is_refused(tmp_path, chats):
    root, _ = chats
    prepare([root / "b.jsonl"], tmp_path / "out", "world", workers=1)
    d = tmp_path / "out"
    read_prepared_meta(d)
    saved = (d / "train.mask").read_bytes()
    (d / "train.mask").write_bytes(saved[:-1])
    with pytest.raises(DataError, match="holds .* bytes for .* tokens"):
        read_prepared_meta(d)
    flipped = bytearray(saved)
    flipped[0] ^= 1
    (d / "train.mask").write_bytes(bytes(flipped))
    with pytest.raises(DataError, match="marks .* tokens that carry loss, .* says"):
        read_prepared_meta(d)
    flipped[0] = 7
    (d / "train.mask").write_bytes(bytes(flipped))
    with pytest.raises(DataError, match="byte 7 at position 0 is not 0 or 1"):
        read_prepared_meta(d)
    (d / "train.mask").unlink()
    with pytest.raises(DataError, match="train.mask is missing"):
        open_prepared(d)
    (d / "train.mask").write_bytes(saved)
    assert count(open_mask(d / "train", len(saved)), "x") == json.loads((d / "meta.json").read_text())["train"][
        "loss_tokens"
    ]


def test_a_directory_prepared_again_without_conversations_drops_its_old_masks(tmp_path, chats):
    root, _ = chats
    out = tmp_path / "out"
    prepare([root / "b.jsonl"], out, "world", workers=1)
    assert mask_path(out / "train").exists()
    shutil.rmtree(out / ".prepare", ignore_errors=True)
    prepare([root / "c.jsonl"], out, "world", workers=1)
    assert not mask_path(out / "train").exists() and not mask_path(out / "val").exists()
    open_prepared(out)


def test_data_prepare_takes_the_template_and_refuses_a_bad_one_in_one_line(tmp_path, chats):
    from typer.testing import CliRunner

    from rwkvx_cli.cli import app

    root, _ = chats
    runner = CliRunner()
    out = tmp_path / "out"
    spec = G1.as_dict()
    spec["name"] = "mine"
    (tmp_path / "mine.json").write_text(json.dumps(spec))
    args = ["data", "prepare", str(root / "b.jsonl"), "--out", str(out), "--tokenizer", "world", "--workers", "1"]
    result = runner.invoke(app, [*args, "--template", str(tmp_path / "mine.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "meta.json").read_text())["template"]["name"] == "mine"
    for bad, line in [
        ("g7", "error: template 'g7' is neither a template name (g1) nor a file"),
        (str(tmp_path / "chats.yaml"), f"error: template '{tmp_path / 'chats.yaml'}' is neither a template name"),
    ]:
        bad_args = ["data", "prepare", str(root / "b.jsonl"), "--out", str(tmp_path / "bad"), "--template", bad]
        result = runner.invoke(app, bad_args)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        assert result.output.strip().splitlines()[-1].startswith(line), result.output


def test_spans_longer_than_one_call_are_encoded_in_pieces_with_the_same_bytes(tmp_path, chats, monkeypatch):
    root, _ = chats
    prepare([root / "a.jsonl"], tmp_path / "whole", "world", workers=1)
    monkeypatch.setattr(encode_module, "WHOLE_CHARS", 12)  # most spans: in pieces cut where World allows
    monkeypatch.setattr(corpus, "PIECE_CHARS", 16)
    split, cut = encode_module.Encoder._split, []

    def counting(self, text):
        pieces, kinds = split(self, text)
        cut.append(len(pieces) > 1)
        return pieces, kinds

    monkeypatch.setattr(encode_module.Encoder, "_split", counting)
    prepare([root / "a.jsonl"], tmp_path / "pieces", "world", workers=1)
    assert sum(cut) > 100
    for name in ("train.bin", "train.mask", "val.bin", "val.mask"):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "pieces" / name).read_bytes(), name


def test_a_resume_under_another_template_is_refused(tmp_path, chats, monkeypatch):
    root, _ = chats
    run = encode_module.Encoder.run

    def interrupted(self, task):
        raise KeyboardInterrupt

    monkeypatch.setattr(encode_module.Encoder, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([root / "b.jsonl"], tmp_path / "out", "world", workers=1)
    monkeypatch.setattr(encode_module.Encoder, "run", run)
    other = tmp_path / "other.json"
    spec = G1.as_dict()
    spec["turn_end"] = "\n"
    other.write_text(json.dumps(spec))
    with pytest.raises(UsageError) as e:
        prepare([root / "b.jsonl"], tmp_path / "out", "world", workers=1, resume=True, template=other)
    assert "holds a partial preparation with another chat template (or none); run without resume" in _one_line(e)
