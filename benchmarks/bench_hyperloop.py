"""Training-step time and parameter memory of Transformer, mHC, Looped and Hyperloop.

mHC and Hyperloop are timed twice: with the fused CPU kernels for the stream maths
(``phaseloop.kernels``, the default where a C++ compiler is present) and with torch ops
only (``PHASELOOP_KERNELS=eager``), the counterparts of the paper's fused / unfused
numbers.

Ratios are measured side by side in one process: the models' timed steps are
interleaved round by round and each model's fastest step is used (interference only
adds time). On a shared CPU wall-clock time swings with the neighbours' load, so the
default measure is the process's CPU time with one intra-op thread (``--clock wall
--threads N`` for wall time). Targets (issue 6; the paper's GPU numbers in brackets):

    hyperloop / looped      <= 1.05   (paper 1.05)
    mhc / transformer       <= 1.20   (paper 1.53 unfused, 1.07 fused kernels)
    looped / transformer    ~= 1.0    (equal depth)

Memory: bytes of every parameter at fp32, and after weight-only quantisation of every
Linear except the embedding and the head (``quant.default_skip``), counted packed
(bits/8 per weight + fp16 scale and zero per group) by ``quant.packed_bytes``.

Two shapes are timed by default. The *-small presets (d 128) exaggerate the elementwise
stream work (O(n d) per token per connection) relative to the matmuls (O(d^2)); the paper's
ratios are at d 1024. The second shape (``WIDE``: d 512, 8 heads, d_ff 1408, depth 8,
batch 16 x seq 64) is closer to that balance; both are reported, labelled.

    python benchmarks/bench_hyperloop.py                 # small + wide, ~4 min on 2 cores
    python benchmarks/bench_hyperloop.py --no-wide       # small presets only
    python benchmarks/bench_hyperloop.py --no-wide --paper-width   # small + d 1024
    python benchmarks/bench_hyperloop.py --size tiny --rounds 3 --no-wide
    python benchmarks/bench_hyperloop.py --set d_model=256 --set d_ff=704   # wider small
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from phaseloop import ModelConfig, build_model, kernels
from phaseloop.quant import default_skip, packed_bytes
from phaseloop.train import TrainConfig, make_optimizer

ARCHS = ("transformer", "mhc", "looped", "hyperloop")
# timed models: (label, preset arch, kernel mode)
TIMED = (("transformer", "transformer", "auto"), ("mhc", "mhc", "auto"),
         ("looped", "looped", "auto"), ("hyperloop", "hyperloop", "auto"),
         ("mhc:torch-ops", "mhc", "eager"), ("hyperloop:torch-ops", "hyperloop", "eager"))
# second timed shape: *-small presets widened to d 512 (same depth 8 and split), short seq
WIDE = dict(over=dict(d_model=512, n_heads=8, n_kv_heads=8, d_ff=1408), batch=16, seq=64,
            rounds=8, steps=1)
# opt-in third shape at the paper's width (d 1024, 16 heads, d_ff 2816; depth 8, bytes)
# (1024 tokens per step: fewer and AdamW over the unique parameters dominates the step)
PAPER_WIDTH = dict(over=dict(d_model=1024, n_heads=16, n_kv_heads=16, d_ff=2816), batch=16,
                   seq=64, rounds=4, steps=1)


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
               clock=time.process_time, modes: dict | None = None) -> dict:
    """Seconds per AdamW training step (forward + backward + update) per model: the
    fastest of ``rounds`` interleaved samples (interference from the rest of the machine
    only ever adds time, so the minimum is the steadiest estimate of the work itself);
    ``modes[name]``: the kernel mode that model runs under (``phaseloop.kernels``)."""
    torch.manual_seed(0)
    modes = modes or {}
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

    for name, (model, opt) in runs.items():  # warm-up (allocator, AdamW state, kernel build)
        with kernels.use(modes.get(name, "auto")):
            for _ in range(2):
                step(model, opt)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (model, opt) in runs.items():
            with kernels.use(modes.get(name, "auto")):
                t0 = clock()
                for _ in range(steps):
                    step(model, opt)
                times[name].append((clock() - t0) / steps)
    return {name: min(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="default: the preset's max_seq_len")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=1, help="steps per model per round")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a field of all four timed configs, e.g. d_model=256")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-wide", action="store_true",
                    help="skip the second, wider shape (d 512; see WIDE)")
    ap.add_argument("--paper-width", action="store_true",
                    help="also time the paper's width (d 1024; see PAPER_WIDTH, ~6 min more)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    over = {k: json.loads(v) for k, _, v in (kv.partition("=") for kv in args.set or [])}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    shapes = {f"{args.size} presets{' ' + str(over) if over else ''}":
              dict(over=over, batch=args.batch, seq=args.seq, rounds=args.rounds,
                   steps=args.steps)}
    if not args.no_wide:
        shapes[f"wide: {args.size} presets with {WIDE['over']}"] = WIDE
    if args.paper_width:
        shapes[f"paper width: {args.size} presets with {PAPER_WIDTH['over']}"] = PAPER_WIDTH
    fused = kernels.mode() != "eager" and kernels.extension() is not None
    if not fused:
        print(f"fused kernels not used ({kernels.error() or 'PHASELOOP_KERNELS=eager'}): "
              f"timing torch ops only")
    results = {}
    for label, sh in shapes.items():
        timed = TIMED if fused else tuple(t for t in TIMED if t[2] == "auto")
        cfgs = {name: ModelConfig.from_preset(f"{a}-{args.size}", **sh["over"])
                for name, a, _ in timed}
        seq = sh["seq"] or cfgs["transformer"].max_seq_len
        t = step_times(cfgs, sh["batch"], seq, sh["rounds"], sh["steps"], clock,
                       {name: mode for name, _, mode in timed})
        tag = " (fused kernels)" if fused else " (torch ops)"
        ratios = {f"hyperloop/looped{tag}": t["hyperloop"] / t["looped"],
                  f"mhc/transformer{tag}": t["mhc"] / t["transformer"],
                  "looped/transformer": t["looped"] / t["transformer"]}
        if fused:
            ratios["hyperloop/looped (torch ops)"] = t["hyperloop:torch-ops"] / t["looped"]
            ratios["mhc/transformer (torch ops)"] = t["mhc:torch-ops"] / t["transformer"]
        results[label] = dict(step_s=t, ratios=ratios, batch=sh["batch"], seq=seq,
                              rounds=sh["rounds"], steps=sh["steps"])
    targets = {"hyperloop/looped": "<= 1.05 (paper 1.05)",
               "mhc/transformer": "<= 1.20 (paper 1.53 unfused / 1.07 fused)",
               "looped/transformer": "~= 1.0"}
    targets = {k: targets[k.split(" (")[0]] for r in results.values() for k in r["ratios"]}
    mem = {}
    for size in ("240m", args.size):
        for a in ARCHS:
            cfg = ModelConfig.from_preset(f"{a}-{size}")
            mem[f"{a}-{size}"] = {"params": sum(p.numel() for p in build_model(cfg, "meta").parameters()),
                                  "fp32": param_bytes(cfg), "int8": param_bytes(cfg, 8),
                                  "int4": param_bytes(cfg, 4)}
    if args.json:
        print(json.dumps({"shapes": results, "memory_bytes": mem,
                          "threads": torch.get_num_threads()}, indent=2))
        return
    for label, r in results.items():
        print(f"training step ({args.clock} time), {label}: batch {r['batch']} x seq "
              f"{r['seq']}, fp32, {torch.get_num_threads()} threads, fastest of "
              f"{r['rounds']} interleaved rounds of {r['steps']} steps")
        for a, ms in r["step_s"].items():
            print(f"  {a:<20} {ms * 1e3:8.1f} ms/step  {r['batch'] * r['seq'] / ms:9.0f} tok/s")
        for k, v in r["ratios"].items():
            print(f"  {k:<34} {v:6.3f}   target {targets[k]}")
    print("parameter memory (MB; int8/int4: Linears other than embedding/head packed, group 128)")
    print(f"  {'preset':<20}{'params':>12}{'fp32':>10}{'int8':>10}{'int4':>10}")
    for name, r in mem.items():
        print(f"  {name:<20}{r['params']:>12,}{r['fp32'] / 1e6:>10.2f}{r['int8'] / 1e6:>10.2f}"
              f"{r['int4'] / 1e6:>10.2f}")


if __name__ == "__main__":
    main()
