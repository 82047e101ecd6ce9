"""Claim check at CPU scale (issue 6): Transformer, mHC, Looped and Hyperloop at matched
depth 8 (the ``*-small`` presets) on Tiny Shakespeare for a fixed token budget, several
seeds; reports parameters, validation BPB before and after weight-only 4-bit
quantisation (RTN and GPTQ, through ``phaseloop quantize``), training tokens/s and, with
``--tasks``, the paper's own metric: the average downstream accuracy (issue 43,
``hf.downstream``; each run's ``downstream.json``), per task and averaged, with paired
t-tests over seeds.

    python benchmarks/claim_hyperloop.py --seeds 0 --steps 200      # one seed
    python benchmarks/claim_hyperloop.py --seeds 0,1,2 --steps 1000 --limit 200 \
        --tasks hellaswag,piqa,arc_easy,arc_challenge,winogrande,openbookqa,boolq,sciq,lambada
    python benchmarks/claim_hyperloop.py --table runs/claim-hyperloop  # print the table

Runs land in ``--out/<arch>-s<seed>``; an existing finished run is reused, so seeds can
be run in parallel processes and the table printed at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from phaseloop import ModelConfig
from phaseloop.compare.evals import accuracy_test
from phaseloop.compare.stats import paired_t_test
from phaseloop.hf.downstream import TaskSet, parse_tasks, run_results
from phaseloop.lm.train import TrainConfig, train
from phaseloop.quant import quantize_run

ARCHS = ("transformer", "mhc", "looped", "hyperloop")


def run_one(arch: str, seed: int, out: Path, steps: int, group: int, tasks: list[str] | None = None,
            limit: int | None = None, taskset=None) -> dict:
    run = out / f"{arch}-s{seed}"
    if not (run / "summary.json").exists():
        tc = TrainConfig(steps=steps, batch_size=8, seq_len=128, lr=2e-3, warmup_steps=20,
                         eval_every=steps, eval_windows=64, ckpt_every=steps, log_every=10,
                         seed=seed, device="cpu")
        train(ModelConfig.from_preset(f"{arch}-small"), tc, "shakespeare", run, progress=False)
    res = {"arch": arch, "seed": seed, **json.loads((run / "summary.json").read_text())}
    for method in ("rtn", "gptq"):
        rep = run / f"quant-w4-g{group}-{method}.json"
        r = (json.loads(rep.read_text()) if rep.exists() else
             quantize_run(run, 4, group, method, windows=64, device="cpu"))
        res[f"bpb_{method}4"] = r["after"]["val_bpb"]
        res["bpb_eval"] = r["before"]["val_bpb"]
        res["bytes_fp32"], res[f"bytes_{method}4"] = r["bytes_before"], r["bytes_after"]
    if tasks:
        d = run_results(run, tasks, limit=limit, tasks=taskset)
        res["downstream"] = {**{t["task"]: t["value"] for t in d["tasks"]}, "average": d["average"]["value"]}
        res["downstream_meta"] = {"metrics": {t["task"]: t["metric"] for t in d["tasks"]}, "limit": limit,
                                  "chance": d["average"]["chance"],
                                  "seconds": {t["task"]: t["seconds"] for t in d["tasks"]}}
    return res


def _p(t: dict, fmt: str) -> str:
    """A test's p, or n/a where it has none (one seed; the same difference on every seed)."""
    return "n/a" if t["p"] is None else format(t["p"], fmt)


