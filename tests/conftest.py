import os

import torch

# Two cores on CI: keep torch from oversubscribing them.
torch.set_num_threads(min(2, torch.get_num_threads()))

# Without a GPU, run the Triton kernels through Triton's interpreter on CPU tensors.
# Must be set before any kernel module is imported (the decorator reads it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small text corpus: 400 short lines."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    lines = [f"line {i}: the quick brown fox {i % 7} jumps over the lazy dog {i % 5}." for i in range(400)]
    path.write_text("\n".join(lines) + "\n")
    return path
