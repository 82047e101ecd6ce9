"""What experiment trackers (``--log-to``) cost a training step (issue 28: under 1 %).

Side by side in one process, interleaved (medians): ``--log-every`` full training steps
(forward, backward, clip, AdamW) alone, and the same steps followed by the record the
trainer then writes, sent to TensorBoard (SummaryWriter), to W&B (offline) and to both.
The ratio is the time per step with the tracker over the time without; the trackers'
one-off costs (opening: W&B starts its service, ~seconds) are printed apart.

    python benchmarks/bench_trackers.py                      # rope-small, batch 16 x 128
    python benchmarks/bench_trackers.py --preset rope-tiny --batch 2 --seq 16 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import time_interleaved, train_step_fn

from phaseloop import ModelConfig
from phaseloop.engine.trackers import Trackers

VARIANTS = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb", "both": "tensorboard,wandb"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="rope-small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--log-every", type=int, default=10, help="steps per record (TrainConfig's default 10)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    cfg = ModelConfig.from_preset(args.preset, max_seq_len=args.seq)
    step = train_step_fn(cfg, args.batch, args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        trackers, opened = {}, {}
        for name, log_to in VARIANTS.items():
            t0 = time.perf_counter()
            trackers[name] = Trackers.open(log_to, Path(tmp) / name, 0, {"bench": name}) if log_to else Trackers()
            opened[name] = time.perf_counter() - t0
        count = {"n": 0}

        def run(name):
            def fn():
                for _ in range(args.log_every):
                    step()
                count["n"] += 1  # a record as the trainer writes it (a step W&B has not seen)
                n = count["n"]
                trackers[name].log({"step": n, "loss": 3.0 + 1 / n, "lr": 1e-3, "grad_norm": 0.5, "tokens": 1000 * n,
                                    "tok_per_s": 1e4, "elapsed_s": 0.1 * n})
            return fn

        times = time_interleaved({k: run(k) for k in VARIANTS}, warmup=1, rounds=args.rounds, reps=1)
        for t in trackers.values():
            t.close()
    base = times["none"] / args.log_every
    print(f"{args.preset}, batch {args.batch} x {args.seq}, a record every {args.log_every} steps "
          f"(medians of {args.rounds} interleaved rounds; {torch.get_num_threads()} threads)")
    print(f"{'trackers':<12} {'ms/step':>9} {'ratio':>7} {'overhead':>9} {'open (s)':>9}")
    for k in VARIANTS:
        per = times[k] / args.log_every
        print(f"{k:<12} {per * 1e3:>9.2f} {per / base:>7.4f} {100 * (per / base - 1):>8.2f}% {opened[k]:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
