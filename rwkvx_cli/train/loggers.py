"""Where the metrics of each step go (train.loggers): the loop calls one `Sinks` object.

    jsonl        <run>/metrics.jsonl (train/metrics.py): fsynced before checkpoints, cut back on resume
    tensorboard  event files under <run>/tensorboard/ (torch.utils.tensorboard's SummaryWriter)
    wandb        a Weights & Biases run under <run>/wandb/ (WANDB_MODE=offline works without a network)

Only rank 0 logs. tensorboard and wandb are optional extras: `check_available` refuses a sink whose
package is missing with the pip command that installs it, before anything else of the run happens.
Also here: the matmul peak the MFU figure divides by, measured once per process and device.
"""

from __future__ import annotations

import importlib
import math
import netrc
import os
import urllib.parse
from pathlib import Path
from typing import Protocol

from rwkvx_cli.config import LOGGERS, Config, ConfigError, config_to_dict
from rwkvx_cli.errors import RwkvxError
from rwkvx_cli.train import distributed
from rwkvx_cli.train.metrics import MetricsLog, StepMetrics

# The package each optional sink imports, and the extra of rwkvx that installs it.
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}
WANDB_TIMEOUT = 30  # seconds wandb.init waits for its server (its default, 90, looks like a hang)

# The scalars the tensorboard and wandb sinks log each step (StepMetrics fields), under train/ or val/.
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu_pct", "peak_mem_mb", "epoch")


def check_available(loggers: list[str]) -> None:
    """A ConfigError naming the pip command for the first requested sink whose package is missing."""
    for name in loggers:
        if name not in LOGGERS:
            raise ConfigError(f"train.loggers: unknown logger {name!r}")
        package = EXTRAS.get(name)
        if package is None:
            continue
        try:
            importlib.import_module(package)
        except ImportError:
            raise ConfigError(
                f"train.loggers: {name} is not installed; install it with: pip install 'rwkvx[{package}]'"
            ) from None
    if "wandb" in loggers and not _wandb_can_log():
        raise ConfigError(
            "train.loggers: wandb has no API key here (WANDB_API_KEY, or `wandb login`); "
            "set WANDB_MODE=offline to log locally and `wandb sync` later"
        )


def _wandb_can_log() -> bool:
    """Whether wandb may start without asking for a key (it would prompt, or fail, mid-start-up)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc().authenticators(host or "api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Sink(Protocol):
    def open(self, start_step: int) -> None: ...  # the loop is about to run steps after start_step
    def log(self, m: StepMetrics) -> None: ...
    def sync(self) -> None: ...  # before a checkpoint: what was logged reaches the disk
    def close(self) -> None: ...


class JsonlSink:
    """metrics.jsonl through the trainer's MetricsLog (which also sets aside and truncates the file)."""

    def __init__(self, log: MetricsLog):
        self.metrics = log

    def open(self, start_step: int) -> None:
        self.metrics.__enter__()

    def log(self, m: StepMetrics) -> None:
        self.metrics.append(m)

    def sync(self) -> None:
        self.metrics.sync()

    def close(self) -> None:
        self.metrics.__exit__(None, None, None)


def _scalars(m: StepMetrics) -> dict[str, float]:
    out = {}
    for key in SCALARS:
        value = getattr(m, key)
        if value is not None and math.isfinite(value):
            out[f"train/{key}"] = float(value)
    for key, value in (("loss", m.val_loss), ("bpb", m.val_bpb)):
        if value is not None and math.isfinite(value):
            out[f"val/{key}"] = float(value)
    return out


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / "tensorboard"
        self.writer = None

    def open(self, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # On resume, events a crashed attempt logged after the checkpoint are hidden (purge_step).
        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=start_step + 1 if start_step else None)

    def log(self, m: StepMetrics) -> None:
        for key, value in _scalars(m).items():
            self.writer.add_scalar(key, value, global_step=m.step)

    def sync(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbSink:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.run = None

    def open(self, start_step: int) -> None:
        import wandb

        t = self.cfg.train
        try:
            self.run = wandb.init(
                project=t.wandb_project,
                name=t.wandb_name or self.run_dir.resolve().name,
                dir=str(self.run_dir),
                config=config_to_dict(self.cfg),
                settings=wandb.Settings(console="off", x_disable_stats=True, init_timeout=WANDB_TIMEOUT),
            )
        except Exception as e:  # noqa: BLE001 - wandb's own errors (CommError, UsageError, ...) are not ours
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RwkvxError(
                f"wandb could not start its run ({type(e).__name__}: {first}); check the network or the key, "
                "or set WANDB_MODE=offline"
            ) from None

    def log(self, m: StepMetrics) -> None:
        self.run.log({**_scalars(m), "train/tokens": m.tokens}, step=m.step)

    def sync(self) -> None:
        pass  # wandb writes in its own process

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class Sinks:
    """The sinks of train.loggers on rank 0 (none on the other ranks); a context manager around the loop."""

    def __init__(self, cfg: Config, run_dir: Path, metrics: MetricsLog, is_main: bool = True):
        self.sinks: list[Sink] = []
        self.start_step = 0
        if not is_main:
            return
        for name in cfg.train.loggers:
            if name == "jsonl":
                self.sinks.append(JsonlSink(metrics))
            elif name == "tensorboard":
                self.sinks.append(TensorBoardSink(run_dir))
            elif name == "wandb":
                self.sinks.append(WandbSink(cfg, run_dir))

    def __enter__(self) -> Sinks:
        distributed.agreed(self._open)  # rank 0's (wandb may refuse to start): a failure stops every rank
        return self

    def _open(self) -> None:
        opened = []
        try:
            for sink in self.sinks:
                sink.open(self.start_step)
                opened.append(sink)
        except BaseException:
            for sink in reversed(opened):
                sink.close()
            raise

    def __exit__(self, *exc) -> None:
        for sink in reversed(self.sinks):
            sink.close()

    def log(self, m: StepMetrics) -> None:
        for sink in self.sinks:
            sink.log(m)

    def sync(self) -> None:
        for sink in self.sinks:
            sink.sync()


# -- MFU ----------------------------------------------------------------------------------------------

def mfu_pct(tokens_per_s: float, train_flops_per_token: float, peak_gflops: float, world_size: int = 1) -> float:
    """Model FLOPs utilisation, as `rwkvx bench --model` computes it: tokens/s x train FLOPs per token
    over the matmul peak of every device training (tokens/s counts the global batch)."""
    if not (peak_gflops > 0 and math.isfinite(peak_gflops)):
        return float("nan")
    return tokens_per_s * train_flops_per_token / (peak_gflops * 1e9 * world_size) * 100
