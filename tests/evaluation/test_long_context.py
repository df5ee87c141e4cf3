"""Long-context evaluation (evaluation/long_context.py): the loss by position is every token's loss
read with the state carried, bucketed by position; the passkey prompt hides the key where asked and
an answer counts when it starts with the key; `rwkvx eval --by-position / --passkey` on a run."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.cli import app
from rwkvx_cli.config import ModelConfig
from rwkvx_cli.data import ByteTokenizer
from rwkvx_cli.evaluation import long_context as lc
from rwkvx_cli.models import build_model
from rwkvx_cli.runs.runtime import Runtime

runner = CliRunner()
CPU = Runtime(torch.device("cpu"), "fp32")
V = 64


def test_position_buckets_are_log_spaced_and_cover_every_position():
    assert lc.position_buckets(1) == [(1, 2)]
    assert lc.position_buckets(8) == [(1, 2), (2, 4), (4, 9)]
    assert lc.position_buckets(20) == [(1, 2), (2, 4), (4, 8), (8, 16), (16, 21)]
    buckets = lc.position_buckets(65_536)
    assert buckets[-1] == (32_768, 65_537) and len(buckets) == 16
    assert all(a[1] == b[0] for a, b in zip(buckets, buckets[1:], strict=False))


def perturbed(layers):
    cfg = ModelConfig(vocab_size=V, n_embd=32, head_size=16, layers=layers, moba_chunk=4, moba_top_k=1)
    model = build_model(cfg, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.mark.parametrize("layers", [["rwkv7", "rwkv7"], ["rwkv7", "moba"]])
def test_loss_by_position_reads_the_streams_with_the_state_carried(monkeypatch, layers):
    """Read in pieces of 7 tokens, each token's loss is the one a single whole forward gives it."""
    monkeypatch.setattr(lc, "READ_CHUNK", 7)
    model = perturbed(layers)
    streams = torch.randint(0, V, (3, 41), generator=torch.Generator().manual_seed(2))
    got = lc.loss_by_position(model, streams, CPU)
    with torch.no_grad():
        logits, _ = model(streams[:, :-1])
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), streams[:, 1:], reduction="none").double()
    assert [(b["lo"], b["hi"]) for b in got["buckets"]] == lc.position_buckets(40)
    for b in got["buckets"]:
        want = per_token[:, b["lo"] - 1 : b["hi"] - 1]
        assert b["tokens"] == want.numel()
        assert b["loss"] == pytest.approx(want.mean().item(), rel=1e-5)
    assert got["loss"] == pytest.approx(per_token.mean().item(), rel=1e-5)
    # Reading each piece from a zero state instead would give other losses past the first piece.
    fresh = torch.cat([model(streams[:, lo : min(lo + 7, 40)])[0] for lo in range(0, 40, 7)], 1)
    assert (fresh - logits).abs().max() > 1e-3


def test_streams_cover_the_split_and_refuse_what_it_cannot_hold():
    tokens = np.arange(1000) % 50
    streams, max_len = lc.streams_of(tokens, 300)
    assert streams.shape == (3, 301) and max_len == 300
    assert torch.equal(streams[1], torch.arange(300, 601) % 50)  # consecutive, sharing one token
    assert lc.streams_of(tokens, None)[1] == 999  # the longest the split holds
    with pytest.raises(lc.UsageError, match="room for 1 .. 999"):
        lc.streams_of(tokens, 1000)


def test_the_passkey_prompt_hides_the_key_at_its_depth():
    tok = ByteTokenizer()
    filler = np.frombuffer(("abcdefghij" * 100).encode(), dtype=np.uint8).astype(np.int64)
    needle = lc.NEEDLE.format(key="12345")
    for depth in (0.0, 0.5, 1.0):
        ids = lc.passkey_prompt(tok, filler, "12345", 400, depth)
        assert len(ids) == 400
        text = tok.decode(ids)
        assert text.endswith(lc.QUESTION) and text.count(needle) == 1
        n_fill = 400 - len(needle) - len(lc.QUESTION)
        assert text.index(needle) == round(depth * n_fill)
    with pytest.raises(lc.UsageError, match="do not hold the needle"):
        lc.passkey_prompt(tok, filler, "12345", 50, 0.5)
    with pytest.raises(lc.UsageError, match="too few for the filler"):
        lc.passkey_prompt(tok, filler[:100], "12345", 400, 0.5)


