"""Adaptive depth at inference, measured (issue 39; docs/inference.md): per model, the full
depth next to each exit rule, --kv-share and --speculative, timed side by side in one
process with the rows interleaved round by round (medians).

Per row: batch-1 prefill tokens/s (one forward over a prompt of --prefill tokens) and
decode tokens/s (--decode new tokens, greedy, after an 8-token prompt), each against the
full row (realised speedup: the median over rounds of a full-row time over the row's time
taken back to back with it, ``paired``) and,
for exit rows, the counted one, 1 / (1 - FLOPs saved) (``analysis.exits.exit_flops`` of the
same forwards); the bytes the KV cache holds; the
loss change on --windows windows of --data (exit rows: the full pass with the rule;
--kv-share rows: token by token, as decoding reads the shared cache); for --speculative,
the acceptance rate and whether the greedy tokens are the full depth's.

Exit values are calibrated per model to a mean depth near --target of the passes on the
prefill prompt (bisection on log10 EPS); "pass 1" exits every position after the first pass.

Usage: python benchmarks/bench_adaptive.py [--models universal-small,looped-512,...]
       [--run looped-512=runs/looped-512 ...] [--rounds 3] [--decode 24] [--prefill 96]
       [--json out.json]
Models: the *-small presets, NAME-512 and NAME-1024 (d_model 512 / 1024, where matrix products
dominate); the default, all nine, takes about 11 minutes on 2 cores (the d 1024 ones 7 of them).
JSON: per row its rounds' times (``prefill_round_s``, ``decode_round_s``); the full row's are
all its timings, (rows - 1) x rounds, in the order of the rows they were paired with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from phaseloop import ModelConfig, build_model
from phaseloop.analysis.exits import exit_flops, tally
from phaseloop.early_exit import parse_exit, set_exit
from phaseloop.engine.checkpoint import load_run
from phaseloop.inference import Options, TokenByToken, configured, decode_layout, generate
from phaseloop.layers import KVCache

WIDE = dict(d_model=512, n_heads=8, n_kv_heads=8, d_ff=1408)
HUGE = dict(d_model=1024, n_heads=16, n_kv_heads=8, d_ff=2816)
LOOP6 = dict(n_layers=3, n_begin=1, n_end=1, n_loops=6)
SHAPES = {  # NAME-512 / NAME-1024: the *-small model at d_model 512 / 1024 (the looped ones 1 -> 1 x 6 -> 1)
    "universal-512": ("universal-small", dict(WIDE, n_kv_heads=4, d_ff=2048)),
    "looped-512": ("looped-small", dict(WIDE, **LOOP6)),
    "hyperloop-512": ("hyperloop-small", dict(WIDE, **LOOP6)),
    "universal-1024": ("universal-small", dict(HUGE, d_ff=4096)),
    "looped-1024": ("looped-small", dict(HUGE, **LOOP6)),
    "hyperloop-1024": ("hyperloop-small", dict(HUGE, **LOOP6)),
}
RULES = ("kl", "kl-lens", "entropy", "state", "accel")
DEFAULT = ("universal-small,looped-small,hyperloop-small,universal-512,looped-512,hyperloop-512,"
           "universal-1024,looped-1024,hyperloop-1024")


def build(name: str, runs: dict):
    """The model of ``name`` laid out as `phaseloop generate` lays it out, and its weights' origin."""
    if name in runs:
        model, origin = load_run(runs[name], "cpu")[0], "trained"
    else:
        preset, over = SHAPES.get(name, (name, {}))
        torch.manual_seed(0)
        model, origin = build_model(ModelConfig.from_preset(preset, **over)), "init"
    decode_layout(model.eval())
    return model, origin


def windows(path: str | None, n: int, T: int) -> torch.Tensor:
    """[n, T + 1] byte windows evenly spaced over ``path`` (random bytes without one)."""
    if path and Path(path).is_file():
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
        starts = torch.linspace(0, len(data) - T - 2, n).long()
        return torch.stack([data[s:s + T + 1] for s in starts])
    return torch.randint(0, 256, (n, T + 1), generator=torch.Generator().manual_seed(0))


