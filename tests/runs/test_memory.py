"""The training size check's estimate: under chunked BPTT a step keeps one chunk's activations."""

from rwkvx_cli.config import Config, ModelConfig, TrainConfig
from rwkvx_cli.runs.memory import parameter_count, training_bytes


def test_chunked_bptt_estimates_one_chunk_of_activations():
    model = ModelConfig(vocab_size=65_536, n_layer=2, n_embd=64, head_size=32)

    def need(ctx_len, chunk_len):
        cfg = Config(model=model, train=TrainConfig(ctx_len=ctx_len, micro_batch=1, chunk_len=chunk_len))
        return training_bytes(cfg, "fp32")[0]

    batch = lambda ctx: 2 * (ctx + 1) * 8  # noqa: E731 - the sampled token ids
    fixed = 16 * parameter_count(model)
    per_token = 2 * 65_536 * 4 + 2 * 64 * 4  # fp32 logits and log-probabilities, each block's input
    assert need(4096, 0) == fixed + 4096 * per_token + batch(4096)
    assert need(65_536, 4096) == fixed + 4096 * per_token + batch(65_536)  # not 65,536 tokens of logits
    assert need(1024, 4096) == need(1024, 0)  # a chunk longer than the window is the window
