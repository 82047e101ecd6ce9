"""Training-step time and parameter memory of Transformer, mHC, Looped and Hyperloop.

Ratios are measured side by side in one process: the models' timed steps are
interleaved round by round and each model's median step time is used. On a shared CPU
wall-clock time swings with the neighbours' load, so the default measure is the
process's CPU time with one intra-op thread (``--clock wall --threads N`` for wall time). Targets (issue 6; the paper's GPU numbers in brackets):

    hyperloop / looped      <= 1.05   (paper 1.05)
    mhc / transformer       <= 1.20   (paper 1.53 unfused, 1.07 fused kernels)
    looped / transformer    ~= 1.0    (equal depth)

Memory: bytes of every parameter at fp32, and after weight-only quantisation of every
Linear except the embedding and the head (``quant.default_skip``), counted packed
(bits/8 per weight + fp16 scale and zero per group) by ``quant.packed_bytes``.

    python benchmarks/bench_hyperloop.py                 # *-small presets, ~2 min on 2 cores
    python benchmarks/bench_hyperloop.py --size tiny --rounds 3
    python benchmarks/bench_hyperloop.py --set d_model=256 --set d_ff=704   # wider
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from phaseloop import ModelConfig, build_model
from phaseloop.quant import default_skip, packed_bytes
from phaseloop.train import TrainConfig, make_optimizer

ARCHS = ("transformer", "mhc", "looped", "hyperloop")


def param_bytes(cfg: ModelConfig, bits: int | None = None, group_size: int = 128) -> int:
    """Parameter bytes (fp32), or with the quantisable Linears packed at ``bits``."""
    model = build_model(cfg, device="meta")
    total = sum(p.numel() * 4 for p in model.parameters())
    if bits is None:
        return total
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not default_skip(name, mod):
            g = group_size if mod.in_features % group_size == 0 else mod.in_features
            total += packed_bytes(mod.out_features, mod.in_features, bits, g) - mod.weight.numel() * 4
    return total


def step_times(cfgs: dict, batch: int, seq: int, rounds: int, steps: int,
               clock=time.process_time) -> dict:
    """Median seconds per AdamW training step (forward + backward + update) per model."""
    torch.manual_seed(0)
    runs = {}
    for name, cfg in cfgs.items():
        model = build_model(cfg).train()
        opt = make_optimizer(model, TrainConfig(lr=1e-4))
        runs[name] = (model, opt)
    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))

    def step(model, opt):
        model(x, y).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for model, opt in runs.values():  # warm-up (allocator, AdamW state)
        for _ in range(2):
            step(model, opt)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (model, opt) in runs.items():
            t0 = clock()
            for _ in range(steps):
                step(model, opt)
            times[name].append((clock() - t0) / steps)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="default: the preset's max_seq_len")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3, help="steps per model per round")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a field of all four timed configs, e.g. d_model=256")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    over = {k: json.loads(v) for k, _, v in (kv.partition("=") for kv in args.set or [])}
    cfgs = {a: ModelConfig.from_preset(f"{a}-{args.size}", **over) for a in ARCHS}
    seq = args.seq or cfgs["transformer"].max_seq_len
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    t = step_times(cfgs, args.batch, seq, args.rounds, args.steps, clock)
    ratios = {"hyperloop/looped": t["hyperloop"] / t["looped"],
              "mhc/transformer": t["mhc"] / t["transformer"],
              "looped/transformer": t["looped"] / t["transformer"]}
    targets = {"hyperloop/looped": "<= 1.05 (paper 1.05)",
               "mhc/transformer": "<= 1.20 (paper 1.53 unfused / 1.07 fused)",
               "looped/transformer": "~= 1.0"}
    mem = {}
    for size in ("240m", args.size):
        for a in ARCHS:
            cfg = ModelConfig.from_preset(f"{a}-{size}")
            mem[f"{a}-{size}"] = {"params": sum(p.numel() for p in build_model(cfg, "meta").parameters()),
                                  "fp32": param_bytes(cfg), "int8": param_bytes(cfg, 8),
                                  "int4": param_bytes(cfg, 4)}
    if args.json:
        print(json.dumps({"step_s": t, "ratios": ratios, "memory_bytes": mem,
                          "batch": args.batch, "seq": seq, "threads": torch.get_num_threads()}, indent=2))
        return
    print(f"training step ({args.clock} time), {args.size} presets {over or ''}, batch "
          f"{args.batch} x seq {seq}, fp32, {torch.get_num_threads()} threads, median of "
          f"{args.rounds} interleaved rounds")
    for a in ARCHS:
        print(f"  {a:<12} {t[a] * 1e3:8.1f} ms/step  {args.batch * seq / t[a]:9.0f} tok/s")
    for k, v in ratios.items():
        print(f"  {k:<20} {v:6.3f}   target {targets[k]}")
    print("parameter memory (MB; int8/int4: Linears other than embedding/head packed, group 128)")
    print(f"  {'preset':<20}{'params':>12}{'fp32':>10}{'int8':>10}{'int4':>10}")
    for name, r in mem.items():
        print(f"  {name:<20}{r['params']:>12,}{r['fp32'] / 1e6:>10.2f}{r['int8'] / 1e6:>10.2f}"
              f"{r['int4'] / 1e6:>10.2f}")


if __name__ == "__main__":
    main()
