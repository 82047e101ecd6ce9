"""Learning-rate tuning inside a comparison (a recipe's ``[tune]`` table).

Architectures do not share an optimum (looped and weight-shared models want other rates
than the stack they are compared with), so one shared rate can decide a comparison. With
``[tune]`` every variant first trains a grid of settings (the learning rate; optionally
warmup and weight decay) on *tuning seeds*, disjoint from the reported ones, on the
*tuning slice*: the training portion of the data only (``runs.tuning_corpus``), scored
on its own held-out tail, never on the reported validation split. Score = the tuning
runs' final validation loss, mean over the tuning seeds (a diverged run: infinite).
Each variant then trains all its reported seeds at its best point. When the best rate
is the grid's smallest or largest, the grid grows one step (the ratio of its two outer
rates) that way, at most ``extend`` times per variant; the report says how many and
whether the choice is still on the edge. Every decision is recomputed from the finished
runs, so an interrupted tuning resumes where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from phaseloop.analysis import plots
from phaseloop.compare.options import AXES, SHORT, RecipeError, Tune  # noqa: F401
from phaseloop.compare.recipe import Recipe
from phaseloop.compare.runs import DIVERGED, CompareRun, recipe_data
from phaseloop.files import read_json


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def point_name(point: dict) -> str:
    return "-".join(f"{SHORT[k]}{v:g}" for k, v in point.items())


def score(runs: list[CompareRun]) -> dict:
    """A grid point's tuning runs -> {losses per seed (None: diverged), mean, std}."""
    losses = {}
    for r in runs:
        if (r.run_dir / DIVERGED).exists():
            losses[r.seed] = None
        elif (r.run_dir / "summary.json").exists():
            losses[r.seed] = read_json(r.run_dir / "summary.json")["val_loss"]
    xs = [x for x in losses.values() if x is not None]
    finite = len(xs) == len(runs) and all(math.isfinite(x) for x in xs)
    mean = sum(xs) / len(xs) if finite else math.inf
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if finite and len(xs) > 1 else None
    return {"losses": losses, "loss": mean, "std": std}


def choose(rows: list[dict], lrs: list[float], used: int, extend: int) -> tuple[dict, str | None]:
    """(the best row, "down" / "up" / None): the lowest mean tuning loss (ties: the
    first in grid order), and which way the rate grid grows when its rate is an edge of
    ``lrs`` and fewer than ``extend`` extensions are ``used``."""
    best = min(rows, key=lambda r: r["loss"])  # min keeps the first of equals
    edge = "down" if best["point"]["lr"] == lrs[0] else "up" if best["point"]["lr"] == lrs[-1] else None
    return best, (edge if used < extend else None)


def grow(lrs: list[float], way: str) -> list[float]:
    """One more rate beyond the edge, at the ratio of the two outer ones."""
    if way == "up":
        return lrs + [_round(lrs[-1] * lrs[-1] / lrs[-2])]
    return [_round(lrs[0] * lrs[0] / lrs[1])] + lrs


def tuning_runs(recipe: Recipe, tune: Tune, planned, lrs: list[float], out: Path) -> list[CompareRun]:
    v = planned.variant
    return [CompareRun(f"tune/{v.slug}/{point_name(pt)}-s{seed}", v.name, seed, planned.cfg,
                    tune.train_config(recipe, v, pt, seed), out, recipe_data(recipe), tuning=True)
            for pt in tune.grid(lrs) for seed in tune.seeds]


