"""train.head / train.l2wrap / train.grad_cp: the chunked head with activation checkpointing trains
the same losses as the materialised logits (L2Wrap on in both), and bad values are refused."""

from tests.train.helpers import losses, run_cli, tiny_args


def _corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(300)))
    return corpus


def test_chunked_head_and_grad_cp_train_the_same_losses_as_full_logits(tmp_path):
    corpus = _corpus(tmp_path)
    runs = {}
    for name, extra in (
        ("full", ["train.head=full", "train.l2wrap=true"]),
        ("chunked", ["train.head=chunked", "train.l2wrap=true", "train.grad_cp=true"]),
    ):
        r = run_cli("train", *tiny_args(tmp_path / name, corpus, *extra))
        assert r.returncode == 0, r.stderr
        runs[name] = losses(tmp_path / name)
    assert len(runs["full"]) == len(runs["chunked"]) == 10
    for a, b in zip(runs["full"], runs["chunked"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (a, b)


def test_bad_head_and_l2wrap_values_are_one_line_errors(tmp_path):
    for key in ("train.head=fused", "train.l2wrap=maybe"):
        r = run_cli("init", *tiny_args(tmp_path / "run", _corpus(tmp_path), key))
        assert r.returncode == 2, r.stderr
        assert key.split("=")[0] in r.stderr and "Traceback" not in r.stderr
