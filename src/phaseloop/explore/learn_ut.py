"""Learn endpoints for the Universal Transformer explainer §1-§6 (Dehghani et al. 2019).

Each function is ``fn(ctx, params) -> JSON`` and calls the library: ``universal``
(schedules, coordinate signal), ``accounting`` (§3 calculator), ``tasks.parity_demo``
(§5 scan), ``act`` (§6 executor). Inputs are bounded (``context.number``); nothing here
computes an equation of its own.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from phaseloop.analysis import accounting
from phaseloop.analysis.ut_explainer import SIGNALS, coordinate_signal, schedule_grids
from phaseloop.archs import act
from phaseloop.explore.context import BadInput, choice, flag, number
from phaseloop.tasks import parity_demo as pd

MAX_STEPS, MAX_POSITIONS = 24, 32  # ACT tables typed into a page

# --------------------------------------------------------------------------- ACT inputs
# Halting probabilities [steps, positions] of the explainer's examples (§6); step limit
# 12 = 2 x num_hidden_layers, as tensor2tensor's. "init": p = sigmoid(act_halting_bias_init
# = 1.0) before any training (the halting unit's weights start near 0).
ACT_PRESETS = {
    "init": "right after init: p = σ(1) at every step",
    "certain": "one token with p > 0.99 at step 1, the others as at init",
    "hesitating": "all hesitating: p = 0.05 at every step",
    "mixed": "positions that halt at different steps",
}


def act_preset(name: str) -> torch.Tensor:
    init = torch.sigmoid(torch.tensor(1.0, dtype=torch.float64)).item()
    if name == "init":
        return torch.full((12, 4), init, dtype=torch.float64)
    if name == "certain":
        p = torch.full((12, 3), init, dtype=torch.float64)
        p[0, 0] = 0.995
        return p
    if name == "hesitating":
        return torch.full((12, 3), 0.05, dtype=torch.float64)
    # mixed: position j's p grows with j; a later row never matters once a position halted
    cols = [0.995, 0.7, 0.45, 0.3, 0.2, 0.12]
    return torch.tensor([[c] * 12 for c in cols], dtype=torch.float64).T


def parse_table(text: str) -> torch.Tensor:
    """'p11, p12; p21, p22' (rows = steps, columns = positions) -> [steps, positions]."""
    rows = [r for r in str(text).replace("\n", ";").split(";") if r.strip()]
    if not rows:
        raise BadInput("p is empty: one row per step, positions separated by commas")
    try:
        table = [[float(v) for v in r.replace(" ", ",").split(",") if v.strip()] for r in rows]
    except ValueError:
        raise BadInput("p must hold numbers: one row per step (';' or a new line), "
                       "positions separated by commas") from None
    width = len(table[0])
    if any(len(r) != width for r in table):
        raise BadInput("p: every step (row) needs the same number of positions")
    if not (1 <= len(table) <= MAX_STEPS and 1 <= width <= MAX_POSITIONS):
        raise BadInput(f"p: at most {MAX_STEPS} steps (rows) and {MAX_POSITIONS} positions (columns), "
                       f"got {len(table)} x {width}")
    p = torch.tensor(table, dtype=torch.float64)
    if not bool(((p >= 0) & (p <= 1)).all()):
        raise BadInput("p: halting probabilities must lie in [0, 1]")
    return p


def act_input(params) -> tuple[torch.Tensor, str]:
    if params.get("p"):
        return parse_table(params["p"]), "typed"
    name = choice(params, "preset", list(ACT_PRESETS), "init")
    return act_preset(name), name


# --------------------------------------------------------------------------- §1 schedules
def schedules(ctx, params) -> dict:
    p, source = act_input({"preset": "mixed", **params})
    depth = number(params, "depth", default=4, lo=1, hi=MAX_STEPS)
    out = schedule_grids(p.shape[1], depth, p, number(params, "threshold", float, default=0.99,
                                                       lo=1e-6, hi=1.0))
    out.update(positions=p.shape[1], depth=depth, source=source)
    return out


# --------------------------------------------------------------------------- §3 calculator
def accounting_counts(ctx, params) -> dict:
    """A preset, optionally with free inputs, counted by ``accounting.count`` and built
    by ``accounting.count_built``; ratios to transformer-base; the matched width."""
    name = choice(params, "preset", list(accounting.PRESETS), "transformer-base")
    spec = accounting.PRESETS[name]
    d = number(params, "d", default=spec.d_model, lo=2, hi=16384)
    heads = number(params, "heads", default=spec.n_heads, lo=1, hi=256)
    if d % heads:
        raise BadInput(f"heads must divide d: {d} is not a multiple of {heads}")
    shared = flag(params, "shared", spec.shared)
    kw = dict(d_model=d, n_heads=heads, shared=shared,
              ffn_dim=number(params, "d_ff", default=4 * d, lo=1, hi=131072),
              vocab_size=number(params, "vocab", default=spec.vocab_size, lo=2, hi=1_000_000))
    n = number(params, "layers", default=spec.steps if shared else spec.enc_layers, lo=1, hi=64)
    kw.update(steps=n) if shared else kw.update(enc_layers=n, dec_layers=n, steps=n)
    spec = replace(spec, name="custom" if _changed(spec, kw) else name, **kw)
    seq_len = number(params, "seq_len", default=accounting.DEFAULT_SEQ_LEN, lo=1, hi=65536)
    row = accounting.count(spec, seq_len)
    base = accounting.count(accounting.PRESETS["transformer-base"], seq_len)
    built = accounting.count_built(spec, seq_len, flops=False) if flag(params, "built", True) else None
    m = accounting.match("transformer-base", True, seq_len)
    return {"model": row, "base": base, "built": built, "ratio": _ratios(row, base),
            "match": {"d_exact": m["d_exact"], "d": m["d"], "total": m["model"]["total"],
                      "target_total": m["target_total"]},
            "presets": {k: {**r, "ratio": _ratios(r, base)} for k, r in
                        ((k, accounting.count(s, seq_len)) for k, s in accounting.PRESETS.items())}}


def _ratios(row: dict, base: dict) -> dict:
    return {k: row[f] / base[f] for k, f in (("params", "total"), ("flops", "flops_per_token"),
                                              ("layer_matmul_flops", "layer_matmul_flops_per_token"))}


def _changed(spec, kw: dict) -> bool:
    return any(getattr(spec, k) != v for k, v in kw.items() if k != "ffn_dim") or \
        kw["ffn_dim"] != spec.d_ff


# --------------------------------------------------------------------------- §4 coordinates
def coordinates(ctx, params) -> dict:
    d = number(params, "d", default=512, lo=2, hi=2048)
    t = number(params, "t", default=10, lo=0, hi=10_000)
    n = number(params, "positions", default=64, lo=1, hi=512)
    span = number(params, "span", default=2048, lo=2, hi=8192)
    if t >= span:  # the curve's peak lies at i = t
        raise BadInput(f"t must be below span ({span}, the positions the curve draws), got {t}; raise span")
    part = choice(params, "part", ["position", "step", "sum"], "sum")
    conv = choice(params, "convention", list(SIGNALS), "t2t")
    heat = coordinate_signal(torch.arange(n), t, d, part, conv)
    i = torch.arange(span)
    curves = {c: coordinate_signal(i, t, d, "sum", c).norm(dim=-1) for c in SIGNALS}
    one = coordinate_signal(i[:1], 0, d, "position", conv).norm().item()
    far = {c: coordinate_signal(torch.tensor([997 + t]), t, d, "sum", c).norm().item() for c in SIGNALS}
    return {"d": d, "t": t, "part": part, "convention": conv,
            "heatmap": heat.round(decimals=4).tolist(),
            "curve_positions": i.tolist(), "curves": {c: v.round(decimals=4).tolist() for c, v in curves.items()},
            "one_norm": one, "one_norm_formula": math.sqrt(d / 2),
            "peak": {c: {"i": int(v.argmax()), "norm": v.max().item()} for c, v in curves.items()},
            "peak_formula": math.sqrt(2 * d), "far_offset": 997, "far": far, "sqrt_d": math.sqrt(d)}


# --------------------------------------------------------------------------- §5 parity
def _trace(tr: pd.ScanTrace) -> dict:
    return {"model": tr.model, "offsets": tr.offsets, "states": tr.states, "exact": tr.exact,
            "correct": tr.correct, "exact_from": tr.exact_from, "steps": tr.steps,
            "first_exact_step": tr.first_exact_step, "first_failure": tr.first_failure,
            "solved_exactly": tr.solved_exactly}


def parity(ctx, params) -> dict:
    if params.get("bits"):
        bits = str(params["bits"]).strip()
        if not 1 <= len(bits) <= 1024 or set(bits) - {"0", "1"}:
            raise BadInput("bits must be 1 to 1024 characters 0 or 1")
    else:
        bits = pd.random_bits(number(params, "length", default=40, lo=1, hi=1024),
                              number(params, "seed", default=0, lo=0, hi=2**31 - 1))
    x = [int(b) for b in bits]
    n = len(x)
    layers = number(params, "layers", default=6, lo=0, hi=12)
    steps = number(params, "steps", default=pd.steps_needed(n), lo=0, hi=20)
    nosig = number(params, "steps_without_signal", default=pd.steps_needed(n), lo=0, hi=1100)
    return {"bits": x, "target": pd.prefix_parity_bits(x), "length": n,
            "steps_needed": pd.steps_needed(n), "layers": layers,
            "max_length_fixed_stack": pd.max_length_fixed_stack(layers),
            "steps_needed_without_signal": pd.steps_needed_without_signal(n),
            "shared": _trace(pd.run_shared(x, steps)),
            "fixed_stack": _trace(pd.run_fixed_stack(x, layers)),
            "no_step_signal": _trace(pd.run_without_step_signal(x, nosig))}


# --------------------------------------------------------------------------- §6 ACT
def act_executor(ctx, params) -> dict:
    p, source = act_input(params)
    threshold = number(params, "threshold", float, default=0.99, lo=1e-6, hi=1.0)
    max_steps = number(params, "max_steps", default=p.shape[0], lo=1, hi=p.shape[0])
    mode = choice(params, "mode", ["basic", "t2t_literal"], "basic")
    out = act.listing(p, threshold, max_steps, mode)
    s = out["schedule"]
    return {"source": source, "p": p, "threshold": threshold, "max_steps": max_steps, "mode": mode,
            "steps": out["steps"], "steps_run": s.steps_run, "n_updates": s.n_updates,
            "remainders": s.remainders, "halting_probability": s.halting_probability,
            "update_weights": s.update_weights[:s.steps_run],
            "effective_weights": s.effective_weights[:s.steps_run],
            "effective_sum": s.effective_weights.sum(0),
            "state_weights": out["state_weights"][:s.steps_run],
            "ponder_cost": out["ponder_cost"], "ponder_mean": out["ponder_cost"].mean().item(),
            "presets": ACT_PRESETS}


ENDPOINTS = {
    "/api/learn/schedules": schedules,
    "/api/learn/accounting": accounting_counts,
    "/api/learn/coordinates": coordinates,
    "/api/learn/parity": parity,
    "/api/learn/act": act_executor,
}
