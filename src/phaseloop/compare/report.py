"""The comparison report: per-variant statistics, table, plots, summary.json, report.md."""

from __future__ import annotations

import json
import os
import platform
import shlex
from collections.abc import Callable
from pathlib import Path

import torch

from phaseloop.analysis import plots
from phaseloop.analysis.params import format_count
from phaseloop.compare import tune
from phaseloop.compare.budget import Planned, describe_match
from phaseloop.compare.evals import accuracy_verdict, downstream_lines, summarize_downstream
from phaseloop.compare.recipe import Recipe, RecipeError
from phaseloop.compare.stats import first_reach, mean_curve, mean_std, paired_t_test, read_curves, speedup
from phaseloop.engine import resolve_device, software_versions
from phaseloop.files import atomic_write_bytes, read_json, write_json
from phaseloop.hf.harness import scores


def summarize(out: Path, recipe: Recipe, plan: list[Planned]) -> dict:
    """Per-variant statistics from the finished runs in ``out/runs``."""
    rows = {}
    for p in plan:
        seeds, sums, curves = [], [], []
        for seed in recipe.seeds:
            d = out / "runs" / f"{p.variant.slug}-s{seed}"
            if (d / "summary.json").exists():
                seeds.append(seed)
                sums.append(read_json(d / "summary.json"))
                curves.append(read_curves(d))
        settings = {}
        if seeds:  # what its runs trained with beyond [train]: its own settings, a tuned point
            ran = read_json(out / "runs" / f"{p.variant.slug}-s{seeds[0]}" / "config.json")["train"]
            settings = {k: x for k, x in ran.items() if k not in ("seed", "device") and recipe.train.get(k) != x}
        rows[p.name] = {"seeds": seeds, "summaries": sums, "curves": curves, "settings": settings}
    ref = rows[recipe.reference]
    if not ref["seeds"]:
        raise RecipeError(f"no finished run of the reference {recipe.reference!r} in {out}")
    ref_mean = mean_curve(ref["curves"])
    if not ref_mean["step"]:
        raise RecipeError(f"the reference {recipe.reference!r} has no evaluation step its seeds' metrics.jsonl "
                          f"all hold (in {out / 'runs'}); run them again or restore those files")
    target = ref_mean["val_loss"][-1]  # reference's final validation loss (seed mean)
    ref_step = first_reach(ref_mean["step"], ref_mean["val_loss"], target)
    ref_time = first_reach(ref_mean["elapsed_s"], ref_mean["val_loss"], target)

    def t_test(a: dict, b: dict) -> dict:  # paired over the seeds both finished: b - a
        paired = [s for s in b["seeds"] if s in a["seeds"]]
        def loss(r, s):  # null in summary.json: a run that ended non-finite
            v = r["summaries"][r["seeds"].index(s)]["val_loss"]
            return float("nan") if v is None else v
        return paired_t_test([loss(a, s) for s in paired], [loss(b, s) for s in paired], recipe.alpha)

    scored = summarize_downstream(out, recipe, rows)
    variants = []
    for p in plan:
        r = rows[p.name]
        if not r["seeds"]:
            variants.append({"name": p.name, "spec": p.variant.spec, "finished_seeds": []})
            continue
        mc = mean_curve(r["curves"])
        at_step = first_reach(mc["step"], mc["val_loss"], target)
        at_time = first_reach(mc["elapsed_s"], mc["val_loss"], target)
        stat = {}
        for k in ("val_loss", "val_bpb", "val_ppl", "tok_per_s", "mfu", "peak_memory_mb", "elapsed_s"):
            m, sd = mean_std([s.get(k) for s in r["summaries"]])
            stat[k] = {"mean": m, "std": sd}
        test = None if p.name == recipe.reference else t_test(ref, r)
        control = p.variant.control
        vs_control = (None if control is None or not rows[control]["seeds"]
                      else {"control": control, **t_test(rows[control], r)})
        evals = [lm_eval_scores(out / "runs" / f"{p.variant.slug}-s{s}") for s in r["seeds"]]
        lm_eval = {k: dict(zip(("mean", "std"), mean_std([e.get(k) for e in evals])))
                   for k in sorted({k for e in evals for k in e})}
        variants.append({
            "name": p.name, "spec": p.variant.spec, "slug": p.variant.slug, "lm_eval": lm_eval,
            "model": p.cfg.to_dict(), "matched": p.matched,
            "params": p.counts["total"], "non_embedding_params": p.counts.get("non_embedding"),
            "depth": p.counts["depth"], "flops_per_token": p.counts["flops_per_token"],
            "finished_seeds": r["seeds"],
            "final": {s: {k: x.get(k) for k in ("val_loss", "val_bpb", "val_ppl")}
                      for s, x in zip(r["seeds"], r["summaries"])},
            **stat,
            "reach_step": at_step, "reach_elapsed_s": at_time,
            "step_speedup": speedup(ref_step, at_step),
            "wallclock_speedup": speedup(ref_time, at_time),
            "vs_reference": test, "vs_control": vs_control, "settings": r["settings"], "curve": mc,
            "downstream": scored.get(p.name),
        })
    total = sum(x.get("elapsed_s", 0.0) for r in rows.values() for x in r["summaries"])
    return {"reference": recipe.reference, "target_val_loss": target, "lr": recipe.train["lr"],
            "train_time_s": total, "variants": variants}


