"""Grid throughput (issue 29): a 4-run comparison (2 variants x 2 seeds) as
`--launcher local --jobs 2` (two worker processes, one core and one thread each)
against `--launcher sequential` in one process with 2 threads, whole-command wall clock
(process start, data, training, evaluation, report), measured alternately (A B A B ...)
so drift in machine load hits both alike; prints the median of each and the ratio.
Measure on an idle machine: a shared one's load swamps the ratio.

    python benchmarks/bench_grid.py                       # tiny scale, 200 steps, 3 repeats
    python benchmarks/bench_grid.py --steps 4 --repeats 1  # the smoke setting (seconds)
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
from pathlib import Path

RECIPE = """name = "bench-grid"
data = "stdlib"
scale = "{scale}"
seeds = [0, 1]
variants = ["rope", "three_phase N=3"]

[train]
steps = {steps}
batch_size = {batch}
seq_len = {seq}
warmup_steps = {warmup}
eval_every = {steps}
eval_windows = 4
ckpt_every = {steps}
log_every = {log}
device = "cpu"
"""


def run(recipe: Path, out: Path, launcher: list[str], threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "phaseloop", "compare", str(recipe), "--out", str(out), "--quiet",
                    *launcher], env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    s = json.loads((out / "summary.json").read_text())
    return {"wall_s": wall, "val_loss": {v["name"]: v["val_loss"]["mean"] for v in s["variants"]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="tiny", help="the variants' preset scale (tiny | small)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    walls: dict[str, list[float]] = {"local": [], "sequential": []}
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        recipe = tmp / "grid.toml"
        recipe.write_text(RECIPE.format(scale=args.scale, steps=args.steps, batch=args.batch, seq=args.seq,
                                        warmup=max(1, args.steps // 10), log=max(1, args.steps // 10)))
        for i in range(args.repeats):
            for name, flags, threads in (("local", ["--launcher", "local", "--jobs", "2"], 1),
                                         ("sequential", ["--launcher", "sequential"], 2)):
                r = run(recipe, tmp / f"{name}-{i}", flags, threads)
                walls[name].append(r["wall_s"])
                losses[name] = r["val_loss"]
    loc, seq = (statistics.median(walls[k]) for k in ("local", "sequential"))
    print(f"4-run grid (rope, three_phase N=3 x seeds 0, 1), {args.scale} scale, {args.steps} steps of "
          f"{args.batch} x {args.seq}, {os.cpu_count()} cores, median of {args.repeats}")
    print(f"1 process x 2 threads (sequential)   {seq:8.1f} s   val loss {losses['sequential']}")
    print(f"2 workers x 1 thread (--jobs 2)      {loc:8.1f} s   val loss {losses['local']}")
    print(f"wall-clock ratio sequential / local  {seq / loc:8.3f}  (> 1: the workers finish the grid sooner)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