def test_an_answer_counts_when_it_starts_with_the_key(monkeypatch):
    """The scoring, with the model's greedy answers replaced: the even rows answer the key."""
    tok = ByteTokenizer()
    calls = []

    def answers(model, prompts, n, runtime, on_chunk=None, reset_at=None):
        calls.append(prompts.shape)
        texts = []
        for row in prompts.tolist():
            key = tok.decode(row).split("The pass key is ")[1][:5]
            texts.append(f" {key}." if len(texts) % 2 == 0 else " 00000")
        return [tok.encode(t)[:n] for t in texts]

    monkeypatch.setattr(lc, "_greedy", answers)
    tokens = np.frombuffer(("the quick brown fox. " * 200).encode(), dtype=np.uint8)
    result = lc.passkey(torch.nn.Identity(), tok, tokens, CPU, [128, 300], depths=[0.0, 1.0], trials=4, seed=3)
    assert calls == [(4, 128), (4, 128), (4, 300), (4, 300)]  # one batch per cell, prompts of the length
    assert [(c["length"], c["depth"], c["correct"]) for c in result["cells"]] == [
        (128, 0.0, 2),
        (128, 1.0, 2),
        (300, 0.0, 2),
        (300, 1.0, 2),
    ]
    keys = [a["key"] for c in result["cells"] for a in c["answers"]]
    assert len(set(keys)) == len(keys) and all(len(k) == 5 and k.isdigit() for k in keys)


def test_loss_by_position_starts_documents_where_the_run_trained_so(monkeypatch):
    """With reset_at (a data.reset_at_eod run's eod id), read in pieces of 7 tokens, each token's loss
    is the one a whole forward with those document starts gives it, and differs from packed reading."""
    monkeypatch.setattr(lc, "READ_CHUNK", 7)
    model = perturbed(["rwkv7", "gdn"])
    streams = torch.randint(1, V, (2, 41), generator=torch.Generator().manual_seed(2))
    streams[0, [3, 7, 20]] = 0
    streams[1, [14]] = 0
    got = lc.loss_by_position(model, streams, CPU, reset_at=0)
    packed = lc.loss_by_position(model, streams, CPU)
    with torch.no_grad():
        logits, _ = model(streams[:, :-1], starts=streams[:, :-1] == 0)
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), streams[:, 1:], reduction="none").double()
    assert got["loss"] == pytest.approx(per_token.mean().item(), rel=1e-5)
    assert got["loss"] != pytest.approx(packed["loss"], rel=1e-5)


def test_passkey_of_a_reset_run_leaves_the_end_of_document_token_out_of_the_filler(monkeypatch):
    tok = ByteTokenizer()
    seen = []

    def answers(model, prompts, n, runtime, on_chunk=None, reset_at=None):
        seen.append((prompts, reset_at))
        return [[0] * n for _ in range(prompts.shape[0])]

    monkeypatch.setattr(lc, "_greedy", answers)
    tokens = np.array(tok.encode("the quick brown fox. ") * 40 + [0] * 50, dtype=np.int64)
    tokens[::30] = 0  # end-of-document tokens all through the filler
    lc.passkey(torch.nn.Identity(), tok, tokens, CPU, [128], depths=[0.5], trials=2, seed=1, reset_at=0)
    (prompts, reset_at), = seen
    assert reset_at == 0 and not (prompts == 0).any()  # one document: nothing resets the needle away
    seen.clear()
    lc.passkey(torch.nn.Identity(), tok, tokens, CPU, [128], depths=[0.5], trials=2, seed=1)
    assert seen[0][1] is None


def test_parse_lengths():
    assert lc.parse_lengths("4k,1024, 16K,1_000") == [1000, 1024, 4096, 16384]
    for bad in ("", "1x", "0", "-5", "k"):
        with pytest.raises(lc.UsageError, match="not a length"):
            lc.parse_lengths(bad)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog.\n" for i in range(400)))
    run_dir = root / "run"
    args = [f"run_dir={run_dir}", f"data.corpus=[{corpus}]", "model.n_layer=2", "model.n_embd=32"]
    result = runner.invoke(app, ["init", *args, "model.head_size=16", "model.n_attn=1", "model.moba_chunk=8"])
    assert result.exit_code == 0, result.output
    return run_dir


