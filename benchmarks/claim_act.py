"""Claim check (issue 16): does ACT learn where to think? (Universal Transformer §2.2)

Task with a known needed depth: **parity of L bits**, answered in one token right after
the separator. In one forward pass the answer position must combine all L inputs; a
scan of pairwise XORs does it in ceil(log2 L) steps (``phaseloop.tasks.parity_demo``),
so the depth needed grows with L. The fixed-depth UT runs (``--fixed``) measure how
much depth this model actually needs per length: the fewest steps T whose accuracy
reaches 95 %. The ACT runs (UT+ACT, max steps ``--act-max``) report, per length, the
accuracy and the ponder time n_updates + R at the answer position, the share of
answer positions that halted at step 1 (ponder exactly 2: n = 1, R = 1), and
Spearman's rho between L and that ponder time, per seed.

    python benchmarks/claim_act.py                                   # the docs table
    python benchmarks/claim_act.py --seeds 0 --steps 300 --fixed 1   # a quick look

A finished run is stored as ``--out/<name>-s<seed>.json`` and reused.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import numpy as np
import torch

from phaseloop.tasks import Example, parse_lengths
from phaseloop.tasks.runner import run_examples, task_model_config
from phaseloop.tasks.task_model import task_train_config


def parity_examples(n: int, lengths: list[int], seed: int) -> list[Example]:
    """``n`` random bit strings, lengths uniform over ``lengths``; target: their parity."""
    rng = np.random.default_rng([seed, 2024])
    out = []
    for L in rng.choice(lengths, size=n):
        bits = "".join(rng.choice(["0", "1"], size=int(L)))
        out.append(Example(bits, str(bits.count("1") % 2), int(L)))
    return out


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):  # average ranks of ties
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(x), ranks(y)
    if len(set(rx)) < 2 or len(set(ry)) < 2:
        return float("nan")  # constant ponder: no ordering to correlate
    return float(np.corrcoef(rx, ry)[0, 1])


def run_one(name: str, overrides: dict, seed: int, args) -> dict:
    path = Path(args.out) / f"{name}-s{seed}.json"
    if path.exists():
        return json.loads(path.read_text())
    lengths = list(parse_lengths(args.lengths))
    train = parity_examples(args.steps * args.batch_size, lengths, seed)
    test = parity_examples(args.n_test * len(lengths), lengths, 10_000)
    cfg, _ = task_model_config("universal", args.preset, overrides)
    tc = task_train_config(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=seed,
                           log_every=max(1, args.steps // 4), ckpt_every=args.steps)
    res = run_examples(cfg, train, test, tc)
    out = {"name": name, "seed": seed, "overrides": overrides, "final_loss": res["final_loss"],
           "params": res["params"], "seconds": res["seconds"], "per_length": {}}
    ans = res["decoded"].answer_ponder
    for L in lengths:
        idx = [i for i, e in enumerate(test) if e.length == L]
        row = {"acc": res["per_length"][L]["seq_acc"]}
        if ans and ans[0] is not None:
            p = [ans[i] for i in idx]
            row.update(ponder=statistics.mean(p), halt1=sum(v == 2.0 for v in p) / len(p))
        out["per_length"][str(L)] = row
    if ans and ans[0] is not None:
        out["spearman"] = spearman([float(e.length) for e in test], [float(v) for v in ans])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


def table(runs: dict, fixed: list[int], lengths: list[int]) -> str:
    def mean(name, L, key):
        v = [r["per_length"][str(L)][key] for r in runs[name]]
        return statistics.mean(v)
    lines = []
    head = f"{'L':>3} {'log2':>4} {'needed T':>8} " + " ".join(f"{'T=' + str(t) + ' acc':>9}" for t in fixed)
    act = [n for n in runs if n.startswith("act")]
    head += "".join(f" | {n + ' acc':>18} {'ponder':>6} {'halt@1':>6}" for n in act)
    lines.append(head)
    for L in lengths:
        need = next((t for t in fixed if mean(f"fixed{t}", L, "acc") >= 0.95), None)
        s = f"{L:>3} {math.ceil(math.log2(L)) if L > 1 else 0:>4} {need if need else '>' + str(fixed[-1]):>8} "
        s += " ".join(f"{mean(f'fixed{t}', L, 'acc'):>9.3f}" for t in fixed)
        for n in act:
            s += f" | {mean(n, L, 'acc'):>18.3f} {mean(n, L, 'ponder'):>6.2f} {mean(n, L, 'halt1'):>6.2f}"
        lines.append(s)
    for n in act:
        rho = [r["spearman"] for r in runs[n]]
        lines.append(f"{n}: Spearman rho(L, answer ponder) per seed: "
                     + ", ".join("nan" if math.isnan(x) else f"{x:+.3f}" for x in rho)
                     + f"; final loss {statistics.mean(r['final_loss'] for r in runs[n]):.4f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lengths", default="1-12", help="train and test lengths")
    ap.add_argument("--n-test", type=int, default=100, help="test examples per length")
    ap.add_argument("--preset", default="universal-tiny")
    ap.add_argument("--fixed", default="1,2,4,8", help="fixed-depth UT steps to measure the needed depth")
    ap.add_argument("--act-max", type=int, default=8)
    ap.add_argument("--weights", default="0.01,0.001", help="ACT ponder loss weights (t2t: 0.01)")
    ap.add_argument("--bias-inits", default="1.0", help="halting bias inits (t2t: 1.0)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/claim-act")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    fixed = [int(t) for t in args.fixed.split(",")] if args.fixed else []
    variants = {f"fixed{t}": {"n_steps": t} for t in fixed}
    for w in args.weights.split(","):
        for b in args.bias_inits.split(","):
            variants[f"act w={w} b={b}"] = {"act": True, "act_max_steps": args.act_max,
                                            "act_loss_weight": float(w), "act_halting_bias_init": float(b)}
    runs: dict = {}
    for seed in seeds:
        for name, ov in variants.items():
            r = run_one(name.replace(" ", "_").replace("=", ""), ov, seed, args)
            runs.setdefault(name, []).append(r)
            acc = statistics.mean(v["acc"] for v in r["per_length"].values())
            print(f"{name} seed {seed}: mean acc {acc:.3f}, final loss {r['final_loss']:.4f}, "
                  f"{r['seconds']:.0f} s" + (f", rho {r['spearman']:+.3f}" if "spearman" in r else ""), flush=True)
    print(table(runs, fixed, list(parse_lengths(args.lengths))))


if __name__ == "__main__":
    main()
