"""The training engine: one config (``TrainConfig``), optimisers and schedules by name
(``OPTIMIZERS``, ``SCHEDULES``) and one loop with checkpoints, resume and metrics (``Trainer`` in a ``RunFolder``)."""

from phaseloop.engine import dist
from phaseloop.engine.config import TrainConfig
from phaseloop.engine.optim import (
    OPTIMIZERS,
    SCHEDULES,
    autocast,
    lr_at,
    make_optimizer,
    peak_memory_mb,
    resolve_device,
    software_versions,
)
from phaseloop.engine.run import RunFolder, read_metrics
from phaseloop.engine.trainer import Batches, Trainer

__all__ = ["dist", "TrainConfig", "Trainer", "RunFolder", "read_metrics", "Batches", "make_optimizer", "lr_at",
           "OPTIMIZERS", "SCHEDULES", "autocast", "resolve_device", "peak_memory_mb", "software_versions"]
