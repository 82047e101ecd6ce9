"""The training engine: one config (``TrainConfig``), optimisers and schedules by name
(``OPTIMIZERS``, ``SCHEDULES``) and one loop with checkpoints, resume and metrics (``Trainer`` in a ``RunFolder``)."""

from . import dist
from .config import TrainConfig
from .optim import (OPTIMIZERS, SCHEDULES, autocast, lr_at, make_optimizer, peak_memory_mb, resolve_device,
                    software_versions)
from .run import RunFolder, read_metrics
from .trainer import Batches, Trainer

__all__ = ["dist", "TrainConfig", "Trainer", "RunFolder", "read_metrics", "Batches", "make_optimizer", "lr_at",
           "OPTIMIZERS", "SCHEDULES", "autocast", "resolve_device", "peak_memory_mb", "software_versions"]
