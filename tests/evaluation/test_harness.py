"""`rwkvx eval --tasks`: lm-evaluation-harness over a checkpoint, offline, on local task YAMLs,
checked against log-softmax computed here on the same token ids."""

import builtins
import json
import math
import re

import pytest
import torch
from typer.testing import CliRunner

from rwkvx_cli.checkpoints import find, full
from rwkvx_cli.checkpoints import store as ck
from rwkvx_cli.cli import app
from rwkvx_cli.config import config_from_dict
from rwkvx_cli.data.tokenizer import ByteTokenizer
from rwkvx_cli.evaluation.scoring import greedy_until, score_continuations
from rwkvx_cli.models import LM
from rwkvx_cli.models.generate import generate
from rwkvx_cli.runs.weights import load_into

lm_eval = pytest.importorskip("lm_eval")

runner = CliRunner()

MC = [
    ("The cat sat on the", ["mat", "moon", "zebra crossing"], 0),
    ("Water is", ["wet", "dry", "a kind of cheese"], 0),
    ("One, two,", ["three", "seven", "ninety"], 0),
    ("The sun rises in the", ["east", "west", "cupboard"], 1),
    ("A quick brown", ["fox", "box", "socks"], 2),
    ("Bread is made from", ["flour", "stone", "rain"], 0),
]
LL = [
    "the quick brown fox jumps over the lazy dog",
    "line 3: the quick brown fox 3 jumps",
    "a small corpus, read several times over",
    "she sells sea shells on the sea shore",
    "x",
]
ROLLING = [
    "A short document.",
    "line 1: the quick brown fox 1 jumps over the lazy dog 1. " * 2,  # longer than ctx_len: chunks
    "ünïcödé bytes, 中文 too",
]

TASKS = {
    "tiny_mc.yaml": """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "tiny_ll.yaml": """task: tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/ll.jsonl
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "tiny_ppl.yaml": """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/rolling.jsonl
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
  - metric: byte_perplexity
""",
}


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hf_datasets")


@pytest.fixture(autouse=True)
def offline(monkeypatch, hf_cache):
    """No network, and the datasets cache (the local JSONL tasks') in a temporary directory. The
    environment is read when `datasets` is imported, so its module-level copies are set as well."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(hf_cache))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    datasets_config = pytest.importorskip("datasets.config")
    monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", hf_cache)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny byte-level run: `rwkvx init`, then a step-1 checkpoint with spread-out weights (the
    step-0 init predicts almost uniformly, which would make every choice a near tie)."""
    root = tmp_path_factory.mktemp("lm_eval")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog.\n" for i in range(60)))
    run_dir = root / "run"
    args = [f"run_dir={run_dir}", f"data.corpus=[{corpus}]", "model.n_layer=2", "model.n_embd=64"]
    args += ["model.head_size=32", "train.ctx_len=32", "train.device=cpu"]
    result = runner.invoke(app, ["init", *args])
    assert result.exit_code == 0, result.output
    step0, _ = find.resolve_checkpoint(run_dir)
    meta = ck.read_meta(step0)
    weights = full.load_weights(step0)
    gen = torch.Generator().manual_seed(0)
    weights["emb.weight"] = torch.randn(weights["emb.weight"].shape, generator=gen)
    weights["head.weight"] = torch.randn(weights["head.weight"].shape, generator=gen) * 0.3
    keep = {k: v for k, v in meta.items() if k not in ("step", "format", "files", "meta_sha256")}
    full.save_checkpoint(run_dir / "checkpoints", 1, weights, None, keep, keep_last=5)

    tasks = root / "tasks"
    tasks.mkdir()
    data = root / "data"
    data.mkdir()
    rows = {
        "mc.jsonl": [{"query": q, "choices": c, "label": y} for q, c, y in MC],
        "ll.jsonl": [{"text": t} for t in LL],
        "rolling.jsonl": [{"text": t} for t in ROLLING],
    }
    for name, docs in rows.items():
        (data / name).write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    for name, text in TASKS.items():
        (tasks / name).write_text(text.format(dir=data))
    return run_dir, tasks