def calibrate(model, kind: str, x, target: float) -> float:
    """A value of ``kind`` whose mean depth on ``x`` is near ``target`` x the passes."""
    lo, hi, best = -8.0, 3.0, None
    D = model.trunk.passes
    for _ in range(14):
        v = 10 ** ((lo + hi) / 2)
        set_exit(model, parse_exit(f"{kind}:{v:.3g}")[0])
        with torch.no_grad():
            depth = float(model(x).stats["exit_passes"].float().mean())
        if best is None or abs(depth - target * D) < abs(best[1] - target * D):
            best = (float(f"{v:.3g}"), depth)
        lo, hi = (lo, (lo + hi) / 2) if depth < target * D else ((lo + hi) / 2, hi)
    set_exit(model, None)
    return best[0]


def rows_of(model, x, args) -> list[dict]:
    D = model.trunk.passes
    rows = [{"row": "full", "opts": Options()}]
    for fill in ("recompute", "latest"):  # every position exits after the first pass
        rows.append({"row": f"pass 1 {fill}", "opts": Options(exit=parse_exit("state:1e9")[0], kv_fill=fill)})
    for kind in RULES:
        if kind == "accel" and D < 4:
            continue  # its first exit follows pass 3, and none follows the last pass
        v = calibrate(model, kind, x, args.target)
        for fill in ("recompute", "latest"):
            opts = Options(exit=parse_exit(f"{kind}:{v}")[0], kv_fill=fill)
            rows.append({"row": f"{kind}:{v:g} {fill}", "opts": opts})
    for k in (1, 2):
        rows.append({"row": f"kv-share {k}", "opts": Options(kv_share=k)})
    for d in sorted({1, max(1, D // 2)}):
        rows.append({"row": f"speculative {d}", "opts": Options(speculative=d, draft_tokens=args.draft_tokens)})
    return rows


def time_prefill(model, x, opts):
    with configured(model, opts), torch.no_grad(), tally(model) as t:
        t0 = time.perf_counter()
        model(x, cache=KVCache(capacity=x.shape[1]))
        return time.perf_counter() - t0, t


def time_decode(model, prompt, args, opts):
    o = Options(**{**opts.__dict__, "max_new_tokens": args.decode})
    with tally(model) as t:
        g = generate(model, prompt, o)
    return g, t


def loss_of(model, w, opts) -> float:
    x, y = w[:, :-1], w[:, 1:]
    with configured(model, opts), torch.no_grad():
        logits = (TokenByToken(model)(x) if opts.kv_share else model(x)).logits
    return float(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()))


def paired(full: list[float], row: list[float]) -> float:
    """The realised speedup: the median over rounds of the full row's time over the row's,
    the two timed back to back in each round (the row first in the first timed round, the
    full row first in the next, and so on), so that a drift of the machine cancels: a
    shared VM's speed moves within seconds (a ratio of the two medians moved by up to 25 %
    from run to run)."""
    return statistics.median(f / r for f, r in zip(full, row, strict=True))


def bench(name, args, runs) -> dict:
    model, kind = build(name, runs)
    D = model.trunk.passes
    x = windows(args.data, 1, args.prefill)[:, :-1]
    prompt = windows(args.data, 1, 8)[:, :-1]
    rows = rows_of(model, x, args)
    pre = {r["row"]: [] for r in rows}
    dec = {r["row"]: [] for r in rows}
    pair_p = {r["row"]: [] for r in rows}  # the full row's times, each taken beside one of this row's
    pair_d = {r["row"]: [] for r in rows}
    for i in range(args.warmup + args.rounds):  # interleaved: each round times every other row once,
        kept = i >= args.warmup  # each timing beside one of the full row (the row first, then the full row)
        order = (lambda r: (rows[0], r)) if (i - args.warmup) % 2 else (lambda r: (r, rows[0]))
        for r in rows[1:]:
            if r["opts"].speculative is None:
                for q in order(r):
                    secs, q["tally_p"] = time_prefill(model, x, q["opts"])
                    (pre if q is r else pair_p)[r["row"]] += [secs] if kept else []
            for q in order(r):
                g, q["tally_d"] = time_decode(model, prompt, args, q["opts"])
                (dec if q is r else pair_d)[r["row"]] += [g.seconds] if kept else []
                q["gen"] = g
    pre["full"] = [t for r in rows[1:] for t in pair_p[r["row"]]]
    dec["full"] = [t for r in rows[1:] for t in pair_d[r["row"]]]
    w = windows(args.data, args.windows, args.seq)
    full = rows[0]
    base_loss = loss_of(model, w, full["opts"])
    out = []
    for r in rows:
        o, g = r["opts"], r["gen"]
        with configured(model, o):
            fp = exit_flops(model, x.shape[1], r.get("tally_p")) if o.exit else None
            fd = exit_flops(model, x.shape[1], r.get("tally_d")) if o.exit else None
        f_full = exit_flops(model, x.shape[1])
        row = {"model": name, "weights": kind, "row": r["row"], "passes": D,
               "mean_passes": g.mean_passes, "decode_tok_s": args.decode / statistics.median(dec[r["row"]]),
               "kv_cache_bytes": g.kv_cache_bytes,
               "kv_ratio": g.kv_cache_bytes / full["gen"].kv_cache_bytes if full["gen"].kv_cache_bytes else None}
        full_p, full_d = (pair_p[r["row"]], pair_d[r["row"]]) if r is not full else (pre["full"], dec["full"])
        row["decode_speedup"] = paired(full_d, dec[r["row"]])
        row["decode_round_s"], row["prefill_round_s"] = dec[r["row"]], pre[r["row"]]  # each timing (docstring)
        if pre[r["row"]]:
            row["prefill_tok_s"] = x.shape[1] / statistics.median(pre[r["row"]])
            row["prefill_speedup"] = paired(full_p, pre[r["row"]])
            tp = r["tally_p"]
            row["prefill_depth"] = tp.mean("passes") if tp.positions else D
        if fp is not None:
            row["counted_prefill"], row["counted_decode"] = f_full / fp, f_full / fd
        if o.speculative is None:
            row["dloss"] = loss_of(model, w, o) - base_loss
        else:
            row["acceptance"] = g.acceptance
            row["greedy_identical"] = bool(torch.equal(g.tokens, full["gen"].tokens))
            row["dloss"] = 0.0  # the full depth's distribution by construction (tests/test_speculative.py)
        out.append(row)
    return {"model": name, "weights": kind, "d_model": model.cfg.d_model, "passes": D, "rows": out}


def fmt(v, f):
    return "-" if v is None else f.format(v)


def table(res) -> str:
    lines = [f"### {res['model']} (d_model {res['d_model']}, {res['passes']} passes, weights: {res['weights']})", "",
             "| row | depth (prefill) | prefill tok/s | realised | counted | ratio | decode tok/s | realised | "
             "counted | ratio | KV bytes | KV ratio | Δloss | acceptance |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        cp, cd = r.get("counted_prefill"), r.get("counted_decode")
        rp, rd = r.get("prefill_speedup"), r["decode_speedup"]
        acc = r.get("acceptance")
        acc_s = "-" if acc is None else f"{acc:.1%}" + ("" if r["greedy_identical"] else " (NOT identical)")
        cells = [r["row"], fmt(r.get("prefill_depth"), "{:.2f}"), fmt(r.get("prefill_tok_s"), "{:.0f}"),
                 fmt(rp, "{:.2f}x"), fmt(cp, "{:.2f}x"), fmt(rp / cp if cp and rp else None, "{:.2f}"),
                 f"{r['decode_tok_s']:.1f}", f"{rd:.2f}x", fmt(cd, "{:.2f}x"), fmt(rd / cd if cd else None, "{:.2f}"),
                 f"{r['kv_cache_bytes']:,}", fmt(r["kv_ratio"], "{:.3f}"), f"{r['dloss']:+.4f}", acc_s]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT)
    p.add_argument("--run", action="append", default=[], metavar="NAME=DIR", help="a trained run for NAME")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--decode", type=int, default=24, help="new tokens per decode timing")
    p.add_argument("--prefill", type=int, default=96, help="prompt tokens per prefill timing")
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--target", type=float, default=0.5, help="calibrated mean depth, as a share of the passes")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--data", default=os.path.join(os.environ.get("PHASELOOP_DATA_DIR", ""), "wikitext-2",
                                                  "wiki.test.raw"))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = dict(item.split("=", 1) for item in args.run)
    t0, results = time.perf_counter(), []
    for name in args.models.split(","):
        results.append(bench(name, args, runs))
        print(table(results[-1]) + "\n", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s; torch {torch.__version__}, {torch.get_num_threads()} threads)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
