"""An exported RWKV-X `.pth` run by RWKV-X's own inference package (PyPI `rwkv-x`, module
`rwkv_x.model`, class `RWKV_X`, CPU fp32 without its CUDA kernel) gives rwkvx's logits.

What that package computes, and so what can be compared (rwkv_x/model.py, rwkv-x 0.2.7):
- `prefill` (a list of tokens) runs the attention blocks as dense causal attention
  (`MemoryAttention.prefill`: scaled_dot_product_attention with a causal mask), not MoBA's chunk
  selection (that is in RWKV-X's training code, `pretrain/src/moba_efficient.py`, which needs
  flash-attn on CUDA). rwkvx's MoBA equals dense attention when top-k covers every earlier chunk,
  as in `hybrid_cfg` (16 tokens, chunk 4, top-k 3), so the hybrid is compared over a prefill.
- `decode` (one token) lets an attention block attend only the keys kept from the prefill
  (`memory_keep_tokens`), neither its own token nor the tokens decoded since, so a hybrid's
  token-by-token logits are by design not those of causal attention; token by token is compared
  for a plain RWKV-7 stack, where decode is the exact recurrence.
"""

import os

import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.formats import export_rwkv_x
from tests.formats.conftest import perturbed_model

os.environ.pop("RWKV_CUDA_ON", None)  # rwkv_x.model compiles its CUDA kernel at import when this is "1"
from rwkv_x.model import RWKV_X  # noqa: E402

TOKENS = [5, 17, 3, 96, 0, 42, 7, 7, 13, 200, 256, 1, 64, 64, 9, 128]


def rel_err(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    return ((theirs - ours).abs().max() / ours.abs().max()).item()


def test_rwkv_x_package_prefills_the_hybrid_export_with_our_logits(hybrid_cfg, tmp_path):
    model = perturbed_model(hybrid_cfg)
    out = tmp_path / "rwkv-x.pth"
    summary = export_rwkv_x(model.state_dict(), out, cfg=hybrid_cfg)
    assert summary["rwkv_x_args"]["moba_topk"] == hybrid_cfg.moba_top_k + 1
    theirs_model = RWKV_X(str(out), "cpu fp32")  # strict load of the moba.* tensors
    assert theirs_model.config.n_rwkv_layer == 4 and theirs_model.config.n_attn_layer == 2
    with torch.no_grad():
        ours, _ = model(torch.tensor([TOKENS]))
        theirs, _ = theirs_model.forward(TOKENS, None, full_output=True)
    assert rel_err(theirs, ours[0]) <= 1e-5
    assert rel_err(theirs, perturbed_model(hybrid_cfg, seed=4)(torch.tensor([TOKENS]))[0][0]) > 1e-2


def test_rwkv_x_package_runs_a_plain_rwkv7_export_token_by_token(tmp_path):
    cfg = ModelConfig(vocab_size=257, n_layer=3, n_embd=128, head_size=64)
    model = perturbed_model(cfg)
    out = tmp_path / "rwkv-x.pth"
    export_rwkv_x(model.state_dict(), out, cfg=cfg)
    theirs_model = RWKV_X(str(out), "cpu fp32")
    with torch.no_grad():
        ours, _ = model(torch.tensor([TOKENS]))
        seq, _ = theirs_model.forward(TOKENS, None, full_output=True)
        state, steps = None, []
        for t in TOKENS:
            logits, state = theirs_model.forward([t], state)
            steps.append(logits)
    assert rel_err(seq, ours[0]) <= 1e-5
    assert rel_err(torch.stack(steps), ours[0]) <= 1e-5
