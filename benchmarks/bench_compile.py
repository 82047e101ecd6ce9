"""Compile time, break-even and step ratio of ``--compile block`` against ``model``
(issue 30), each measured in a fresh process so that cold and warm caches are real.

    python benchmarks/bench_compile.py                       # rope-small at 4 and 12 layers, the UT
    python benchmarks/bench_compile.py --cases rope-small:4 --steps 6   # quick check

For each case and mode: the first training step with an empty inductor cache (cold) and
again in a new process with the cache the first left (warm), the steady step time, and
the eager step time; compile = first step - steady step; break-even = compile / (eager
step - compiled step). Targets (issue 30): cold block compile <= 1/2 of whole-model at 12
layers and for the UT; warm first step <= 3 s; break-even <= 300 steps cold, <= 50 warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CASES = {  # name: (preset, overrides, batch, seq)
    "rope-small:4": ("rope-small", {"n_layers": 4}, 16, 128),
    "rope-small:12": ("rope-small", {"n_layers": 12}, 16, 128),
    "universal-small": ("universal-small", {}, 16, 128),
}


def child(mode: str, case: str, steps: int) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from phaseloop import ModelConfig, build_model
    from phaseloop.engine import TrainConfig, compiling, make_optimizer

    preset, over, batch, seq = CASES[case]
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset(preset, **over))
    opt = make_optimizer(model, TrainConfig())
    fwd = model
    if mode == "block":
        compiling.compile_blocks(model)
    elif mode == "model":
        fwd = torch.compile(model)
    x = torch.randint(0, model.cfg.vocab_size, (batch, seq))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fwd(x, x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"first": times[0], "steady": statistics.median(times[2:] or times[1:])}


def measure(mode: str, case: str, steps: int, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    r = subprocess.run([sys.executable, __file__, "--child", mode, case, str(steps)], env=env,
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{mode} {case} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--steps", type=int, default=12, help="training steps per process")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    print(f"{'case':<16} {'mode':<6} {'cold 1st s':>10} {'warm 1st s':>10} {'compile s':>9} "
          f"{'step/eager':>10} {'break-even cold':>15} {'warm':>6}")
    for case in args.cases:
        eager = measure("off", case, args.steps, tempfile.mkdtemp())
        row = {}
        for mode in ("block", "model"):
            cache = tempfile.mkdtemp(prefix="inductor-")
            cold = measure(mode, case, args.steps, cache)
            warm = measure(mode, case, args.steps, cache)
            gain = eager["steady"] - cold["steady"]
            comp_cold, comp_warm = cold["first"] - cold["steady"], warm["first"] - warm["steady"]
            be = (lambda c: f"{c / gain:.0f}" if gain > 0 else "never")
            row[mode] = comp_cold
            print(f"{case:<16} {mode:<6} {cold['first']:>10.1f} {warm['first']:>10.1f} {comp_cold:>9.1f} "
                  f"{cold['steady'] / eager['steady']:>10.3f} {be(comp_cold):>15} {be(comp_warm):>6}")
        print(f"{case:<16} cold compile block / model = {row['block'] / row['model']:.2f}   "
              f"(eager step {eager['steady'] * 1e3:.0f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
