"""The whole-model LRP: conservation on random tiny models of every supported kind (at the
input and at every block's output), ε -> 0, a planted token found, unsupported kinds refused,
targets parsed, and `explain_checkpoint` on a saved run."""

import pytest
import torch

from rwkvx_cli.checkpoints.full import save_checkpoint
from rwkvx_cli.config import Config, ModelConfig, config_to_dict
from rwkvx_cli.data.tokenizer import ByteTokenizer
from rwkvx_cli.errors import UsageError
from rwkvx_cli.explain import UnsupportedModelError, explain_checkpoint, explain_tokens, lrp
from rwkvx_cli.models import build_model

STACKS = {
    "rwkv4": ["rwkv4", "rwkv4"],
    "rwkv7": ["rwkv7", "rwkv7", "rwkv7"],
    "mixed": ["rwkv4", "rwkv7", "rwkv7"],  # v_first made above the first block
}


def tiny(layers, seed=0, vocab=40, noise=0.3):
    """A random model: the init zeroes the output projections, so perturb every parameter. The channel-mix key
    gain is pinned at 2.0, the init these models were chosen with (the planted token's model must depend on it)."""
    cfg = ModelConfig(
        vocab_size=vocab, n_embd=16, head_size=8, layers=list(layers), n_layer=len(layers), ffn_key_gain=2.0
    )
    model = build_model(cfg, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    return model


def ids_for(seed, n=10, vocab=40):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("stack", STACKS)
def test_conservation(stack):
    model = tiny(STACKS[stack])
    ids = ids_for(1)
    att = lrp(model, ids)
    logits = model.double()(torch.tensor([ids]))[0][0, -1].detach()
    torch.testing.assert_close(att.logits, logits, rtol=1e-12, atol=1e-12)  # the modified graph's values
    assert att.target == int(logits.argmax()) and att.logit == pytest.approx(float(logits.max()), rel=1e-12)
    # Input: Σ_tokens R + the norm biases' share = the logit.
    total = float(att.tokens.sum()) + att.bias
    assert abs(total - att.logit) <= 1e-4 * abs(att.logit)
    assert abs(att.absorbed) < 1e-12 and all(abs(float(r)) > 1e-8 for r in att.tokens)
    # Every block's output, with what crosses the cut through v_first and the biases above it.
    for i, (cut, v_first, bias) in enumerate(zip(att.cuts, att.cut_v_first, att.cut_bias, strict=True)):
        crossing = 0.0 if v_first is None else float(v_first.sum())
        assert abs(float(cut.sum()) + crossing + bias - att.logit) <= 1e-4 * abs(att.logit), i
    assert float(att.cuts[-1][:-1].abs().max()) == 0.0  # the head reads the last position only
    assert (att.cut_v_first[0] is None) == (stack != "rwkv7")


@pytest.mark.parametrize("stack", STACKS)
def test_epsilon_to_zero(stack):
    model = tiny(STACKS[stack], seed=2)
    ids = ids_for(3)
    exact = lrp(model, ids)
    absorbed = [abs(lrp(model, ids, exact.target, eps).absorbed) for eps in (1e-1, 1e-4, 1e-8)]
    assert absorbed[0] > absorbed[1] > absorbed[2]
    assert absorbed[2] <= 1e-4 * abs(exact.logit)
    near = lrp(model, ids, exact.target, 1e-8)
    torch.testing.assert_close(near.tokens, exact.tokens, rtol=1e-4, atol=1e-6)


def planted(layers):
    """Every token but id 5 has an embedding constant across its channels (a different constant
    per token), which ln0 maps to its bias alone: only token 5 can matter."""
    model = tiny(layers, vocab=16)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        model.emb.weight.copy_(torch.randn(16, 1, generator=g).expand(16, 16))
        model.emb.weight[5] = torch.randn(16, generator=g)
    return model


@pytest.mark.parametrize("stack", STACKS)
def test_planted_token_gets_the_relevance(stack):
    model = planted(STACKS[stack])
    ids = [3, 5, 3, 7, 9, 3, 2, 3]  # token 5 six steps back: its relevance must come through the state
    att = lrp(model, ids)
    occluded = lrp(model, [3, 3, 3, 7, 9, 3, 2, 3], att.target)
    assert abs(att.logit - occluded.logit) > 0.05  # the model does depend on token 5
    share = float(att.tokens[1].abs() / att.tokens.abs().sum())
    assert share >= 0.9, share
    assert abs(float(att.tokens[1])) > 1e-3
    # It reached token 5 through the recurrence: after block 0 it sits at the later positions.
    assert float(att.cuts[0][2:].abs().sum()) > 1e-3


@pytest.mark.parametrize("kind", ["moba", "gdn", "kda", "rwkv8"])
def test_unsupported_kinds_are_refused(kind):
    model = tiny(["rwkv7", kind] if kind != "moba" else ["rwkv7", "rwkv7", "moba"])
    with pytest.raises(UnsupportedModelError, match=f"rules for rwkv4 and rwkv7 blocks only; .*is {kind}$"):
        lrp(model, [1, 2, 3])
    assert issubclass(UnsupportedModelError, UsageError)


def test_targets_and_text():
    model = tiny(STACKS["rwkv4"], vocab=257)
    tok = ByteTokenizer()
    res = explain_tokens(model, tok, "abc", target="e", per_layer=True)
    assert (res.target_id, res.target_token, res.tokens, res.position) == (ord("e") + 1, "e", ["a", "b", "c"], 2)
    assert len(res.layers) == 2 and res.layers[0].kind == "rwkv4" and len(res.layers[1].relevance) == 3
    assert sum(res.relevance) + res.bias == pytest.approx(res.logit, rel=1e-10)
    assert explain_tokens(model, tok, "abc", target=ord("e") + 1).logit == pytest.approx(res.logit, rel=1e-12)
    nxt = explain_tokens(model, tok, "abc", target="next")
    assert nxt.probability == max(nxt.probability, res.probability) and nxt.layers is None
    for bad, message in (("ab", "2 tokens, not one"), (300, "outside the vocabulary"), ("", "0 tokens")):
        with pytest.raises(UsageError, match=message):
            explain_tokens(model, tok, "abc", target=bad)
    with pytest.raises(UsageError, match="text is empty"):
        explain_tokens(model, tok, "")
    with pytest.raises(UsageError, match="epsilon"):
        explain_tokens(model, tok, "abc", epsilon=-1.0)


def save_run(run, layers):
    cfg = Config(run_dir=str(run), model=ModelConfig(n_embd=16, head_size=8, layers=list(layers)))
    cfg.data.tokenizer = "byte"
    cfg.data.prepared_dir = str(run / "no-data-here")
    cfg.validate()
    save_checkpoint(run / "checkpoints", 7, tiny(layers, vocab=257), None, {"config": config_to_dict(cfg)}, 1)


def test_explain_checkpoint(tmp_path):
    save_run(tmp_path / "run", STACKS["mixed"])
    res = explain_checkpoint(tmp_path / "run", "Hi there", target="next", per_layer=True)
    assert res.step == 7 and res.checkpoint.endswith("step_00000007") and len(res.relevance) == 8
    assert abs(sum(res.relevance) + res.bias - res.logit) <= 1e-4 * abs(res.logit)
    assert [x.kind for x in res.layers] == STACKS["mixed"]
    with pytest.raises(UsageError, match="no tokenizer.json in"):
        explain_checkpoint(tmp_path / "run", "Hi", data_dir=tmp_path)
    save_run(tmp_path / "gdn", ["rwkv7", "gdn"])
    with pytest.raises(UnsupportedModelError, match="block 1 is gdn"):
        explain_checkpoint(tmp_path / "gdn", "Hi")