def test_eval_by_position_through_the_cli(run, tmp_path):
    png = tmp_path / "bp.png"
    args = ["eval", "--checkpoint", str(run), "--by-position", "--max-len", "256", "--json", "--plot", str(png)]
    result = runner.invoke(app, [*args, "--against", str(run)])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["kind"] == "by_position" and figures["max_len"] == 256 and figures["streams"] >= 2
    a, b = figures["runs"]
    assert [x["loss"] for x in a["buckets"]] == [x["loss"] for x in b["buckets"]]  # the same checkpoint twice
    assert sum(x["tokens"] for x in a["buckets"]) == figures["tokens"] == 256 * figures["streams"]
    read = 2 * figures["tokens"]  # both checkpoints: piped, progress is a plain line on stderr
    assert f"by position {read:,}/{read:,} tokens (100%)" in result.stderr and "by position" not in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = runner.invoke(app, ["eval", "--checkpoint", str(run), "--by-position", "--max-len", "64"])
    assert table.exit_code == 0 and "32-64" in table.stdout and (run / "by-position.png").is_file()


def test_eval_passkey_through_the_cli(run):
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), "--passkey", "128,256", "--trials", "2", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)
    assert figures["lengths"] == [128, 256] and len(figures["cells"]) == 2 * len(lc.DEPTHS)
    assert all(c["trials"] == 2 and 0 <= c["correct"] <= 2 for c in figures["cells"])
    read = (128 + 256) * len(lc.DEPTHS) * 2  # the prompt tokens: piped, progress is a plain line on stderr
    assert f"passkey {read:,}/{read:,} tokens (100%)" in result.stderr and "passkey " not in result.stdout
    assert (run / "passkey.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--max-len", "64"], "--max-len goes with --by-position"),
        (["--passkey", "128", "--max-len", "64"], "--max-len goes with --by-position"),
        (["--by-position", "--trials", "2"], "--trials goes with --passkey"),
        (["--plot", "x.png"], "--plot goes with --by-position or --passkey"),
        (["--by-position", "--passkey", "128"], "do not go together"),
        (["--by-position", "--tasks", "hellaswag"], "--tasks and --by-position do not go together"),
        (["--passkey", "128", "--generate", "hi"], "--generate and --passkey do not go together"),
        (["--passkey", "12q"], "not a length in tokens"),
        (["--by-position", "--max-len", "100000000"], "--max-len 100000000: the validation split has"),
    ],
)
def test_bad_long_context_options_are_one_line_exit_2(run, extra, message):
    # --force: the run may hold the default pictures of the tests above, which a plain eval refuses to replace
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), *extra, "--force"])
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1


def _copy_run(run, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


@pytest.mark.parametrize("mode,name", [(["--by-position", "--max-len", "64"], "by-position.png"),
                                       (["--passkey", "128", "--trials", "1"], "passkey.png")])  # fmt: skip
def test_the_default_plot_is_guarded_as_plot_is(run, tmp_path, mode, name):
    """The picture's default place (in the run directory) goes through the output guard as --plot does: a
    file there that rwkvx did not just write is refused without --force, before the model is read, and a
    directory there is named (not a temporary file)."""
    run = _copy_run(run, tmp_path)
    mine = run / name
    mine.write_bytes(b"a user's picture")
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), *mode])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip() == f"error: the default --plot {mine} already exists; pass --force to replace it"
    assert mine.read_bytes() == b"a user's picture"
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), *mode, "--force"])
    assert result.exit_code == 0, result.output
    assert mine.read_bytes()[:4] == b"\x89PNG"
    mine.unlink()
    mine.mkdir()
    result = runner.invoke(app, ["eval", "--checkpoint", str(run), *mode, "--force"])
    assert result.exit_code == 2 and result.stderr.strip() == (
        f"error: the default --plot {mine} is a directory; give a file name"
    )
    assert ".tmp" not in result.stderr and not any(mine.iterdir())


def test_a_checkpoint_outside_a_run_directory_needs_plot(run, tmp_path):
    """A checkpoint kept elsewhere has no run directory to hold its picture (two levels up is anyone's
    directory): --plot names the file, and nothing is written two levels up."""
    import shutil

    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    outside = tmp_path / "kept" / "ckpt"
    outside.parent.mkdir()
    shutil.copytree(ckpt, outside)
    args = ["eval", "--checkpoint", str(outside), "--data", str(run / "data"), "--by-position", "--max-len", "64"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"{outside} is not in a run directory: name the picture's file with --plot" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    png = tmp_path / "bp.png"
    result = runner.invoke(app, [*args, "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:4] == b"\x89PNG" and sorted(p.name for p in tmp_path.iterdir()) == ["bp.png", "kept"]
    result = runner.invoke(app, ["eval", "--checkpoint", str(tmp_path / "nowhere"), "--by-position"])
    assert result.exit_code == 1 and "no checkpoint found at" in result.stderr  # the loader's word, not --plot's
