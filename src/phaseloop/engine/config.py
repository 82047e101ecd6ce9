"""The engine's one configuration: optimiser, schedule, loop and checkpoint settings.

Each field carries its one line of help (and, for the enumerated strings, its choices)
in its metadata: ``phaseloop train``'s flags and ``--help`` are generated from them
(``cli.trainflags``), so a new field is a new flag."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from phaseloop.depth import parse_depth_range
from phaseloop.engine.optim import OPTIMIZERS, SCHEDULES
from phaseloop.engine.trackers import names as tracker_names
from phaseloop.errors import ConfigError
from phaseloop.validation import MAX_SEED, check_ints, check_types, strict_from_dict


def _f(default, help: str, choices=None, **more):
    """A field with its help; ``choices``: a tuple, or a function returning one (a registry);
    ``more``: other metadata (``max``: an integer field's largest value, validation.int_limit)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, **more})


def _optimizers() -> tuple[str, ...]:
    return tuple(OPTIMIZERS)


def _schedules() -> tuple[str, ...]:
    return tuple(SCHEDULES)


@dataclass
class TrainConfig:
    """Settings of one training run, whatever it trains (an LM on a corpus, a task model
    on examples). By default AdamW with decoupled weight decay (on matrices; ``decay="all"``:
    on every parameter), linear warmup then cosine to ``min_lr_ratio * lr``, gradient-norm
    clipping, ``grad_accum`` micro-batches of ``batch_size`` per step; ``optimizer`` and
    ``schedule`` name others (``engine.optim``'s registries). ``seq_len``, ``eval_windows``
    and ``val_fraction`` shape the windows of a corpus (``phaseloop.lm.train``); task runs
    leave them at their defaults."""

    steps: int = _f(600, "optimizer steps")
    batch_size: int = _f(16, "sequences per micro-batch")
    grad_accum: int = _f(1, "micro-batches per step")
    seq_len: int | None = _f(None, "training window (default: the model's max_seq_len)")
    lr: float = _f(1e-3, "peak learning rate")
    min_lr_ratio: float = _f(0.1, "the schedule's floor, as a fraction of lr")
    warmup_steps: int = _f(50, "linear warmup steps")
    schedule: str = _f("cosine", "cosine: warmup, then cosine to min_lr_ratio*lr; wsd: warmup, "
                       "constant lr, then a 1-sqrt decay to min_lr_ratio*lr over the last "
                       "decay_fraction of the steps", _schedules)
    decay_fraction: float = _f(0.2, "wsd: fraction of the steps in the final decay")
    optimizer: str = _f("adamw", "adamw: AdamW (beta1, beta2, decoupled weight decay)", _optimizers)
    weight_decay: float = _f(0.1, "weight decay (on the parameters --decay names)")
    decay: str = _f("matrices", "weight decay on: matrices (dim >= 2 only) or all (every parameter: "
                    "norm gains and 3PT angles too, as the 3PT author)", ("matrices", "all"))
    beta1: float = _f(0.9, "Adam's first-moment decay")
    beta2: float = _f(0.95, "Adam's second-moment decay")
    grad_clip: float = _f(1.0, "gradient-norm clip")
    seed: int = _f(0, "random seed", max=MAX_SEED)
    eval_every: int = _f(100, "steps between evaluations")
    eval_windows: int = _f(32, "validation windows per evaluation")
    ckpt_every: int = _f(100, "steps between checkpoints")
    log_every: int = _f(10, "steps between metric records")
    val_fraction: float = _f(0.1, "fraction of tokens held out")
    device: str = _f("auto", "auto | cpu | cuda[:N]")
    compile: str = _f("auto", "off | block: compile each block once, reused by every layer and pass "
                      "| model: the whole model | auto: block when the saving expected over the "
                      "run's steps beats the compile time, else off (engine/compiling.py)",
                      ("off", "block", "model", "auto"))
    skip_nonfinite: int = _f(0, "skip up to K steps whose loss or gradient is NaN/inf (not applied) "
                             "before stopping; 0: stop at the first")
    parallel: str = _f("ddp", "under torchrun: ddp, or fsdp (FSDP2 fully_shard per block, root last)",
                       ("ddp", "fsdp"))
    checkpoint_activations: bool = _f(False, "recompute each block's activations in backward "
                                      "(less memory, ~1/3 more compute)")
    peak_tflops: float | None = _f(None, "peak TFLOP/s of one device, for MFU (default: known GPUs' bf16 peak)")
    # windows holding several documents (LM runs: data.Documents)
    doc_mask: bool = _f(False, "attention only within a document (a window may span several)")
    doc_positions: bool = _f(False, "positions restart at 0 at each document start (RoPE, the 3PT "
                             "horn and the UT coordinate signal read them)")
    # the 3PT author's CrossEntropyLoss(ignore_index=pad_id); (inputs, targets) batches of LM runs
    loss_ignore_id: int | None = _f(None, "leave targets equal to this id (e.g. the pad id) out of the loss")
    # training for depth: engine.trainer runs each step under depth.sampled_depth
    depth_sample: str | None = _f(None, "LO:HI: run each training step at a depth drawn uniformly from "
                                  "LO..HI (UT steps, ACT: the step limit; loop passes), a function of seed "
                                  "and step; evaluation runs at the trained depth")
    extend_loops: str | None = _f(None, "with depth_sample past a Hyperloop's trained loops: last "
                                  "(reuse the last loop's parameters)", ("last",))
    log_to: str | None = _f(None, "experiment trackers to mirror metrics.jsonl to, comma-separated: "
                            "tensorboard, wandb (offline unless WANDB_MODE says otherwise)")
    init_from: str | None = _f(None, "start from the weights of another run (its folder or a checkpoint "
                               "folder): a new run, its own optimiser; the shapes must match")
    allow_new_tokenizer: bool = _f(False, "with init_from: accept another tokenizer of the same vocabulary size")
    keep_checkpoints: int = _f(1, "keep the last K checkpoints (RUN/checkpoint-<step>; 1: only the one resumed from)")
    keep_best: bool = _f(False, "keep the checkpoint of the lowest val_loss as RUN/best")

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Every field's type and range, at construction and again where training starts
        (``Trainer.setup``: a field may have been assigned since); one-line ConfigError."""
        what = "train config"
        check_types(self, what)
        for name, tp in typing.get_type_hints(TrainConfig).items():  # 1 -> 1.0: one spelling on disk
            if tp in (float, float | None) and isinstance(getattr(self, name), int):
                setattr(self, name, float(getattr(self, name)))
        check_ints(self, ("steps", "batch_size", "grad_accum", "eval_every", "eval_windows",
                          "ckpt_every", "log_every"), what)
        check_ints(self, ("seq_len",), what, optional=True)
        check_ints(self, ("loss_ignore_id",), what, minimum=0, optional=True)
        check_ints(self, ("warmup_steps", "seed", "skip_nonfinite"), what, minimum=0)
        check_ints(self, ("keep_checkpoints",), what)
        tracker_names(self.log_to)
        if self.init_from is not None and not self.init_from:
            raise ConfigError.invalid("init_from='': name a run folder or checkpoint folder", "train config")
        if self.allow_new_tokenizer and self.init_from is None:
            raise ConfigError.invalid("allow_new_tokenizer applies with init_from; add "
                              "--init-from RUN or drop it", "train config")
        if not self.lr > 0:
            raise ConfigError.invalid(f"lr={self.lr!r}: must be > 0", "train config")
        for name in ("min_lr_ratio", "weight_decay", "decay_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError.invalid(f"{name}={getattr(self, name)!r}: must be in [0, 1]", "train config")
        for name in ("beta1", "beta2"):  # a decay of 1 never forgets: torch's Adam refuses it
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError.invalid(f"{name}={getattr(self, name)!r}: must be in [0, 1)", "train config")
        if not 0 < self.val_fraction < 1:
            raise ConfigError.invalid(f"val_fraction={self.val_fraction!r}: must be in (0, 1)", "train config")
        if not self.grad_clip > 0:
            raise ConfigError.invalid(f"grad_clip={self.grad_clip!r}: must be > 0", "train config")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError.invalid(f"peak_tflops={self.peak_tflops!r}: must be > 0", "train config")
        for f in dataclasses.fields(self):
            allowed = choices(f.name)  # None: an optional field left unset (check_types refuses the rest)
            if allowed is not None and getattr(self, f.name) is not None and getattr(self, f.name) not in allowed:
                raise ConfigError.invalid(f"{f.name}={getattr(self, f.name)!r}: choose "
                                  f"{_one_of(allowed)} ({f.metadata['help']})", "train config")
        if self.schedule == "cosine" and self.decay_fraction != 0.2:
            raise ConfigError.invalid(f"decay_fraction={self.decay_fraction!r}: has no effect "
                              f"with schedule={self.schedule!r}; drop it or set schedule=wsd (--schedule wsd)",
                              "train config")
        if self.depth_sample is not None:
            parse_depth_range(self.depth_sample)
        elif self.extend_loops is not None:
            raise ConfigError.invalid(f"extend_loops={self.extend_loops!r}: applies with "
                              "depth_sample; set depth_sample=LO:HI (--depth-sample) or drop it", "train config")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ConfigError.invalid(f"device={self.device!r}: use auto, cpu or cuda[:N]", "train config")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        if isinstance(d.get("compile"), bool):  # runs of 0.1 wrote compile as true/false (the whole model)
            d = {**d, "compile": "model" if d["compile"] else "off"}
        return strict_from_dict(cls, d, "train config")

    def replace(self, **overrides) -> TrainConfig:
        return TrainConfig.from_dict({**self.to_dict(), **overrides})


def _one_of(names) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def choices(name: str) -> tuple[str, ...] | None:
    """The values a TrainConfig field may take (None: not an enumerated field)."""
    c = TrainConfig.__dataclass_fields__[name].metadata.get("choices")
    return c() if callable(c) else c
