import pytest
import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models import build_model


def perturbed_model(cfg: ModelConfig, seed: int = 3):
    """A model whose every weight is moved away from its init (zeros included), so that a tensor
    mapped to the wrong place or layout changes the logits."""
    model = build_model(cfg, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture
def rwkv7_cfg():
    return ModelConfig(vocab_size=257, n_layer=2, n_embd=128, head_size=64)


@pytest.fixture
def hybrid_cfg():
    # Four RWKV-7 blocks around two MoBA blocks (RWKV-X's order); chunk 4 with top-k 3 over 16 tokens
    # selects every earlier chunk, so MoBA equals dense causal attention there.
    return ModelConfig(vocab_size=257, n_layer=4, n_embd=128, head_size=64, n_attn=2, moba_chunk=4, moba_top_k=3)


def shapes(sd):
    return {k: tuple(v.shape) for k, v in sd.items()}