def lm_eval_scores(run_dir: Path) -> dict:
    """{task/metric: value} of a run's lm-eval results (empty when it has none)."""
    path = run_dir / "lm_eval" / "results.json"
    if not path.exists():
        return {}

    return scores(read_json(path))


def _machine(device) -> dict:
    m = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
         "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
         "device": str(device)}
    if device.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(device)
    return m


def _fmt(m, sd=None, digits=3) -> str:
    if m is None:
        return "n/a"
    s = f"{m:.{digits}f}"
    return s + (f" ± {sd:.{digits}f}" if sd is not None else "")


def _speed(x) -> str:
    return "not reached" if x is None else f"{x:.2f}x"


def _verdict(t: dict | None, none: str = "reference") -> str:
    if t is None:
        return none
    if t["p"] is None:  # one seed, or the same difference on every seed
        return "n/a (" + (t.get("note") or "1 seed").split(":")[0] + ")"
    return f"{t['verdict']} (p={t['p']:.3f})"


def format_table(summary: dict) -> str:
    """The comparison table; an MFU column when any run knew its device's peak (GPUs,
    or ``peak_tflops``)."""
    done = [v for v in summary["variants"] if v["finished_seeds"]]
    mfu = any((v.get("mfu") or {}).get("mean") is not None for v in done)
    evals = sorted({k for v in summary["variants"] for k in v.get("lm_eval", {})})
    lr = any("lr" in v.get("settings", {}) for v in done)  # a variant's own or tuned rate
    ctl = any(v.get("vs_control") for v in done)
    ds = any(v.get("downstream") for v in done)  # [eval]: the downstream average and its test
    head = ("| variant | params | depth | MFLOP/tok | " + ("lr | " if lr else "") + "tok/s | "
            + ("MFU | " if mfu else "") + "peak MB | val loss | BPB | PPL | step speedup | wall speedup | "
            "vs reference |" + (" vs control |" if ctl else "") + "".join(f" {k} |" for k in evals)
            + (" downstream avg | vs reference (downstream) |" if ds else ""))
    lines = [head, "|" + "---|" * (12 + lr + mfu + ctl + len(evals) + 2 * ds)]
    for v in summary["variants"]:
        if not v["finished_seeds"]:
            lines.append(f"| {v['name']} | not run |" + " |" * (10 + lr + mfu + ctl + len(evals) + 2 * ds))
            continue
        d = (v.get("downstream") or {}).get("average")
        down = "" if not ds else (" n/a | |" if d is None else
                                  f" {_fmt(d['mean'], d['std'])} | {accuracy_verdict(d['vs_reference'])} |")
        c = v.get("vs_control")
        control = (f" {_verdict(c, '')} vs {c['control']} |" if c else " |") if ctl else ""
        ev = v.get("lm_eval", {})
        cells = "".join(f" {_fmt(ev[k]['mean'], ev[k]['std'], 4) if k in ev else 'n/a'} |" for k in evals)
        fl = v["flops_per_token"]
        lines.append(
            f"| {v['name']} | {format_count(v['params'])} | {v['depth']} | "
            f"{'n/a' if fl is None else f'{fl / 1e6:.2f}'} | "
            + (f"{v['settings'].get('lr', summary['lr']):g} | " if lr else "") +
            f"{_fmt(v['tok_per_s']['mean'], None, 0)} | "
            + (f"{_fmt(v['mfu']['mean'], None, 3)} | " if mfu else "") +
            f"{_fmt(v['peak_memory_mb']['mean'], None, 0)} | "
            f"{_fmt(v['val_loss']['mean'], v['val_loss']['std'])} | "
            f"{_fmt(v['val_bpb']['mean'], v['val_bpb']['std'])} | "
            f"{_fmt(v['val_ppl']['mean'], v['val_ppl']['std'], 2)} | "
            f"{_speed(v['step_speedup'])} | {_speed(v['wallclock_speedup'])} | "
            f"{_verdict(v['vs_reference'])} |" + control + cells + down)
    return "\n".join(lines)


