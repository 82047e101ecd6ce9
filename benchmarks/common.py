"""Shared timing helpers for the benchmark scripts: ratios are measured side by side in
one process, interleaving the models so drift in machine load hits all of them alike."""

from __future__ import annotations

import statistics
import time

import torch

from phaseloop import ModelConfig, build_model
from phaseloop.engine import TrainConfig, make_optimizer


def train_step_fn(cfg: ModelConfig, batch: int, seq: int, seed: int = 0):
    """A closure running one full training step (forward + backward + AdamW)."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    opt = make_optimizer(model, TrainConfig())
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    y = torch.randint(0, cfg.vocab_size, (batch, seq))

    def step():
        loss = model(x, y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def time_interleaved(fns: dict, warmup: int = 2, rounds: int = 7, reps: int = 3) -> dict:
    """Median seconds per call of each fn, measured round-robin."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            samples[k].append((time.perf_counter() - t0) / reps)
    return {k: statistics.median(v) for k, v in samples.items()}
