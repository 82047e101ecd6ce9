"""Claim check at CPU scale (issue 6): Transformer, mHC, Looped and Hyperloop at matched
depth 8 (the ``*-small`` presets) on Tiny Shakespeare for a fixed token budget, several
seeds; reports parameters, validation BPB before and after weight-only 4-bit
quantisation (RTN and GPTQ, through ``phaseloop quantize``) and training tokens/s.

    python benchmarks/claim_hyperloop.py --seeds 0 --steps 200      # one seed
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
from phaseloop.compare.stats import paired_t_test
from phaseloop.lm.train import TrainConfig, train
from phaseloop.quant import quantize_run

ARCHS = ("transformer", "mhc", "looped", "hyperloop")


def run_one(arch: str, seed: int, out: Path, steps: int, group: int) -> dict:
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
    return res


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
    lines.append("paired t-tests over seeds (val BPB; after GPTQ in brackets), reference first:")
    by = {a: {r["seed"]: r for r in rows if r["arch"] == a} for a in ARCHS}
    for ref, var in (("transformer", "hyperloop"), ("looped", "hyperloop"), ("transformer", "looped"),
                     ("transformer", "mhc")):
        seeds = sorted(set(by[ref]) & set(by[var]))
        if len(seeds) < 2:
            continue
        t = [paired_t_test([by[ref][s][k] for s in seeds], [by[var][s][k] for s in seeds])
             for k in ("bpb_eval", "bpb_gptq4")]
        lines.append(f"  {ref} -> {var}: {t[0]['mean_diff']:+.4f} BPB, p={t[0]['p']:.3g} {t[0]['verdict']} "
                     f"[{t[1]['mean_diff']:+.4f}, p={t[1]['p']:.3g} {t[1]['verdict']}] over {len(seeds)} seeds")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--group-size", type=int, default=32, help="d_model 128: 4 groups per row")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/claim-hyperloop")
    ap.add_argument("--table", metavar="OUT", help="only print the table of a finished --out")
    args = ap.parse_args()
    if args.table:
        print(table(Path(args.table)))
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    for seed in (int(s) for s in args.seeds.split(",")):
        for arch in args.archs.split(","):
            res = run_one(arch, seed, out, args.steps, args.group_size)
            (out / f"{arch}-s{seed}" / "claim.json").write_text(json.dumps(res, indent=2))
            print(f"{arch} seed {seed}: bpb {res['bpb_eval']:.4f}, rtn4 {res['bpb_rtn4']:.4f}, "
                  f"gptq4 {res['bpb_gptq4']:.4f}, {res['tok_per_s']:.0f} tok/s", flush=True)
    print(table(out))


if __name__ == "__main__":
    main()
