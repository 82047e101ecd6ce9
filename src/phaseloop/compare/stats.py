"""Statistics of a comparison: first step reaching a target loss, speedups, the paired
t-test over seeds (exact Student t, no scipy), seed-mean curves."""

from __future__ import annotations

import math
from pathlib import Path

from ..engine import read_metrics

def first_reach(xs: list[float], ys: list[float], target: float) -> float | None:
    """First x at which the curve reaches y <= target, interpolating linearly between
    the evaluation before and the evaluation at the first crossing; None if never.
    (Before the first evaluation nothing is known, so a first point already at or below
    the target counts at its own x.)"""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y <= target:
            if i == 0 or ys[i - 1] == y:
                return float(x)
            x0, y0 = xs[i - 1], ys[i - 1]
            return float(x0 + (y0 - target) / (y0 - y) * (x - x0))
    return None


def speedup(ref_x: float | None, var_x: float | None) -> float | None:
    """3PT paper: (reference's steps to its final loss) / (variant's steps to it)."""
    if ref_x is None or var_x is None or var_x <= 0:
        return None
    return ref_x / var_x


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with integer df, exact closed forms of
    Abramowitz & Stegun 26.7.3 (no scipy): with θ = atan(|t|/√df), A = P(|T| < |t|) is
    2/π [θ + sinθ (cosθ + 2/3 cos³θ + ...)] for odd df and sinθ [1 + 1/2 cos²θ + ...]
    for even df."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if math.isinf(t):
        return 0.0
    th = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(th), math.cos(th)
    if df % 2:
        term, acc = c, (c if df > 1 else 0.0)
        for k in range(3, df - 1, 2):  # terms cos^{k}θ · (2·4···(k-1))/(1·3···k)
            term *= c * c * (k - 1) / k
            acc += term
        a = 2 / math.pi * (th + s * acc)
    else:
        term, acc = 1.0, 1.0
        for k in range(2, df - 1, 2):  # terms cos^{k}θ · (1·3···(k-1))/(2·4···k)
            term *= c * c * (k - 1) / k
            acc += term
        a = s * acc
    return min(1.0, max(0.0, 1.0 - a))


def paired_t_test(ref: list[float], var: list[float], alpha: float = 0.05) -> dict:
    """Paired t-test of var - ref over seeds; verdict better / worse (lower / higher
    loss, p < alpha) or indistinguishable. One pair: no noise estimate ("n/a")."""
    d = [v - r for r, v in zip(ref, var)]
    n = len(d)
    mean = sum(d) / n if n else float("nan")
    out = {"n": n, "mean_diff": mean, "t": None, "df": n - 1, "p": None}
    if n < 2:
        return {**out, "verdict": "n/a", "note": "one seed: no noise estimate"}
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    if sd == 0:  # identical differences: no noise at all (t undefined, kept out of JSON)
        t, p = None, 1.0 if mean == 0 else 0.0
    else:
        t = mean / (sd / math.sqrt(n))
        p = t_two_sided_p(t, n - 1)
    verdict = "indistinguishable" if p >= alpha else ("better" if mean < 0 else "worse")
    note = ("2 seeds: 1 degree of freedom, only large consistent differences count"
            if n == 2 else "")
    return {**out, "t": t, "p": p, "verdict": verdict, "note": note}


def mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
    return m, sd


def read_curves(run_dir: Path) -> dict:
    """Evaluation records of a run: steps, val_loss, elapsed_s (training time)."""
    evals = [r for r in read_metrics(run_dir) if "val_loss" in r]
    return {"step": [r["step"] for r in evals], "val_loss": [r["val_loss"] for r in evals],
            "elapsed_s": [r.get("elapsed_s", float("nan")) for r in evals]}


def mean_curve(curves: list[dict]) -> dict:
    """Seed-mean curve over the evaluation steps all seeds share, with min/max bands."""
    common = sorted(set.intersection(*(set(c["step"]) for c in curves)))
    out = {"step": common, "val_loss": [], "lo": [], "hi": [], "elapsed_s": []}
    for s in common:
        ls = [c["val_loss"][c["step"].index(s)] for c in curves]
        es = [c["elapsed_s"][c["step"].index(s)] for c in curves]
        out["val_loss"].append(sum(ls) / len(ls))
        out["lo"].append(min(ls))
        out["hi"].append(max(ls))
        out["elapsed_s"].append(sum(es) / len(es))
    return out
