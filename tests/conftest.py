import torch

# Two cores on CI: keep torch from oversubscribing them.
torch.set_num_threads(min(2, torch.get_num_threads()))
