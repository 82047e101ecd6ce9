"""CPU scaling check (issue 13): `phaseloop train` in one process using every core
against `torchrun --nproc-per-node N` (gloo DDP, one thread each) at the same global
batch, and compiled against eager in one process. Target: N-process throughput >= 0.8x
of one process. Runs one after another (never two timing jobs at once), steady-state
tokens/s from each run's metrics (the first log interval, with warm-up and compile,
dropped), and prints the ratios.

    python benchmarks/bench_distributed.py            # rope-small, 2 processes, ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(out: Path, data: Path, args, nproc: int = 1, threads: int | None = None, compile: bool = False) -> dict:
    cmd = ["-m", "phaseloop", "train", "--preset", args.preset, "--steps", str(args.steps),
           "--batch-size", str(args.batch // nproc), "--seq-len", str(args.seq), "--log-every", "10",
           "--eval-every", str(args.steps), "--eval-windows", "2", "--ckpt-every", str(args.steps),
           "--warmup", "5", "--quiet", "--data", str(data), "--out", str(out), "--device", "cpu"]
    if compile:
        cmd += ["--compile", "model"]
    if nproc > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads or os.cpu_count())}
    subprocess.run([sys.executable, *cmd], env=env, check=True, capture_output=True)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tok_per_s"] for r in recs if "tok_per_s" in r][1:]  # drop the warm-up interval
    summary = json.loads((out / "summary.json").read_text())
    return {"tok_per_s": statistics.median(tps), "val_loss": summary["val_loss"], "elapsed_s": summary["elapsed_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="rope-small")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="global batch")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--data", default=None, help="corpus (default: this repository's source files)")
    args = ap.parse_args(argv)
    data = Path(args.data) if args.data else Path(__file__).resolve().parents[1] / "src"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        one = run(tmp / "one", data, args)
        many = run(tmp / "many", data, args, nproc=args.nproc, threads=max(1, (os.cpu_count() or 1) // args.nproc))
        comp = run(tmp / "compiled", data, args, compile=True)
    print(f"{args.preset}, global batch {args.batch} x {args.seq}, {args.steps} steps, {os.cpu_count()} cores")
    print(f"1 process ({os.cpu_count()} threads)      {one['tok_per_s']:>9.0f} tok/s   val loss {one['val_loss']:.5f}")
    print(f"{args.nproc} processes (gloo DDP)      {many['tok_per_s']:>9.0f} tok/s   val loss {many['val_loss']:.5f}"
          f"   ratio {many['tok_per_s'] / one['tok_per_s']:.3f} (target >= 0.8)")
    print(f"1 process, --compile        {comp['tok_per_s']:>9.0f} tok/s   val loss {comp['val_loss']:.5f}"
          f"   compiled / eager {comp['tok_per_s'] / one['tok_per_s']:.3f} (steady state; "
          f"wall {comp['elapsed_s']:.0f} s vs {one['elapsed_s']:.0f} s with compile time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
