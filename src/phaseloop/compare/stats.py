"""Statistics of a comparison: first step reaching a target loss, speedups, seed-mean
curves (the tests over seeds are ``analysis.stats``)."""

from __future__ import annotations

import math
from pathlib import Path

from phaseloop.analysis.stats import mean_std, paired_t_test, t_two_sided_p  # noqa: F401  (re-exported)
from phaseloop.engine import read_metrics


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


def read_curves(run_dir: Path) -> dict:
    """Evaluation records of a run: steps, val_loss, elapsed_s (training time)."""
    evals = [r for r in read_metrics(run_dir) if "val_loss" in r]
    return {"step": [r["step"] for r in evals],  # a non-finite loss is written as null: NaN here
            "val_loss": [float("nan") if r["val_loss"] is None else r["val_loss"] for r in evals],
            "elapsed_s": [r.get("elapsed_s", float("nan")) for r in evals]}


def mean_curve(curves: list[dict]) -> dict:
    """Seed-mean curve over the evaluation steps all seeds share, with min/max bands."""
    common = sorted(set.intersection(*(set(c["step"]) for c in curves)))
    out = {"step": common, "val_loss": [], "lo": [], "hi": [], "elapsed_s": []}
    for s in common:
        ls = [c["val_loss"][c["step"].index(s)] for c in curves]
        es = [c["elapsed_s"][c["step"].index(s)] for c in curves]
        out["val_loss"].append(sum(ls) / len(ls))  # NaN if a seed's is (a diverged run)
        nan = any(math.isnan(x) for x in ls)
        out["lo"].append(float("nan") if nan else min(ls))
        out["hi"].append(float("nan") if nan else max(ls))
        out["elapsed_s"].append(sum(es) / len(es))
    return out
