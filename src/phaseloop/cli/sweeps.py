"""``phaseloop eval``'s sweeps over a setting of a loaded model, one evaluation per point
and one table / JSON / plot for all: ``--depth K[,K...]`` (the trunk's depth),
``--exit RULE:V[,V...]`` (early exit per position, ``early_exit.py``) and ``--kv-share
K[,K...]`` (KV slots per looped layer, evaluated token by token: ``inference.TokenByToken``)."""

from __future__ import annotations

import json
import time

import torch

from phaseloop.analysis import plots
from phaseloop.analysis.exits import exit_flops, tally
from phaseloop.analysis.params import flops_per_token
from phaseloop.depth import set_model_depth
from phaseloop.early_exit import set_exit, set_kv_share
from phaseloop.engine.checkpoint import run_folder
from phaseloop.errors import ConfigError
from phaseloop.inference import TokenByToken
from phaseloop.lm.train import evaluate


def _sweep(args, model, run_cfg, corpus, windows, seq_len, device, points, docs=None, evaluated=None) -> list[dict]:
    """Evaluate once per point: ``apply()`` sets the model up, ``fields(tally)`` gives the
    row's own fields (``analysis.exits.tally``: the exit statistics of its forwards);
    ``evaluated``: what evaluates ``model`` (default itself)."""
    rows = []
    for apply, fields in points:
        apply()
        t0 = time.perf_counter()
        with tally(model) as t:
            res = evaluate(evaluated or model, windows, corpus.tokenizer, 16, device,
                           run_cfg["train"].get("loss_ignore_id"), docs)
        tok_s = res["val_tokens"] / max(time.perf_counter() - t0, 1e-9)
        rows.append({**fields(t), **res, "tok_per_s": tok_s, "data": corpus.name,
                     "fingerprint": corpus.fingerprint, "split": args.split,
                     "windows": len(windows), "seq_len": seq_len})
    return rows


def _report(args, rows, corpus, windows, seq_len, columns, xlabel, group=None, x="depth") -> None:
    """The sweep's table of ``columns`` ((header, key, width, format); None prints -), or
    --json the rows; --plot loss (and BPB) against the rows' ``x``."""
    if args.plot:
        plots.plot_depth_sweep(rows, args.plot, f"{run_folder(args.run).name}: {corpus.name} [{args.split}]",
                               xlabel=xlabel, group=group, x=x)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{corpus.name} [{args.split}], {len(windows)} windows of {seq_len}")
    print("".join(f"{h:>{w}}" for h, _, w, _ in columns))
    for r in rows:
        print("".join(("-" if r.get(k) is None else f.format(r[k])).rjust(w) for _, k, w, f in columns))


_LOSS = [("loss", "val_loss", 9, "{:.4f}"), ("bpb", "val_bpb", 9, "{:.4f}")]
_FLOPS = ("MFLOP/tok", "mflops_per_token", 11, "{:.2f}")
_TOKS = ("tok/s", "tok_per_s", 10, "{:.0f}")


def _mflops(flops):
    return None if flops is None else flops / 1e6


def eval_depths(args, model, run_cfg, corpus, windows, seq_len, device, docs=None) -> int:
    """eval --depth K[,K...]: loss, BPB, FLOPs per token and tokens/s at each depth."""
    for d in args.depth:  # refuse a bad depth before evaluating
        set_model_depth(model, d, args.extend_loops)

    def point(d):
        flops = flops_per_token(model.cfg, seq_len, d, args.extend_loops)
        return (lambda: set_model_depth(model, d, args.extend_loops),
                lambda t: {"depth": d, "flops_per_token": flops, "mflops_per_token": _mflops(flops)})

    rows = _sweep(args, model, run_cfg, corpus, windows, seq_len, device, [point(d) for d in args.depth], docs)
    _report(args, rows, corpus, windows, seq_len, [("depth", "depth", 6, "{}"), *_LOSS, _FLOPS, _TOKS],
            "depth at inference (UT steps / loop passes)")
    return 0


