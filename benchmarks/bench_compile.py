"""Compile time, break-even and step ratio of ``--compile block`` against ``model``
(issue 30), each measured in a fresh process so that cold and warm caches are real.

    python benchmarks/bench_compile.py                       # rope-small at 4 and 12 layers, the UT
    python benchmarks/bench_compile.py --cases rope-small:4 --steps 6   # quick check
    python benchmarks/bench_compile.py --train rope-small hyperloop-small  # whole runs, main job's settings

For each case and mode, three fresh processes: the first training step where inductor
never ran in the cache folder ("first use": its one-time toolchain checks run too), where
it ran before but never compiled this graph ("new graph": every architecture's first run
after the first compile on a machine), and again with the graph cached ("warm"); then,
in each process, compiled and eager steps interleaved (same model, batch, optimiser:
their medians give the step ratio). Compile = first step - compiled step; break-even =
compile / (eager step - compiled step). Targets (issue 30): cold block compile <= 1/2 of
whole-model at 12 layers and for the UT; warm first step <= 3 s; break-even <= 300 steps
cold, <= 50 warm.

``--train PRESET ...`` times whole ``phaseloop train`` runs at the README main job's
settings (stdlib corpus, 300 steps of 16 x 128, an evaluation every 25 steps, a checkpoint
every 50) in fresh processes, in the order off, block with an empty compile cache, block
with the cache it left (a comparison's later runs), off again, block warm again: wall
seconds, training tokens/s and the final validation loss of each, so the main job's
end-to-end gain (issue 30: >= 15 %) is measured on the runs it is made of.
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
    """One process: the first step compiled, then ``steps`` compiled and ``steps`` eager
    steps interleaved in rounds of two (the same model, batch and optimiser)."""
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from phaseloop import ModelConfig, build_model
    from phaseloop.engine import TrainConfig, compile_cache, compiling, make_optimizer

    t0 = time.perf_counter()
    compile_cache.use_cache()  # as a run does: phaseloop's cache settings (the vector ISA checks, kept)
    setup = time.perf_counter() - t0  # part of the first compiled step's cost
    if mode == "toolchain":  # inductor's first use in a cache folder: a one-op function
        x = torch.randn(64, requires_grad=True)
        torch.compile(lambda v: (v.sin() * 2).sum())(x).backward()
        return {"first": time.perf_counter() - t0}
    preset, over, batch, seq = CASES[case]
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset(preset, **over))
    opt = make_optimizer(model, TrainConfig())
    compiled = torch.compile(model) if mode == "model" else model
    undo = compiling.compile_blocks(model) if mode == "block" else None
    x = torch.randint(0, model.cfg.vocab_size, (batch, seq))

    def step(fwd) -> float:
        t0 = time.perf_counter()
        fwd(x, x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    first = setup + step(compiled)
    on, off = [], []
    for _r in range(0, steps, 2):
        on += [step(compiled) for _ in range(2)]
        if undo is not None:
            undo()
        off += [step(model) for _ in range(2)]
        if undo is not None:  # re-wrapped: dynamo's code cache serves the same graph (no recompile)
            undo = compiling.compile_blocks(model)
    return {"first": first, "compiled": statistics.median(on[1:]), "eager": statistics.median(off[1:])}


def measure(mode: str, case: str, steps: int, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PHASELOOP_CACHE": cache + "-phaseloop"}
    r = subprocess.run([sys.executable, __file__, "--child", mode, case, str(steps)], env=env,
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{mode} {case} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def train_runs(presets: list[str], steps: int) -> None:
    """Whole training runs per preset: off / block cold / block warm / off / block warm."""
    exe = os.path.join(os.path.dirname(sys.executable), "phaseloop")
    print(f"{'preset':<16} {'run':<11} {'wall s':>7} {'tok/s':>7} {'val loss':>10}")
    for preset in presets:
        root = tempfile.mkdtemp(prefix="bench-compile-")
        walls = {}
        for i, (mode, cache) in enumerate((("off", "a"), ("block", "b"), ("block", "b"), ("off", "a"),
                                           ("block", "b"))):
            label = mode if mode == "off" else ("block cold" if i == 1 else "block warm")
            out = os.path.join(root, f"run{i}")
            env = {**os.environ, "PHASELOOP_CACHE": os.path.join(root, f"cache-{cache}")}
            env.pop("TORCHINDUCTOR_CACHE_DIR", None)
            t0 = time.perf_counter()
            r = subprocess.run([exe, "train", "--preset", preset, "--data", "stdlib", "--steps", str(steps),
                               "--batch-size", "16", "--seq-len", "128", "--lr", "0.002", "--warmup", "25",
                                "--eval-every", "25", "--eval-windows", "32", "--ckpt-every", "50",
                                "--log-every", "5", "--compile", mode, "--quiet", "--out", out],
                               env=env, check=False, capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"{preset} {label} failed:\n{r.stderr[-2000:]}")
            wall = time.perf_counter() - t0
            walls.setdefault(label, []).append(wall)
            recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            tok = statistics.median(r["tok_per_s"] for r in recs if "tok_per_s" in r)
            val = [r["val_loss"] for r in recs if "val_loss" in r][-1]
            print(f"{preset:<16} {label:<11} {wall:>7.1f} {tok:>7.0f} {val:>10.6f}", flush=True)
        off = statistics.mean(walls["off"])
        print(f"{preset:<16} wall / off: block cold {walls['block cold'][0] / off:.3f}, "
              f"block warm {statistics.mean(walls['block warm']) / off:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--steps", type=int, default=12, help="compiled and eager steps per process (each)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--train", nargs="+", metavar="PRESET", help="whole runs at the main job's settings")
    ap.add_argument("--train-steps", type=int, default=300)
    args = ap.parse_args(argv)
    if args.train:
        train_runs(args.train, args.train_steps)
        return 0
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], int(args.child[2]))))
        return 0
    print(f"{'case':<16} {'mode':<6} {'compile s: first use':>20} {'new graph':>9} {'warm':>5} "
          f"{'eager ms':>8} {'compiled ms':>11} {'ratio':>6} {'break-even: new graph':>21} {'warm':>5}")
    for case in args.cases:
        row = {}
        for mode in ("block", "model"):
            fresh, prewarmed = tempfile.mkdtemp(prefix="inductor-"), tempfile.mkdtemp(prefix="inductor-")
            measure("toolchain", case, 0, prewarmed)
            first = measure(mode, case, args.steps, fresh)  # inductor never used in this cache
            new = measure(mode, case, args.steps, prewarmed)  # used before, this graph never compiled
            warm = measure(mode, case, args.steps, prewarmed)  # this graph in the cache
            eager = statistics.median(m["eager"] for m in (first, new, warm))
            done = statistics.median(m["compiled"] for m in (first, new, warm))
            c = {k: m["first"] - m["compiled"] for k, m in (("first", first), ("new", new), ("warm", warm))}
            gain = eager - done
            be = (lambda s, gain=gain: f"{s / gain:.0f}" if gain > 0 else "never")
            row[mode] = c
            print(f"{case:<16} {mode:<6} {c['first']:>20.1f} {c['new']:>9.1f} {c['warm']:>5.1f} {eager * 1e3:>8.0f} "
                  f"{done * 1e3:>11.0f} {done / eager:>6.3f} {be(c['new']):>21} {be(c['warm']):>5}", flush=True)
        print(f"{case:<16} cold compile block / model: {row['block']['new'] / row['model']['new']:.2f} for a new "
              f"graph, {row['block']['first'] / row['model']['first']:.2f} at inductor's first use", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