def write_plots(out: Path, summary: dict) -> list[str] | str:
    """PNG files written, or a one-line reason when matplotlib is missing."""
    if not plots.available():
        return f"{plots.MISSING}; no plots written"
    plt = plots.pyplot()

    done = [v for v in summary["variants"] if v["finished_seeds"]]
    written = []
    for key, xlabel, fname in (("step", "training step", "val_loss_vs_step.png"),
                               ("elapsed_s", "training wall-clock time (s)",
                                "val_loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for v in done:
            c = v["curve"]
            line, = ax.plot(c[key], c["val_loss"], marker=".", label=v["name"])
            if len(v["finished_seeds"]) > 1:
                ax.fill_between(c[key], c["lo"], c["hi"], color=line.get_color(), alpha=0.2)
        ax.axhline(summary["target_val_loss"], color="grey", ls=":", lw=1,
                   label=f"target ({summary['reference']} final)")
        plots.finish(fig, ax, out / fname, xlabel, "validation loss (nats/token)",
                     "validation loss (seed mean; band = min..max over seeds)")
        written.append(fname)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for v in done:
        ax.errorbar([v["params"]], [v["val_loss"]["mean"]], yerr=[v["val_loss"]["std"] or 0],
                    fmt="o", capsize=3, label=v["name"])
    ps = [v["params"] for v in done]
    if ps and max(ps) > 4 * min(ps):
        ax.set_xscale("log")
    plots.finish(fig, ax, out / "params_vs_loss.png", "parameters (unique)", "final validation loss",
                 "parameters vs final loss (mean ± std over seeds)")
    written.append("params_vs_loss.png")
    return written


def write_report(out: Path, recipe: Recipe, plan: list[Planned], data: dict,
                 command: str | None = None, log: Callable[[str], None] | None = None,
                 tuning: dict | None = None) -> dict:
    """summary.json, report.md and the plots (``tuning``: ``tune.run_tuning``'s results)."""

    s = summarize(out, recipe, plan)
    s["tuning"] = tuning or {}
    machine = _machine(resolve_device(recipe.train["device"], "the recipe's train.device"))
    s.update(recipe=recipe.to_dict(), data=data, machine=machine, software=software_versions(),
             command=command, reproduce=f"phaseloop compare {shlex.quote(str(out / 'recipe.json'))}"
             f" --out {shlex.quote(str(out) + '-repro')}")
    plots = write_plots(out, s)
    if tuning and isinstance(plots, list):
        plots.append(tune.plot(out, tuning))
    s["plots"] = plots if isinstance(plots, list) else []
    write_json(out / "summary.json", s)
    if isinstance(plots, str) and log:
        log(f"note: {plots}")

    table = format_table(s)
    notes = [v for v in s["variants"] if v.get("matched")]
    tests = [v["vs_reference"] for v in s["variants"] if v.get("vs_reference")]
    md = [f"# Comparison: {recipe.name}", "", recipe.description, "",
          f"Data: `{data['source']}` ({data['tokens']:,} tokens, {data['tokenizer']} tokenizer), "
          f"seeds {recipe.seeds}, {recipe.train['steps']} steps of "
          f"{recipe.train['batch_size'] * recipe.train['grad_accum']} x "
          f"{recipe.train['seq_len'] or 'max_seq_len'} tokens per run; reference: "
          f"**{recipe.reference}**; training time of all runs {s['train_time_s'] / 60:.1f} min "
          "(evaluation excluded).", "", table, "",
          f"- Target = the reference's final validation loss (seed mean), "
          f"{s['target_val_loss']:.4f}. Step speedup (3PT paper's definition) = the "
          "reference's first step reaching the target / the variant's, on seed-mean "
          "curves, interpolating linearly between evaluations; wall-clock speedup likewise "
          "with training time (evaluation excluded). A variant whose curve never reaches the "
          "target shows \"not reached\".",
          f"- vs reference: paired t-test over seeds on the final validation loss "
          f"(alpha={recipe.alpha}); better / worse = lower / higher loss beyond seed noise."]
    controls = [v for v in s["variants"] if v.get("vs_control")]
    if controls:
        md.append("- vs control: the same paired t-test against the variant named after the verdict "
                  "(a control that differs from it in one respect), " + "; ".join(
                      f"{v['name']}: {_verdict(v['vs_control'])} vs {v['vs_control']['control']}"
                      for v in controls) + ".")
    if any(t.get("note") for t in tests):
        md.append(f"- Note: {next(t['note'] for t in tests if t.get('note'))}.")
    if recipe.eval_tasks:
        md.append(f"- lm-eval columns (task/metric, mean ± std over seeds): `phaseloop lm-eval` on each "
                  f"finished run, tasks {', '.join(recipe.eval_tasks)}"
                  + (f", the first {recipe.eval_limit} examples of each" if recipe.eval_limit else "")
                  + "; each run's results are in its lm_eval/results.json.")
    if any(v.get("downstream") for v in s["variants"]):
        md.append("- downstream avg: the mean over the `[eval]` tasks of each run's accuracy (acc_norm where "
                  "lm-eval reports it, else acc), mean ± std over seeds, and its paired t-test against the "
                  "reference (higher is better); per task: the Downstream tasks section.")
    md.append("- Peak memory: the run's peak RSS (CPU; reset between runs) or peak CUDA "
              "allocation; MFLOP/tok: forward FLOPs per token at the training length.")
    own = [v for v in s["variants"] if v.get("settings")]
    if own:
        md += ["", "## Training settings per variant", "",
               "Beyond [train] (the variant's own `train` table, then its tuned point; each run's "
               "config.json holds all of them):", ""]
        md += [f"- {v['name']}: " + ", ".join(f"{k} = {x}" for k, x in sorted(v["settings"].items()))
               for v in own]
    md += downstream_lines(s, recipe)
    md += tune.report_lines(s["tuning"])
    if notes:
        md += ["", "## Budget matching", ""]
        md += [f"- {v['name']}: {describe_match(v['matched'])}" for v in notes]
    if recipe.paper:
        md += ["", "## The paper's numbers (to compare with)", "", "```json",
               json.dumps(recipe.paper, indent=2), "```"]
    md += ["", "## Plots", ""]
    md += ([f"![{f}]({f})" for f in s["plots"]] if s["plots"] else [f"({plots})"])
    md += ["", "## Recipe", "", "```json", json.dumps(recipe.to_dict(), indent=2), "```", "",
           "## Data", "", "```json", json.dumps(data, indent=2), "```", "",
           "## Machine and software", "", "```json",
           json.dumps({"machine": machine, "software": s["software"]}, indent=2), "```", "",
           "## Reproduce", "", "```sh", s["reproduce"], "```"]
    if command:
        md += ["", f"Invoked as: `{command}`"]
    atomic_write_bytes(out / "report.md", ("\n".join(md) + "\n").encode())
    return s