def run_tuning(recipe: Recipe, plan: list, out: Path, execute: Callable[[list[CompareRun]], None],
               log: Callable[[str], None] | None = None) -> dict:
    """Train every variant's grid (growing at the edges), round by round; returns
    {variant: {grid, points, chosen, extensions, max_extensions, on_edge}}. ``execute``
    (``runner.execute``: the comparison's launcher) returns when every run it is given
    has finished, or raises (``runs.RunsPending``: runs left to Slurm or other processes;
    the same command goes on from the finished rounds later)."""
    tune = Tune(**recipe.tune)
    state = {p.name: {"lrs": list(tune.lr), "used": 0} for p in plan}
    while True:
        rounds = {p.name: tuning_runs(recipe, tune, p, state[p.name]["lrs"], out) for p in plan}
        execute([r for runs in rounds.values() for r in runs])
        grew = False
        for p in plan:
            s, runs = state[p.name], rounds[p.name]
            rows = [{"point": pt, **score([r for r in runs if r.run_dir.name.rsplit("-s", 1)[0] == point_name(pt)])}
                    for pt in tune.grid(s["lrs"])]
            best, way = choose(rows, s["lrs"], s["used"], tune.extend)
            s.update(rows=rows, best=best)
            if way is not None:
                s["lrs"], s["used"], grew = grow(s["lrs"], way), s["used"] + 1, True
                if log:
                    log(f"tune {p.name}: best lr {best['point']['lr']:g} is the grid's edge; adding "
                        f"{s['lrs'][0 if way == 'down' else -1]:g} ({s['used']} of at most {tune.extend})")
        if not grew:
            break
    results = {}
    for name, s in state.items():
        if not math.isfinite(s["best"]["loss"]):
            raise RecipeError(f"variant {name!r}: every tuning run diverged (rates {s['lrs']}); "
                              "lower [tune] lr, lengthen warmup, or raise extend")
        edge = s["best"]["point"]["lr"] in (s["lrs"][0], s["lrs"][-1])
        results[name] = {"lrs": s["lrs"], "points": s["rows"], "chosen": s["best"]["point"],
                         "extensions": s["used"], "max_extensions": tune.extend, "on_edge": edge,
                         "seeds": tune.seeds, "steps": tune.steps or recipe.train["steps"]}
        if log:
            log(f"tune {name}: chose {point_name(s['best']['point'])} (tuning loss {s['best']['loss']:.4f})"
                + (" -- still the grid's edge: widen [tune] lr" if edge else ""))
    return results


def report_lines(results: dict) -> list[str]:
    """report.md's tuning section: per variant, the grid's tuning losses and the choice."""
    if not results:
        return []
    any_r = next(iter(results.values()))
    md = ["", "## Learning-rate tuning", "",
          f"Each variant trained every grid point on tuning seeds {any_r['seeds']} ({any_r['steps']} steps) "
          "on the tuning slice (the training portion of the data; scored on its own held-out tail, never "
          "the reported validation split); tuning loss = final validation loss on that slice, mean over the "
          "tuning seeds. The reported runs use each variant's best point. A best rate on the grid's edge "
          f"grows the grid one step that way, at most {any_r['max_extensions']} times per variant.", ""]
    for name, r in results.items():
        axes = list(r["chosen"])
        md += [f"### {name}", "", "| " + " | ".join(axes) + " | tuning loss | |",
               "|" + "---|" * (len(axes) + 2)]
        for row in r["points"]:
            pt = row["point"]
            loss = ("diverged" if not math.isfinite(row["loss"]) else f"{row['loss']:.4f}"
                    + (f" ± {row['std']:.4f}" if row["std"] is not None else ""))
            mark = "**chosen**" if pt == r["chosen"] else ""
            md.append("| " + " | ".join(f"{pt[k]:g}" for k in axes) + f" | {loss} | {mark} |")
        md += ["", "Chosen: " + ", ".join(f"{k} = {x:g}" for k, x in r["chosen"].items())
               + f"; grid extended {r['extensions']} of at most "
               f"{r['max_extensions']} times" + (" -- **the choice is still on the grid's edge**: widen "
                                                 "[tune] lr or raise extend." if r["on_edge"] else "."), ""]
    return md


def plot(out: Path, results: dict, fname: str = "tuning_loss_vs_lr.png") -> str:
    """Tuning loss against the rate, one line per variant (the best over the other axes
    at each rate), the chosen rate starred."""

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, r in results.items():
        lrs = sorted({row["point"]["lr"] for row in r["points"]})
        ys = [min(row["loss"] for row in r["points"] if row["point"]["lr"] == x) for x in lrs]
        ok = [(x, y) for x, y in zip(lrs, ys) if math.isfinite(y)]
        line, = ax.plot([x for x, _ in ok], [y for _, y in ok], marker="o", label=name)
        best = next(row["loss"] for row in r["points"] if row["point"] == r["chosen"])
        ax.plot([r["chosen"]["lr"]], [best], marker="*", ms=14, color=line.get_color())
    ax.set_xscale("log")
    plots.finish(fig, ax, out / fname, "peak learning rate", "tuning loss (nats/token, tuning slice)",
                 "learning-rate tuning (mean over tuning seeds; star = chosen)")
    return fname
