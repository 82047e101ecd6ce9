"""Optimisers and learning-rate schedules (by name: ``OPTIMIZERS``, ``SCHEDULES``), device
and precision."""

from __future__ import annotations

import contextlib
import math
import platform
import re
import resource
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from phaseloop import registry
from phaseloop._version import __version__
from phaseloop.errors import ConfigError

if TYPE_CHECKING:  # the config names these registries; the functions take one
    from phaseloop.engine.config import TrainConfig


def cosine(step: int, tc: TrainConfig) -> float:
    """Linear warmup to lr, then cosine to min_lr_ratio * lr at step ``tc.steps``."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    span = max(1, tc.steps - tc.warmup_steps)
    progress = min(1.0, (step - tc.warmup_steps) / span)
    floor = tc.lr * tc.min_lr_ratio
    return floor + (tc.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def wsd(step: int, tc: TrainConfig) -> float:
    """Warmup-stable-decay: linear warmup to lr, lr held, then over the last
    ``decay_fraction`` of the steps (from step S = steps - round(decay_fraction * steps),
    not before the warmup ends) a "1-sqrt" cooldown to min_lr_ratio * lr at step
    ``tc.steps``: lr_t = floor + (lr - floor) (1 - sqrt((t - S) / (steps - S))). The
    1-sqrt shape and the 20 % default are Hägele et al. 2024, "Scaling Laws and
    Compute-Optimal Training Beyond Fixed Training Durations" (arXiv 2405.18392: 1-sqrt
    beat a linear cooldown, and a 20 % cooldown matched cosine); the schedule itself is
    MiniCPM's (Hu et al. 2024, arXiv 2404.06395)."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    start = max(tc.warmup_steps, tc.steps - round(tc.decay_fraction * tc.steps))
    if step < start:
        return tc.lr
    progress = min(1.0, (step - start) / max(1, tc.steps - start))
    floor = tc.lr * tc.min_lr_ratio
    return floor + (tc.lr - floor) * (1 - math.sqrt(progress))


def param_groups(model: torch.nn.Module, tc: TrainConfig) -> list[dict]:
    """``decay="matrices"``: weight decay on matrices only (dim >= 2; norms, angles,
    biases, gains are not decayed), two groups; ``decay="all"``: one group, every
    parameter decayed (the 3PT author's script: over its 30k cosine steps at lr 3e-4,
    wd 0.1 the decay alone scales every θ by prod(1 - lr_t wd) ≈ 0.6)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if tc.decay == "all":
        return [{"params": params, "weight_decay": tc.weight_decay}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def adamw(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW on ``param_groups``: fused on CUDA, foreach (multi-tensor) elsewhere."""
    groups = param_groups(model, tc)
    cuda = any(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=1e-8,
                             **({"fused": True} if cuda else {"foreach": True}))


# The registries TrainConfig.optimizer / .schedule name (and the CLI's choices list):
# add an entry, from anywhere, to offer another; the Trainer sets each group's lr every step.
OPTIMIZERS: dict[str, Callable[[torch.nn.Module, TrainConfig], torch.optim.Optimizer]] = {"adamw": adamw}
SCHEDULES: dict[str, Callable[[int, TrainConfig], float]] = {"cosine": cosine, "wsd": wsd}


def lr_at(step: int, tc: TrainConfig) -> float:
    """The learning rate of step ``step`` (0-based) under ``tc.schedule``."""
    return SCHEDULES[tc.schedule](step, tc)


def make_optimizer(model: torch.nn.Module, tc: TrainConfig) -> torch.optim.Optimizer:
    """``tc.optimizer`` over ``model``'s trainable parameters."""
    return OPTIMIZERS[tc.optimizer](model, tc)


def resolve_device(name: str, what: str = "--device") -> torch.device:
    """``name`` (auto, cpu, cuda[:N]) as a device; ``what`` names the setting in a refusal."""
    fix = "--device cpu" if what == "--device" else "cpu"
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(name, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ConfigError(f"{what} {name!r}: use auto, cpu or cuda[:N]")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{what} {name!r}: no CUDA device here; use {fix}")
    return torch.device(name)


@contextlib.contextmanager
def tf32(on: bool):
    """torch's TF32 switches for CUDA's fp32 matmuls and convolutions (Ampere and later; no
    effect elsewhere) set to ``on`` while the block runs, restored after: training steps
    take TF32 for the fp32 products autocast leaves; evaluation, decoding and GPTQ keep
    full fp32 (its Hessian, as the reference implementation does)."""
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    was = [f.allow_tf32 for f in flags]
    for f in flags:
        f.allow_tf32 = on
    try:
        yield
    finally:
        for f, w in zip(flags, was):
            f.allow_tf32 = w


def autocast(device: torch.device):
    """bf16 autocast on CUDA only; fp32 on CPU (bf16 matmuls are ~50x slower there)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20


def software_versions(arch: str | None = None) -> dict:
    """What a run was made with; ``arch``'s plugin package (``arch_plugin``), where an
    installed plugin registered it, so a reader without it can say what to install."""
    plugin = registry.provider(arch) if arch is not None else None
    return {"phaseloop": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), **({"arch_plugin": plugin} if plugin else {})}


def available_memory(device: torch.device) -> int | None:
    """Bytes free for tensors on ``device``: CUDA's free memory, Linux's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**50 else f"{n / 2**50:,.3g} PiB"


def check_memory(model: torch.nn.Module, device: torch.device, bytes_per_param: int, what: str) -> None:
    """Refuse, before allocating, a model (built on the meta device) whose parameters
    alone need more than ``device`` has: 16 bytes a parameter to train with AdamW in
    fp32 (weights, gradients, two moments), 4 to evaluate."""
    n = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    need, free = n * bytes_per_param, available_memory(device)
    if free is not None and need > free:
        raise ConfigError(f"the model has {n:,} parameters; {what} it needs at least {_gib(need)} "
                          f"on {device} ({bytes_per_param} bytes a parameter) and {_gib(free)} are "
                          "available; choose a smaller model (d_model, n_layers, vocab_size)")


def check_forward_memory(cfg, batch_size: int, seq_len: int, device: torch.device, flag: str,
                         held_tokens: int = 0) -> None:
    """Refuse, before running it, a forward pass without gradients (GPTQ calibration)
    whose activations alone need more than ``device`` has, as ``check_memory`` does for
    the weights: at least 4 bytes a token for each of the logits (``vocab_size``), the
    widest layer (``2 d_ff`` + ``4 d_model``) and the attention scores (``n_heads x
    seq_len``), plus 8 bytes for each of ``held_tokens`` token ids kept in memory. A lower
    bound: what it refuses cannot run; ``flag`` names the option to lower."""
    per_token = 4 * (cfg.vocab_size + 2 * cfg.d_ff + 4 * cfg.d_model + cfg.n_heads * seq_len)
    need, free = batch_size * seq_len * per_token + 8 * held_tokens, available_memory(device)
    if free is not None and need > free:
        fits = max(0, (free - 8 * held_tokens) // (seq_len * per_token))
        raise ConfigError(f"{flag} {batch_size:,}: a batch of {batch_size:,} windows of {seq_len} tokens needs at "
                          f"least {_gib(need)} on {device} (logits, the widest layer, attention scores) and "
                          f"{_gib(free)} are available; use {flag} {min(fits, batch_size - 1) or 1} or less")