def eval_exits(args, model, run_cfg, corpus, windows, seq_len, device, docs=None) -> int:
    """eval --exit RULE:V[,V...]: per rule and value, the mean depth a position used, the
    loss, FLOPs per token (``analysis.exits.exit_flops``) and, against the first row (no
    rule: the full depth; under ACT the trained threshold), the loss change and the share
    of its FLOPs saved; then each rule's largest saving at <= 1 % more loss."""
    if args.depth is not None:
        set_model_depth(model, args.depth[0], args.extend_loops)
    rules = [None] + [r for group in args.exit for r in group]
    if len(set(rules)) != len(rules):  # within one --exit, parse_exit refuses it
        twice = next(r for r in rules if rules.count(r) > 1)
        raise ConfigError(f"--exit {twice.label}: given twice; name each rule and value once")
    fill = lambda rule: args.kv_fill if rule is not None else "recompute"
    for r in rules:  # refuse a rule the model cannot apply before evaluating
        set_exit(model, r, fill(r))

    def point(rule):
        def fields(t):
            flops = exit_flops(model, seq_len, t, args.extend_loops)
            return {"rule": rule.kind if rule else "none", "value": rule.value if rule else None,
                    "kv_fill": fill(rule), "depth": t.mean("passes") if t.positions else model.trunk.passes,
                    "readouts": t.mean("readouts"), "flops_per_token": flops, "mflops_per_token": _mflops(flops)}
        return (lambda: set_exit(model, rule, fill(rule))), fields

    rows = _sweep(args, model, run_cfg, corpus, windows, seq_len, device, [point(r) for r in rules], docs)
    set_exit(model, None)
    base = rows[0]["flops_per_token"]  # the first row's (under ACT: the trained threshold's)
    for r in rows:
        r["loss_change"] = r["val_loss"] / rows[0]["val_loss"] - 1
        r["flops_saved"] = None if None in (r["flops_per_token"], base) else 1 - r["flops_per_token"] / base
        r["label"] = "none" if r["value"] is None else f"{r['rule']}:{r['value']:g}"
    _report(args, rows, corpus, windows, seq_len,
            [("rule", "label", 13, "{}"), ("depth", "depth", 7, "{:.3f}"), *_LOSS,
             ("dloss%", "loss_change", 8, "{:+.2%}"), _FLOPS, ("saved", "flops_saved", 8, "{:.1%}"), _TOKS],
            "mean depth used (UT steps / loop passes)", group="rule")
    if not args.json:
        for kind in dict.fromkeys(r["rule"] for r in rows[1:]):
            ok = [r for r in rows if r["rule"] == kind and r["loss_change"] <= 0.01 and r["flops_saved"] is not None]
            best = max(ok, key=lambda r: r["flops_saved"], default=None)
            print(f"{kind}: no value within 1 % of the loss" if best is None else
                  f"{kind}: {best['flops_saved']:.1%} of the FLOPs saved at {best['loss_change']:+.2%} loss "
                  f"({best['label']}, mean depth {best['depth']:.2f})")
    return 0


def eval_kv_share(args, model, run_cfg, corpus, windows, seq_len, device, docs=None) -> int:
    """eval --kv-share K[,K...]: loss and BPB of token-by-token decoding (every position
    through the cache) with K slots per looped layer (full: one per pass), and the bytes
    the cache holds for one window of ``seq_len``."""
    if args.depth is not None:
        set_model_depth(model, args.depth[0], args.extend_loops)
    shares = list(args.kv_share) + ([None] if None not in args.kv_share else [])  # full: the reference row
    for k in shares:  # refuse a stack before evaluating
        set_kv_share(model, k)
    wrapper = TokenByToken(model)

    def point(k):
        def fields(t):
            one = TokenByToken(model)
            with torch.no_grad():
                one(windows[:1, :-1].to(device))
            return {"kv_share": "full" if k is None else k, "depth": model.trunk.passes,
                    "kv_cache_bytes": one.last_cache.nbytes}
        return (lambda: set_kv_share(model, k)), fields

    rows = _sweep(args, model, run_cfg, corpus, windows, seq_len, device, [point(k) for k in shares],
                  docs, evaluated=wrapper)
    set_kv_share(model, None)
    ref = next(r for r in rows if r["kv_share"] == "full")
    for r in rows:
        r["loss_change"] = r["val_loss"] / ref["val_loss"] - 1
        r["bytes_ratio"] = r["kv_cache_bytes"] / ref["kv_cache_bytes"]
        r["slots"] = r["depth"] if r["kv_share"] == "full" else min(r["kv_share"], r["depth"])  # the plot's x
    _report(args, rows, corpus, windows, seq_len,
            [("K", "kv_share", 6, "{}"), *_LOSS, ("dloss%", "loss_change", 8, "{:+.2%}"),
             ("KV bytes", "kv_cache_bytes", 11, "{:,}"), ("ratio", "bytes_ratio", 7, "{:.3f}"), _TOKS],
            "KV slots per looped layer (full: one per pass)", x="slots")
    return 0
