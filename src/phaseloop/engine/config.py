"""The engine's one configuration: optimiser, schedule, loop and checkpoint settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError
from ..validation import check_ints, check_types, strict_from_dict


@dataclass
class TrainConfig:
    """Settings of one training run, whatever it trains (an LM on a corpus, a task model
    on examples). AdamW with decoupled weight decay (on matrices; ``decay="all"``: on every
    parameter), linear warmup then cosine to ``min_lr_ratio * lr``, gradient-norm
    clipping, ``grad_accum`` micro-batches of ``batch_size`` per step. ``seq_len``,
    ``eval_windows`` and ``val_fraction`` shape the windows of a corpus
    (``phaseloop.train``); task runs leave them at their defaults."""

    steps: int = 600
    batch_size: int = 16
    grad_accum: int = 1
    seq_len: int | None = None  # None -> the model's max_seq_len
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of lr
    warmup_steps: int = 50
    weight_decay: float = 0.1  # on the parameters ``decay`` names
    decay: str = "matrices"  # matrices (dim >= 2) | all (every parameter: the 3PT author's AdamW)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 32
    ckpt_every: int = 100
    log_every: int = 10
    val_fraction: float = 0.1
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    compile: bool = False
    skip_nonfinite: int = 0  # non-finite steps skipped before the run stops (not applied)
    parallel: str = "ddp"  # under torchrun: ddp | fsdp (FSDP2 fully_shard per block, root last)
    checkpoint_activations: bool = False  # recompute each block's activations in backward
    peak_tflops: float | None = None  # per device, for MFU (default: known GPUs' bf16 peak)
    # targets equal to this id are left out of the loss, like -100 (the 3PT author's
    # CrossEntropyLoss(ignore_index=pad_id)); for (inputs, targets) batches of LM runs
    loss_ignore_id: int | None = None

    def __post_init__(self) -> None:
        what = "train config"
        check_types(self, what)
        check_ints(self, ("steps", "batch_size", "grad_accum", "eval_every", "eval_windows",
                          "ckpt_every", "log_every"), what)
        check_ints(self, ("seq_len",), what, optional=True)
        check_ints(self, ("loss_ignore_id",), what, minimum=0, optional=True)
        check_ints(self, ("warmup_steps", "seed", "skip_nonfinite"), what, minimum=0)
        if not self.lr > 0:
            raise ConfigError(f"invalid train config: lr={self.lr!r}: must be > 0")
        for name in ("min_lr_ratio", "weight_decay", "beta1", "beta2"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"invalid train config: {name}={getattr(self, name)!r}: must be in [0, 1]")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"invalid train config: val_fraction={self.val_fraction!r}: must be in (0, 1)")
        if not self.grad_clip > 0:
            raise ConfigError(f"invalid train config: grad_clip={self.grad_clip!r}: must be > 0")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"invalid train config: peak_tflops={self.peak_tflops!r}: must be > 0")
        if self.decay not in ("matrices", "all"):
            raise ConfigError(f"invalid train config: decay={self.decay!r}: choose matrices (weight decay "
                              "on dim >= 2 only) or all (every parameter, norm gains and 3PT angles too)")
        if self.parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"invalid train config: parallel={self.parallel!r}: choose ddp or fsdp")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ConfigError(f"invalid train config: device={self.device!r}: use auto, cpu or cuda[:N]")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return strict_from_dict(cls, d, "train config")

    def replace(self, **overrides) -> "TrainConfig":
        return TrainConfig.from_dict({**self.to_dict(), **overrides})
