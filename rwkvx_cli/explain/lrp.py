"""Layer-wise relevance propagation for RWKV-4 and RWKV-7 language models (docs/explain.md).

One logit of the prediction after the last input token is handed back to the input tokens
through every layer's rule. The model runs once, in fp64 on the CPU, as LRP's modified graph
(its blocks' forward through graph.LRPGraph): every quantity a rule holds constant is
detached, so what remains is linear in the embeddings and the norms' biases, and the relevance
of any tensor x is x ⊙ ∂logit/∂x, which is the composed ε-rule exactly. With ε = 0 it
conserves: Σ_tokens R + R(norm biases) = logit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from rwkvx_cli.errors import UsageError
from rwkvx_cli.explain.graph import LRPGraph, layer_norm_lrp, lrp_eps
from rwkvx_cli.explain.rules import check_supported
from rwkvx_cli.models.model import layer_kinds
from rwkvx_cli.runs import open_checkpoint


@dataclass
class Attribution:
    """The raw result of `lrp` (tensors; `ExplainResult` is the reportable one)."""

    logits: torch.Tensor  # [V] at the explained position, from the modified graph (= the model's)
    target: int
    logit: float
    tokens: torch.Tensor  # [T] relevance of each input token
    bias: float  # relevance kept by the norms' biases (LayerNorm, RWKV-7's ln_x)
    cuts: list[torch.Tensor]  # [T] per block: the relevance of its output (the residual stream)
    cut_v_first: list[torch.Tensor | None]  # [T] per block: relevance crossing its cut through v_first
    cut_bias: list[float]  # per block: the bias relevance above its output

    @property
    def absorbed(self) -> float:
        """What the ε stabilisers kept: 0 up to rounding at ε = 0."""
        return self.logit - float(self.tokens.sum()) - self.bias


def lrp(model, ids: Sequence[int], target: int | None = None, epsilon: float = 0.0) -> Attribution:
    """The relevance of each token of `ids` for logit `target` (None: the model's top prediction)
    after the last one. `model` (an `LM`) is copied, not changed."""
    check_supported(model.kinds)
    if len(ids) == 0:
        raise UsageError("nothing to explain: the text has no tokens")
    V = model.head.weight.shape[0]
    if target is not None and not 0 <= target < V:
        raise UsageError(f"target token id {target} is outside the vocabulary (0..{V - 1})")
    m = copy.deepcopy(model).to(device="cpu", dtype=torch.float64)
    for p in m.parameters():
        p.requires_grad_(False)
    norm_bias = {}  # module name -> its bias, a leaf whose x ⊙ grad is its relevance
    for name, mod in m.named_modules():
        if isinstance(mod, (nn.LayerNorm, nn.GroupNorm)) and mod.bias is not None:
            norm_bias[name] = mod.bias.requires_grad_(True)
    graph = LRPGraph(epsilon)
    with torch.enable_grad():
        # The embedding rule: a token's input is its row of the table, its relevance the row's.
        x0 = m.emb.weight[torch.as_tensor(list(ids), dtype=torch.long)][None].clone().requires_grad_(True)
        x, v_src, v_from = x0, None, -1
        cuts, v_inputs = [], []  # v_inputs: (alias of v_first a block got, the block that made it)
        for i, blk in enumerate(m.blocks):
            # Each block gets its own alias of v_first, so its gradient is what flows into that block.
            v_in = None if v_src is None else v_src.view_as(v_src)
            if v_in is not None:
                v_in.retain_grad()
            x, v_out, _ = blk(x, v_in, None, graph)
            x.retain_grad()
            cuts.append(x)
            v_inputs.append((v_in, v_from))
            if v_out is not None and v_out is not v_in:
                v_src, v_from = v_out, i
        h = layer_norm_lrp(m.ln_out, x[0, -1], epsilon)
        logits = (h @ m.head.weight.T).detach()
        target = int(logits.argmax()) if target is None else int(target)
        logit = lrp_eps(h @ m.head.weight[target], epsilon)  # the head: z-rule on one logit
        logit.backward()

    def rel(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.grad is None:
            return None
        return (t * t.grad).sum(-1)[0].detach()

    def bias_of(prefix: str) -> float:
        grads = [
            (b.detach() * b.grad).sum() for n, b in norm_bias.items() if n.startswith(prefix) and b.grad is not None
        ]
        return float(sum(grads))

    per_block = [bias_of(f"blocks.{i}.") for i in range(len(m.blocks))]
    head_bias = bias_of("ln_out")
    v_rel = [(rel(v), made_in) for v, made_in in v_inputs]
    cut_v = []
    for i in range(len(m.blocks)):
        # v_first crosses the cut above block i into a block above it when it was made at or below i.
        crossing = [r for r, made_in in v_rel[i + 1 :] if r is not None and made_in <= i]
        cut_v.append(torch.stack(crossing).sum(0) if crossing else None)
    return Attribution(
        logits=logits,
        target=target,
        logit=float(logit.detach()),
        tokens=rel(x0),
        bias=sum(per_block) + head_bias,
        cuts=[rel(c) for c in cuts],
        cut_v_first=cut_v,
        cut_bias=[sum(per_block[i + 1 :]) + head_bias for i in range(len(m.blocks))],
    )


@dataclass
class LayerRelevance:
    """The relevance at the output of one block: the residual stream per token, and (RWKV-7
    above its first layer) what crosses the cut through v_first, per token. Their sum plus
    `bias` (the norm biases above) is the logit, less what ε absorbed above."""

    block: int
    kind: str
    relevance: list[float]
    v_first: list[float] | None
    bias: float


@dataclass
class ExplainResult:
    text: str
    tokens: list[str]  # each token decoded on its own
    token_ids: list[int]
    target_id: int
    target_token: str
    position: int  # the explained logit is the prediction after this input token
    logit: float
    probability: float
    epsilon: float
    relevance: list[float]  # per input token
    bias: float  # kept by the norms' biases
    absorbed: float  # kept by the ε stabilisers (0 at ε = 0)
    layers: list[LayerRelevance] | None = None
    checkpoint: str | None = None
    step: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def explain_tokens(
    model, tokenizer, text: str, target: str | int | None = None, per_layer: bool = False, epsilon: float = 0.0
) -> ExplainResult:
    """Explain the logit of `target` after `text` (a token's text, an id, or None / "next": the
    model's top prediction)."""
    if epsilon < 0:
        raise UsageError(f"epsilon must be >= 0, got {epsilon}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 reach Python as lone surrogates
        raise UsageError("--text is not valid UTF-8 text") from None
    ids = tokenizer.encode(text)
    if not ids:
        raise UsageError("nothing to explain: the text is empty")
    V = model.head.weight.shape[0]
    if max(ids) >= V:
        raise UsageError(f"the text has token id {max(ids)}, outside the model's vocabulary of {V}")
    att = lrp(model, ids, _target_id(target, tokenizer, V), epsilon)
    layers = None
    if per_layer:
        layers = [
            LayerRelevance(
                block=i,
                kind=kind,
                relevance=att.cuts[i].tolist(),
                v_first=None if att.cut_v_first[i] is None else att.cut_v_first[i].tolist(),
                bias=att.cut_bias[i],
            )
            for i, kind in enumerate(model.kinds)
        ]
    return ExplainResult(
        text=text,
        tokens=[tokenizer.decode([i]) for i in ids],
        token_ids=list(ids),
        target_id=att.target,
        target_token=tokenizer.decode([att.target]),
        position=len(ids) - 1,
        logit=att.logit,
        probability=float(torch.softmax(att.logits, -1)[att.target]),
        epsilon=epsilon,
        relevance=att.tokens.tolist(),
        bias=att.bias,
        absorbed=att.absorbed,
        layers=layers,
    )


def _target_id(target: str | int | None, tokenizer, vocab_size: int) -> int | None:
    if target is None or target == "next":
        return None
    if isinstance(target, int) and not isinstance(target, bool):
        if not 0 <= target < vocab_size:
            raise UsageError(f"target token id {target} is outside the vocabulary (0..{vocab_size - 1})")
        return target
    ids = tokenizer.encode(str(target))
    if len(ids) != 1:
        raise UsageError(f"target {target!r} is {len(ids)} tokens, not one: give a single token, or 'next'")
    if ids[0] >= vocab_size:
        raise UsageError(f"target {target!r} is token id {ids[0]}, outside the model's vocabulary of {vocab_size}")
    return ids[0]


def explain_checkpoint(
    checkpoint: Path,
    text: str,
    target: str | int | None = None,
    per_layer: bool = False,
    epsilon: float = 0.0,
    data_dir: Path | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
) -> ExplainResult:
    """`explain_tokens` on a checkpoint (a checkpoint dir, or a run dir: its newest good one),
    with the run's tokenizer: `tokenizer.json` in `data_dir` (default: the run's prepared data,
    as `rwkvx eval` finds it), else the byte or World tokenizer the config names."""
    opened = open_checkpoint(
        checkpoint,
        device="cpu",
        precision="fp32",
        data_dir=data_dir,
        on_skip=on_skip,
        check=lambda cfg: check_supported(layer_kinds(cfg.model)),  # before reading the weights
    )
    result = explain_tokens(opened.model, opened.tokenizer, text, target, per_layer, epsilon)
    result.checkpoint, result.step = str(opened.checkpoint.path), opened.step
    return result