def table(out: Path) -> str:
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*/claim.json"))]
    lines = [f"{'arch':<12}{'seeds':>6}{'params':>11}{'val BPB':>16}{'4-bit RTN':>16}"
             f"{'4-bit GPTQ':>16}{'tok/s':>9}{'MB fp32 -> int4':>18}"]
    for arch in ARCHS:
        rs = [r for r in rows if r["arch"] == arch]
        if not rs:
            continue

        def ms(key, rs=rs):
            v = [r[key] for r in rs]
            sd = statistics.stdev(v) if len(v) > 1 else 0.0
            return f"{statistics.mean(v):.4f}±{sd:.4f}"

        tok = statistics.mean(r["tok_per_s"] for r in rs)
        lines.append(f"{arch:<12}{len(rs):>6}{rs[0]['params']:>11,}{ms('bpb_eval'):>16}"
                     f"{ms('bpb_rtn4'):>16}{ms('bpb_gptq4'):>16}{tok:>9.0f}"
                     f"{rs[0]['bytes_fp32'] / 1e6:>9.2f} -> {rs[0]['bytes_gptq4'] / 1e6:.2f}")
    by = {a: {r["seed"]: r for r in rows if r["arch"] == a} for a in ARCHS}
    lines += _downstream_table(rows, by)
    lines.append("paired t-tests over seeds (val BPB; after GPTQ in brackets), reference first:")
    for ref, var in (("transformer", "hyperloop"), ("looped", "hyperloop"), ("transformer", "looped"),
                     ("transformer", "mhc")):
        seeds = sorted(set(by[ref]) & set(by[var]))
        if len(seeds) < 2:
            continue
        t = [paired_t_test([by[ref][s][k] for s in seeds], [by[var][s][k] for s in seeds])
             for k in ("bpb_eval", "bpb_gptq4")]
        lines.append(f"  {ref} -> {var}: {t[0]['mean_diff']:+.4f} BPB, p={_p(t[0], '.3g')} {t[0]['verdict']} "
                     f"[{t[1]['mean_diff']:+.4f}, p={_p(t[1], '.3g')} {t[1]['verdict']}] over {len(seeds)} seeds")
        if all("downstream" in by[a][s] for a in (ref, var) for s in seeds):
            tasks = list(by[ref][seeds[0]]["downstream"])
            cells = []
            for k in tasks:
                a = accuracy_test([by[ref][s]["downstream"][k] for s in seeds],
                                  [by[var][s]["downstream"][k] for s in seeds])
                cells.append(f"{k} {a['mean_diff'] + 0.0:+.3f} (p={_p(a, '.2g')})")
            lines.append("      downstream accuracy: " + ", ".join(cells))
    return "\n".join(lines)


def _downstream_table(rows: list[dict], by: dict) -> list[str]:
    """Per task and averaged accuracy, mean ± sd over seeds, and the chance level."""
    scored = [r for r in rows if "downstream" in r]
    if not scored:
        return []
    meta = scored[0]["downstream_meta"]
    tasks = list(scored[0]["downstream"])
    how = f"the first {meta['limit']} documents of each task" if meta["limit"] else "every document"
    lines = [f"downstream accuracy (acc_norm where lm-eval reports it, else acc; 0-shot, {how}):",
             f"{'arch':<12}" + "".join(f"{k[:11]:>14}" for k in tasks)]
    for arch in ARCHS:
        rs = [r for r in by[arch].values() if "downstream" in r]
        if rs:
            lines.append(f"{arch:<12}" + "".join(
                f"{statistics.mean(r['downstream'][k] for r in rs):>8.4f}±{_sd([r['downstream'][k] for r in rs]):.3f}"
                for k in tasks))
    lines.append(f"{'chance':<12}" + " " * 14 * (len(tasks) - 1) + f"{meta['chance']:>14.4f}")
    secs = {k: statistics.mean(r["downstream_meta"]["seconds"][k] for r in scored) for k in tasks if k != "average"}
    lines.append("seconds per task and run (mean): " + ", ".join(f"{k} {v:.0f}" for k, v in secs.items()))
    return lines


def _sd(v: list[float]) -> float:
    return statistics.stdev(v) if len(v) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--group-size", type=int, default=32, help="d_model 128: 4 groups per row")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/claim-hyperloop")
    ap.add_argument("--table", metavar="OUT", help="only print the table of a finished --out")
    ap.add_argument("--tasks", help="downstream tasks scored on every run (docs/downstream.md)")
    ap.add_argument("--limit", type=int, help="with --tasks: the first N documents of each task")
    args = ap.parse_args()
    if args.table:
        print(table(Path(args.table)))
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    tasks = parse_tasks(args.tasks) if args.tasks else None
    built = []

    def taskset():  # the tasks built once, when the first run needs scoring
        built[:] = built or [TaskSet(tasks, 0, args.limit)]
        return built[0]

    for seed in (int(s) for s in args.seeds.split(",")):
        for arch in args.archs.split(","):
            res = run_one(arch, seed, out, args.steps, args.group_size, tasks, args.limit, taskset)
            (out / f"{arch}-s{seed}" / "claim.json").write_text(json.dumps(res, indent=2))
            print(f"{arch} seed {seed}: bpb {res['bpb_eval']:.4f}, rtn4 {res['bpb_rtn4']:.4f}, "
                  f"gptq4 {res['bpb_gptq4']:.4f}, {res['tok_per_s']:.0f} tok/s"
                  + (f", downstream avg {res['downstream']['average']:.4f}" if tasks else ""), flush=True)
    print(table(out))


if __name__ == "__main__":
    main()
