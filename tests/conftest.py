import os

import torch

# Two cores on CI: keep torch from oversubscribing them.
torch.set_num_threads(min(2, torch.get_num_threads()))

# Without a GPU, run the Triton kernels through Triton's interpreter on CPU tensors.
# Must be set before any kernel module is imported (the decorator reads it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
