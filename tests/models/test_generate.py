"""Generation reads each token once: a model with MoBA blocks attends its cached keys and values
instead of re-reading its context, and gives the logits re-reading would."""

import torch

from rwkvx_cli.config import ModelConfig
from rwkvx_cli.models import build_model
from rwkvx_cli.models.generate import generate

V = 64


def hybrid():
    cfg = ModelConfig(vocab_size=V, n_layer=2, n_attn=1, n_embd=64, head_size=32, moba_chunk=4, moba_top_k=1)
    model = build_model(cfg, 0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # init zeroes the output projections: every block would be the identity
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_a_hybrid_read_one_token_at_a_time_gives_the_whole_read_s_logits():
    model = hybrid()
    assert model.kinds == ["rwkv7", "rwkv7", "moba"]
    idx = torch.randint(0, V, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole, _ = model(idx)
        state, steps = None, []
        for t in range(idx.shape[1]):
            logits, state = model(idx[:, t : t + 1], state)
            steps.append(logits)
        pieces, state2 = [], None
        for lo, hi in ((0, 9), (9, 10), (10, 23)):
            logits, state2 = model(idx[:, lo:hi], state2)
            pieces.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-4, atol=1e-5)
    assert state[2]["k"][0].shape == (2, 23, 2, 32)  # MoBA's state: every token's keys
    # The attention matters: the last position's logits differ once the earlier tokens change.
    with torch.no_grad():
        other, _ = model(torch.cat([(idx[:, :-1] + 1) % V, idx[:, -1:]], 1))
    assert (other[:, -1] - whole[:, -1]).abs().max() > 1e-3


def test_generate_reads_the_prompt_once_then_one_token_per_step():
    model = hybrid()
    lengths = []
    hook = model.register_forward_pre_hook(lambda mod, args: lengths.append(args[0].shape[1]))
    prompt = list(range(1, 12))
    try:
        out = generate(model, prompt, 8, temperature=0.0)
    finally:
        hook.remove()
    assert lengths == [len(prompt)] + [1] * 8
    # The same tokens as re-reading the whole context for each one (what generation did before).
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    assert out == ids[len(prompt) :]