def load_model(run_dir):
    path, _ = find.resolve_checkpoint(run_dir)
    cfg = config_from_dict(ck.read_meta(path)["config"])
    model = LM(cfg.model)
    load_into(model, full.load_weights(path), str(path))
    return model.eval()


@torch.no_grad()
def direct(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """log p(cont | ctx) and greedy-ness from one plain forward of the model's full logits."""
    logits, _ = model(torch.tensor([ctx + cont]))
    logp = torch.log_softmax(logits[0].double(), dim=-1)[len(ctx) - 1 : -1]
    target = torch.tensor(cont)
    return float(logp.gather(1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def test_scores_match_a_plain_forward_with_padding_and_chunked_state(run):
    model, tok = load_model(run[0]), ByteTokenizer()
    pairs = [(tok.encode(q), tok.encode(" " + c)) for q, choices, _ in MC for c in choices]
    pairs.append((tok.encode("x" * 50), tok.encode(" and a continuation that crosses chunks")))  # > max_len
    want = [direct(model, ctx, cont) for ctx, cont in pairs]
    got = score_continuations(model, pairs, batch_size=4, max_len=8)  # ragged batches, 8-token chunks
    for (g, gg), (w, wg) in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-5) and gg == wg


def test_hybrid_with_attention_scores_its_last_max_len_tokens():
    from rwkvx_cli.config import ModelConfig
    from rwkvx_cli.models.model import build_model

    model = build_model(ModelConfig(n_layer=2, n_attn=1, n_embd=64, head_size=32, moba_chunk=8), seed=0).eval()
    with torch.no_grad():
        model.emb.weight.normal_(generator=torch.Generator().manual_seed(1))
    assert not model.recurrent
    tok = ByteTokenizer()
    pairs = [(tok.encode("short one"), tok.encode(" ok")), (tok.encode("the quick brown fox"), tok.encode(" jumps"))]
    long_ctx, cont = tok.encode("y" * 40 + " and the end"), tok.encode(" word")
    got = score_continuations(model, [*pairs, (long_ctx, cont)], batch_size=2, max_len=16)
    for (g, gg), (ctx, c) in zip(got[:2], pairs, strict=True):
        w, wg = direct(model, ctx, c)
        assert g == pytest.approx(w, abs=1e-5) and gg == wg
    kept = (long_ctx + cont)[-17:]  # max_len + 1 tokens: the context loses its head
    w, wg = direct(model, kept[: -len(cont)], cont)
    assert got[2][0] == pytest.approx(w, abs=1e-5) and got[2][1] == wg


def test_greedy_generation_matches_generate(run):
    model, tok = load_model(run[0]), ByteTokenizer()
    prompt = tok.encode("the quick")
    want = generate(model, prompt, 12, temperature=0.0)
    assert greedy_until(model, prompt, 12, 32, lambda ids: False) == want
    assert greedy_until(model, prompt, 12, 32, lambda ids: len(ids) >= 3) == want[:3]


def test_tasks_through_the_cli_match_direct_loglikelihoods(run, tmp_path):
    run_dir, tasks = run
    out = tmp_path / "res" / "results.json"
    result = runner.invoke(
        app,
        ["eval", "--checkpoint", str(run_dir), "--tasks", "tiny_mc,tiny_ll,tiny_ppl", "--include-path", str(tasks)]
        + ["--output", str(out), "--bootstrap-iters", "0", "--batch-size", "3"],
    )
    assert result.exit_code == 0, result.output
    assert "tiny_mc" in result.stdout and "acc" in result.stdout
    for what in ("scoring", "scoring documents"):  # piped: our model's progress, a plain line on stderr
        assert re.search(rf"^{what} (\d+)/\1 requests \(100%\)", result.stderr, re.M), result.stderr
    assert "scoring" not in result.stdout
    summary = json.loads(out.read_text())
    assert summary["step"] == 1
    res = summary["results"]

    model, tok = load_model(run_dir), ByteTokenizer()
    # multiple choice: context = query, continuation = " " + choice (lm-eval's target delimiter)
    picks, picks_norm = [], []
    for query, choices, label in MC:
        lls = [direct(model, tok.encode(query), tok.encode(" " + c))[0] for c in choices]
        picks.append(max(range(len(lls)), key=lls.__getitem__) == label)
        norm = [ll / len(c) for ll, c in zip(lls, choices, strict=True)]  # lm-eval: characters of the choice
        picks_norm.append(max(range(len(norm)), key=norm.__getitem__) == label)
    assert res["tiny_mc"]["acc,none"] == sum(picks) / len(MC)
    assert res["tiny_mc"]["acc_norm,none"] == sum(picks_norm) / len(MC)
    assert 0 < sum(picks) < len(MC) or sum(picks_norm) != sum(picks)  # not a degenerate check

    # loglikelihood (LAMBADA-style): last word given the rest; perplexity = exp(-mean ll)
    lls, greedy = [], []
    for text in LL:
        words = text.split(" ")
        ctx, cont = " ".join(words[:-1]), " " + words[-1]
        if ctx == "":  # empty context: the end-of-document token conditions the first one
            ll, g = direct(model, [0], tok.encode(cont))
        else:
            ll, g = direct(model, tok.encode(ctx), tok.encode(cont))
        lls.append(ll)
        greedy.append(g)
    assert res["tiny_ll"]["acc,none"] == sum(greedy) / len(LL)
    assert res["tiny_ll"]["perplexity,none"] == pytest.approx(math.exp(-sum(lls) / len(LL)), rel=1e-5)

    # rolling (perplexity tasks): every byte of each document, after the end-of-document token
    total = sum(direct(model, [0], tok.encode(t))[0] for t in ROLLING)
    n_bytes = sum(len(t.encode()) for t in ROLLING)
    assert res["tiny_ppl"]["bits_per_byte,none"] == pytest.approx(-total / n_bytes / math.log(2), rel=1e-5)


def test_limit_and_json(run):
    run_dir, tasks = run
    args = ["eval", "--checkpoint", str(run_dir), "--tasks", "tiny_m?", "--include-path", str(tasks)]
    result = runner.invoke(app, [*args, "--limit", "2", "--json", "--bootstrap-iters", "0"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["limit"] == 2 and summary["n-samples"]["tiny_mc"]["effective"] == 2


def test_unknown_task_is_one_line_before_any_model_work(run, monkeypatch, tmp_path):
    run_dir, tasks = run

    def no_model(*a, **k):
        raise AssertionError("the checkpoint was read before the task names were checked")

    monkeypatch.setattr(full, "load_weights", no_model)
    # lm-eval's ~14,000 built-in task YAMLs take seconds to index: stand a one-task folder in for them.
    import lm_eval.tasks.manager

    builtin = tmp_path / "builtin"
    builtin.mkdir()
    (builtin / "t.yaml").write_text((tasks / "tiny_ll.yaml").read_text().replace("task: tiny_ll", "task: lambada_x"))
    monkeypatch.setattr(lm_eval.tasks.manager, "__file__", str(builtin / "manager.py"))
    args = ["eval", "--checkpoint", str(run_dir), "--tasks", "tiny_mc,tiny_mcc", "--include-path", str(tasks)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --tasks: no task 'tiny_mcc' in lm-eval's tasks or {tasks}; did you mean 'tiny_mc'?"
    ]
    result = runner.invoke(app, ["eval", "--checkpoint", str(run_dir), "--tasks", "lambada_y"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: --tasks: no task 'lambada_y' in lm-eval's tasks; did you mean 'lambada_x'?"
    ]


def test_missing_lm_eval_names_the_extra(run, monkeypatch):
    real_import = builtins.__import__

    def without_lm_eval(name, *args, **kwargs):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_lm_eval)
    result = runner.invoke(app, ["eval", "--checkpoint", str(run[0]), "--tasks", "lambada_openai"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'rwkvx[eval]'" in lines[0] and "Traceback" not in result.output


def test_task_options_need_tasks(run):
    result = runner.invoke(app, ["eval", "--checkpoint", str(run[0]), "--limit", "3"])
    assert result.exit_code == 2 and result.stderr.strip() == "error: --limit goes with --tasks"
