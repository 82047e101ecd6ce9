"""The README's main job end to end, eager against ``--compile auto`` (issue 30: >= 15 %
sooner, its table unchanged within seed noise).

    python benchmarks/bench_main_job.py                 # the quick comparison, 3 seeds: ~20 min on 2 cores
    python benchmarks/bench_main_job.py --seeds 0       # one seed each: ~8 min
    python benchmarks/bench_main_job.py --keep /tmp/mj  # keep both comparisons' folders

Runs ``phaseloop compare`` on the built-in quick recipe twice, in fresh processes and
fresh folders, one after the other: first with ``compile = "off"`` written into a copy of
the recipe (what the main job ran before auto compiled anything), then as the README runs
it (``--compile auto``, the default) with an empty compile cache, so every block it
compiles is compiled cold, once per architecture. Prints wall seconds, the ratio, each
variant's validation BPB (mean ± std over seeds) side by side with the paired difference,
and what auto chose for every run.
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

QUICK = Path(__file__).resolve().parents[1] / "src" / "phaseloop" / "compare" / "quick.toml"


def run(out: Path, recipe: Path, seeds: str | None, cache: Path) -> float:
    exe = os.path.join(os.path.dirname(sys.executable), "phaseloop")
    cmd = [exe, "compare", str(recipe), "--out", str(out), "--quiet", *(["--seeds", seeds] if seeds else [])]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env={**os.environ, "PHASELOOP_CACHE": str(cache)}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return wall


def finals(out: Path) -> dict[str, list[float]]:
    s = json.loads((out / "summary.json").read_text())
    return {v["name"]: [f["val_bpb"] for _, f in sorted(v["final"].items(), key=lambda kv: int(kv[0]))]
            for v in s["variants"]}


def choices(out: Path) -> list[str]:
    lines = []
    for p in sorted((out / "runs").glob("*/summary.json")):
        s = json.loads(p.read_text())
        lines.append(f"  {p.parent.name}: {s.get('compile_note') or s.get('compile') or 'off'}")
    return lines


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", help="comma-separated seeds (default: the recipe's 0,1,2)")
    ap.add_argument("--keep", type=Path,
                    help="write both comparisons (report.md, runs) here, not in a temporary folder")
    a = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if a.keep:
            a.keep.mkdir(parents=True, exist_ok=False)
            tmp = a.keep
        off = tmp / "quick-off.toml"
        text = QUICK.read_text()
        off.write_text(text.replace("\n[train]\n", '\n[train]\ncompile = "off"\n', 1))
        assert 'compile = "off"' in off.read_text()
        walls = {"off": run(tmp / "off", off, a.seeds, tmp / "cache-off"),
                 "auto": run(tmp / "auto", QUICK, a.seeds, tmp / "cache-auto")}
        got = {m: finals(tmp / m) for m in walls}
        print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; the quick comparison"
              + (f", seeds {a.seeds}" if a.seeds else "") + "; fresh processes, empty compile cache")
        print(f"wall s: off {walls['off']:.1f}, auto {walls['auto']:.1f}; "
              f"auto / off {walls['auto'] / walls['off']:.3f} "
              f"({(1 - walls['auto'] / walls['off']) * 100:.1f} % sooner)")
        print("| variant | off val BPB | auto val BPB | auto - off per seed |")
        print("|---|---|---|---|")
        for name, xs in got["off"].items():
            ys = got["auto"][name]
            print(f"| {name} | {mean_std(xs)} | {mean_std(ys)} | {' '.join(f'{y - x:+.4f}' for x, y in zip(xs, ys))} |")
        print("auto's choices:")
        print("\n".join(choices(tmp / "auto")))


if __name__ == "__main__":
    main()
