"""Run directories and what a command opens from them, and the runtime a command computes on. The
checkpoints themselves are checkpoints/'s, other tools' files formats/'s; both sit below this package.

    layout      where each file of a run directory is
    weights     weights into a model, from a checkpoint or from elsewhere (.safetensors, RWKV-LM .pth)
    tokenizers  the tokenizer of a run
    start_tokenizer  train.init_from's tokenizer, where the weights name one, against the run's
    data        a run's data: prepared once, opened with its checks
    runtime     device and precision, resolved once per command (Runtime)
    memory      what fits the device, checked before allocating
    lock        one writer per run directory
    opening     open_checkpoint: the one loader of eval, explain and export
    initial     train.init_from: the model other weights make, an upcycle's plan
    export      a checkpoint written for other tools (through formats/)
"""

from rwkvx_cli.runs.opening import Checkpoint, Opened, find_checkpoint, open_checkpoint
from rwkvx_cli.runs.runtime import Runtime, resolve

__all__ = ["Checkpoint", "Opened", "Runtime", "find_checkpoint", "open_checkpoint", "resolve"]
