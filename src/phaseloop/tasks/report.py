"""Task results: per-length metrics with ponder time, means over seeds, the tables the
``task`` and ``babi`` commands print, and the labels and length ranges they carry."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from phaseloop.analysis.stats import mean_std
from phaseloop.tasks.algorithmic import Example
from phaseloop.tasks.metrics import per_length_metrics


def model_label(model_cfg, arch: str | None = None) -> str:
    """The model's name in reports: the arch (``arch`` for an encoder-decoder, else
    ``model_cfg.arch``) with ``+act`` for ACT, as ``phaseloop compare`` spells the
    variant (``universal+act``, ``registry.modifiers()``)."""
    name = arch or model_cfg.arch
    return f"{name}+act" if model_cfg.act else name


def length_span(examples: Sequence[Example]) -> str:
    """The range of ``Example.length`` over ``examples``: ``"3-17"``, or ``"5"`` when all
    are equal (the task command's ``--train-len`` / ``--test-len`` notation)."""
    lo, hi = min(e.length for e in examples), max(e.length for e in examples)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def task_title(result: dict) -> str:
    """The header of the ``task`` table, from a ``run_task`` result: task, model label,
    the lengths trained and tested on, seeds."""
    return (f"{result['task']} | {result.get('label', result['arch'])} | train {result['train_lengths']} | "
            f"test {result['test_lengths']} | seeds {','.join(map(str, result['seeds']))} "
            "(mean ±population std over seeds)")


def length_metrics(examples: Sequence[Example], preds: Sequence[str],
                   ponder: Sequence[torch.Tensor | None]) -> dict[int, dict]:
    """``per_length_metrics`` plus, for ACT models, ``ponder_mean``/``ponder_std``
    over all positions of that length's examples."""
    res = per_length_metrics(examples, preds)
    if ponder and ponder[0] is not None:
        for L in res:
            vals = torch.cat([p for ex, p in zip(examples, ponder) if ex.length == L])
            res[L]["ponder_mean"], res[L]["ponder_std"] = mean_std(vals.tolist(), ddof=0)
    return res


def summarize_seeds(results: Sequence[dict]) -> dict:
    """Mean and std across seeds per length and overall."""
    out: dict = {"per_length": {}}
    lengths = sorted(results[0]["per_length"])
    keys = [k for k in ("char_acc", "seq_acc", "ponder_mean", "ponder_std")
            if k in results[0]["per_length"][lengths[0]]]
    for L in lengths:
        row = {"n": results[0]["per_length"][L]["n"]}
        for k in keys:
            row[k], row[k + "_seed_std"] = mean_std((r["per_length"][L][k] for r in results), ddof=0)
        out["per_length"][L] = row
    for k in ("char_acc", "seq_acc", "final_loss"):
        out[k], out[k + "_seed_std"] = mean_std((r[k] for r in results), ddof=0)
    return out


def format_table(summary: dict, title: str = "") -> str:
    rows = summary["per_length"]
    has_p = any("ponder_mean" in r for r in rows.values())
    head = f"{'length':>6} {'n':>5} {'char acc':>15} {'seq acc':>15}" + (f" {'ponder/pos':>13}" if has_p else "")
    lines = ([title] if title else []) + [head]
    for L, r in rows.items():
        s = (f"{L:>6} {r['n']:>5} {r['char_acc']:>8.3f} ±{r['char_acc_seed_std']:.3f}"
             f" {r['seq_acc']:>8.3f} ±{r['seq_acc_seed_std']:.3f}")
        if has_p:
            s += f" {r['ponder_mean']:>6.2f} ±{r['ponder_std']:.2f}"
        lines.append(s)
    lines.append(f"{'all':>6} {'':>5} {summary['char_acc']:>8.3f} ±{summary['char_acc_seed_std']:.3f}"
                 f" {summary['seq_acc']:>8.3f} ±{summary['seq_acc_seed_std']:.3f}")
    return "\n".join(lines)


def format_depth_table(summary: dict) -> str:
    """--test-depth: sequence accuracy (mean ±population std over seeds) per test length x depth."""
    per_depth = summary["per_depth"]
    depths = list(per_depth)
    lines = ["sequence accuracy by test length x depth (UT steps / loop passes)",
             f"{'length':>6}" + "".join(f"{'depth ' + str(d):>16}" for d in depths)]
    for L in next(iter(per_depth.values()))["per_length"]:
        lines.append(f"{L:>6}" + "".join(f"{per_depth[d]['per_length'][L]['seq_acc']:>9.3f} "
                                         f"±{per_depth[d]['per_length'][L]['seq_acc_seed_std']:.3f}"
                                         for d in depths))
    lines.append(f"{'all':>6}" + "".join(f"{per_depth[d]['seq_acc']:>9.3f} ±{per_depth[d]['seq_acc_seed_std']:.3f}"
                                         for d in depths))
    return "\n".join(lines)


def format_babi_table(out: dict) -> str:
    s = out["summary"]
    title = (f"bAbI tasks {','.join(map(str, out['tasks']))} | {out.get('label', out['arch'])} | "
             f"{'joint' if out['joint'] else 'one model per task'} | seeds {','.join(map(str, out['seeds']))}"
             " (mean ±population std over seeds)")
    lines = [title, f"{'task':>4} {'error':>15} {'window':>7}  ponder by supporting facts: mean±std over questions"
             " of the per-question mean over positions; at the answer position"]
    for t in out["tasks"]:
        m, sd = s["errors"][t]
        cov = sum(r["supporting_in_window"][t] for r in out["per_seed"]) / len(out["per_seed"])
        p = s["ponder"].get(t, {})
        a = s["answer_ponder"].get(t, {})
        pond = "  ".join(f"{k} fact{'s' if int(k) > 1 else ''}: {v[0][0]:.2f}±{v[1][0]:.2f}; "
                         f"{a[k][0][0]:.2f}±{a[k][1][0]:.2f}" for k, v in p.items()) or "-"
        lines.append(f"{t:>4} {m:>8.3f} ±{sd:.3f} {cov:>7.2f}  {pond}")
    fm, fs = s["failed"]
    em, es = s["mean_error"]
    lines.append(f"mean error {em:.3f} ±{es:.3f}; failed tasks (>5% error) {fm:.1f} ±{fs:.1f} "
                 f"of {len(out['tasks'])}; window = fraction of test questions whose supporting facts "
                 "are inside the story window")
    return "\n".join(lines)


def format_babi_depth_table(out: dict) -> str:
    """--test-depth on bAbI: error per task (mean ±population std over seeds) at each depth."""
    per_depth = out["summary"]["per_depth"]
    depths = list(per_depth)
    lines = ["bAbI error by task x depth (UT steps / loop passes)",
             f"{'task':>6}" + "".join(f"{'depth ' + str(d):>16}" for d in depths)]
    for t in out["tasks"]:
        lines.append(f"{t:>6}" + "".join(f"{per_depth[d]['errors'][t][0]:>9.3f} ±{per_depth[d]['errors'][t][1]:.3f}"
                                         for d in depths))
    lines.append(f"{'mean':>6}" + "".join(f"{per_depth[d]['mean_error'][0]:>9.3f} ±{per_depth[d]['mean_error'][1]:.3f}"
                                          for d in depths))
    return "\n".join(lines)
