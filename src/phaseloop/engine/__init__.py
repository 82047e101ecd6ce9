"""The training engine: one config (``TrainConfig``), one optimiser/schedule factory and
one loop with checkpoints, resume and metrics (``Trainer`` in a ``RunFolder``)."""

from . import dist
from .config import TrainConfig
from .optim import autocast, lr_at, make_optimizer, peak_memory_mb, resolve_device, software_versions
from .run import RunFolder, read_metrics
from .trainer import Batches, Trainer

__all__ = ["dist", "TrainConfig", "Trainer", "RunFolder", "read_metrics", "Batches", "make_optimizer", "lr_at", "autocast",
           "resolve_device", "peak_memory_mb", "software_versions"]
