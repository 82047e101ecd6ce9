"""Statistics over seeds (no scipy): mean and standard deviation, the exact two-sided
Student t p-value and the paired t-test a comparison's verdicts come from."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable


def mean_std(values: Iterable[float | None], ddof: int = 1) -> tuple[float | None, float | None]:
    """Mean and standard deviation of the values that are not None: ``ddof=1`` the sample
    standard deviation (over seeds; None for a single value), ``ddof=0`` the population
    one (0.0 for a single value); (None, None) when there are no values."""
    xs = [float(x) for x in values if x is not None]
    if not xs:
        return None, None
    m = math.fsum(xs) / len(xs)
    if len(xs) <= ddof:
        return m, None
    return m, math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - ddof))


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with integer df, exact closed forms of
    Abramowitz & Stegun 26.7.3 (no scipy): with θ = atan(|t|/√df), A = P(|T| < |t|) is
    2/π [θ + sinθ (cosθ + 2/3 cos³θ + ...)] for odd df and sinθ [1 + 1/2 cos²θ + ...]
    for even df."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if math.isnan(t):  # no statistic, no probability (max(0, nan) would say 0)
        return float("nan")
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
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (*ref, *var)):
        n = min(len(ref), len(var))
        return {"n": n, "mean_diff": None, "t": None, "df": n - 1, "p": None, "verdict": "n/a",
                "note": "a seed's loss is not finite (its run diverged): no test"}
    d = [v - r for r, v in zip(ref, var)]
    n = len(d)
    mean = sum(d) / n if n else float("nan")
    out = {"n": n, "mean_diff": mean, "t": None, "df": n - 1, "p": None}
    if n < 2:
        return {**out, "verdict": "n/a", "note": "one seed: no noise estimate"}
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    # a spread (and a mean) within the rounding of the subtraction (0.4 - 0.1 vs 0.5 - 0.2) is none
    rounding = 64 * sys.float_info.epsilon * max(abs(x) for x in (*ref, *var))
    if sd <= rounding:
        # identical differences: t is undefined (0/0 or x/0), and so is p
        if abs(mean) <= rounding:
            return {**out, "p": 1.0, "verdict": "indistinguishable", "note": "identical results"}
        return {**out, "verdict": "n/a", "note": f"the same difference on every seed ({mean:+.4g}): no noise "
                "estimate, the t-test is undefined"}
    t = mean / (sd / math.sqrt(n))
    p = t_two_sided_p(t, n - 1)
    verdict = "indistinguishable" if p >= alpha else ("better" if mean < 0 else "worse")
    note = ("2 seeds: 1 degree of freedom, only large consistent differences count"
            if n == 2 else "")
    return {**out, "t": t, "p": p, "verdict": verdict, "note": note}
