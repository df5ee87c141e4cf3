"""Runs and checkpoints on disk, and the runtime a command computes on.

    layout      where each file of a run directory is
    store       checkpoint directories: written atomically, verified by checksum, newest good first
    weights     weights into a model, from a checkpoint or from elsewhere (.safetensors, RWKV-LM .pth)
    tokenizers  the tokenizer of a run
    start_tokenizer  train.init_from's tokenizer, where the weights name one, against the run's
    data        a run's data: prepared once, opened with its checks
    runtime     device and precision, resolved once per command (Runtime)
    memory      what fits the device, checked before allocating
    lock        one writer per run directory
    opening     open_checkpoint: the one loader of eval, explain and export
    export      a checkpoint written for other tools
    formats     the HF (fla) and RWKV-X layouts, size inference from tensors, the upcycle plan
"""

from rwkvx_cli.runs.opening import Checkpoint, Opened, find_checkpoint, open_checkpoint
from rwkvx_cli.runs.runtime import Runtime, resolve

__all__ = ["Checkpoint", "Opened", "Runtime", "find_checkpoint", "open_checkpoint", "resolve"]
