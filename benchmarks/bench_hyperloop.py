"""Training-step time of mHC and Hyperloop, eager and compiled, against their baselines
(Transformer, Looped), and parameter memory of the four.

The hyper-connection maths (``hyperconn.HyperConnection``) is plain torch ops, timed

    torch      eagerly
    compiled   under ``torch.compile(model, fullgraph=True)``

(Hand-written autograd functions and fused C++ kernels for it were timed with this
script too, side by side, and removed by that measurement: docs/hyperloop.md.)

Ratios are measured side by side in one process: the models' timed steps are
interleaved round by round and each model's fastest step is used (interference only
adds time). On a shared CPU wall-clock time swings with the neighbours' load, so the
default measure is the process's CPU time with one intra-op thread (``--clock wall
--threads N`` for wall time). Compile time is reported apart (the first step).

Targets (the paper's GPU numbers in brackets): hyperloop / looped <= 1.05 (1.05),
mhc / transformer <= 1.20 (1.53 unfused, 1.07 fused), looped / transformer ~= 1.0.

Shapes: the *-small presets (d 128: the elementwise stream work, O(n d) per token per
connection, is large next to the matmuls, O(d^2)), widened to d 512 and to the paper's
d 1024 (same depth 8 and split; ``--widths``).

    python benchmarks/bench_hyperloop.py                   # d 128 / 512 / 1024, ~30 min
    python benchmarks/bench_hyperloop.py --widths 128 --paths torch          # ~1 min
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from phaseloop import ModelConfig, build_model
from phaseloop.engine import TrainConfig, make_optimizer
from phaseloop.quant import default_skip, packed_bytes

ARCHS = ("transformer", "mhc", "looped", "hyperloop")
# width -> (overrides of the *-small presets, batch, seq, rounds)
SHAPES = {128: ({}, 8, 128, 12),
          512: (dict(d_model=512, n_heads=8, n_kv_heads=8, d_ff=1408), 16, 64, 6),
          1024: (dict(d_model=1024, n_heads=16, n_kv_heads=16, d_ff=2816), 16, 64, 3)}


PATHS = ("torch", "compiled")


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


def step_times(cfgs: dict, batch: int, seq: int, rounds: int, clock) -> tuple[dict, dict]:
    """Per model (name -> (config, path)): seconds of its fastest AdamW training step of
    ``rounds`` interleaved ones, and the seconds of its first step (compilation)."""
    torch.manual_seed(0)
    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))
    runs = {}
    for name, (cfg, path) in cfgs.items():
        model = build_model(cfg).train()
        fwd = torch.compile(model, fullgraph=True) if path == "compiled" else model
        runs[name] = (fwd, make_optimizer(model, TrainConfig(lr=1e-4)))

    def step(fwd, opt):
        fwd(x, y).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first = {}
    for name, (fwd, opt) in runs.items():  # warm-up: compilation, AdamW state
        t0 = time.perf_counter()
        step(fwd, opt)
        first[name] = time.perf_counter() - t0
        step(fwd, opt)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (fwd, opt) in runs.items():
            t0 = clock()
            step(fwd, opt)
            times[name].append(clock() - t0)
    return {name: min(ts) for name, ts in times.items()}, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="128,512,1024")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of torch,compiled")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default per width: 12 / 6 / 3)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    paths = args.paths.split(",")
    results = {}
    for width in (int(w) for w in args.widths.split(",")):
        over, batch, seq, rounds = SHAPES[width]
        cfgs = {a: (ModelConfig.from_preset(f"{a}-small", **over), "torch") for a in ("transformer", "looped")}
        for a in ("mhc", "hyperloop"):
            for path in paths:
                cfgs[f"{a}:{path}"] = (ModelConfig.from_preset(f"{a}-small", **over), path)
        t, first = step_times(cfgs, batch, seq, args.rounds or rounds, clock)
        ratios = {f"{a}/{base} {p}": t[f"{a}:{p}"] / t[base] for a, base in (("mhc", "transformer"),
                  ("hyperloop", "looped")) for p in paths if f"{a}:{p}" in t}
        results[width] = {"step_s": t, "first_step_s": first, "batch": batch, "seq": seq,
                          "ratios": ratios | {"looped/transformer": t["looped"] / t["transformer"]}}
        r = results[width]
        print(f"d {width}: training step ({args.clock} time), batch {batch} x seq {seq}, fp32, "
              f"{torch.get_num_threads()} threads, fastest of {args.rounds or rounds} interleaved rounds",
              flush=True)
        for name, s in t.items():
            print(f"  {name:<22} {s * 1e3:9.1f} ms/step  {batch * seq / s:8.0f} tok/s   "
                  f"first step {first[name]:6.1f} s", flush=True)
        for k, v in r["ratios"].items():
            print(f"  {k:<30} {v:6.3f}", flush=True)
        for a in ("mhc", "hyperloop"):
            for p in paths:
                if "compiled" in paths and p != "compiled" and f"{a}:{p}" in t:
                    print(f"  {a} {p} / compiled {'':<12} {t[f'{a}:{p}'] / t[f'{a}:compiled']:6.3f}")
    mem = {}
    for size in ("240m", "small"):
        for a in ARCHS:
            cfg = ModelConfig.from_preset(f"{a}-{size}")
            mem[f"{a}-{size}"] = {"params": sum(p.numel() for p in build_model(cfg, "meta").parameters()),
                                  "fp32": param_bytes(cfg), "int8": param_bytes(cfg, 8),
                                  "int4": param_bytes(cfg, 4)}
    if args.json:
        print(json.dumps({"widths": results, "memory_bytes": mem, "threads": torch.get_num_threads()}, indent=2))
        return
    print("parameter memory (MB; int8/int4: Linears other than embedding/head packed, group 128)")
    print(f"  {'preset':<20}{'params':>12}{'fp32':>10}{'int8':>10}{'int4':>10}")
    for name, r in mem.items():
        print(f"  {name:<20}{r['params']:>12,}{r['fp32'] / 1e6:>10.2f}{r['int8'] / 1e6:>10.2f}"
              f"{r['int4'] / 1e6:>10.2f}")


if __name__ == "__main__":
    main()
