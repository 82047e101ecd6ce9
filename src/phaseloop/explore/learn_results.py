"""Learn endpoints for UT §7 (what ACT learned, the results) and §8 (self-check).

The paper's numbers are quoted below with their section; phaseloop's own measured
results are read from the files its runs write in the served folders, never typed in:
``benchmarks/claim_act.py``'s JSON (one per variant and seed, ``<name>-s<seed>.json``)
and the ``metrics.json`` of ``phaseloop task`` / ``phaseloop babi`` runs (the served
folder or one level below). Without such files the page says so and names the commands
that write them.
"""

from __future__ import annotations

import json
import statistics

from phaseloop.explore.context import BadInput

# Dehghani et al. 2019, quoted (the explainer's §7-§8; /work/shared/specs/explainer.md)
PAPER = {
    "babi_ponder": {"source": "§3.1 (bAbI, mean ponder time over all positions of the test set)",
                    "columns": ["supporting facts", "ponder time"],
                    "rows": [[1, "2.3 ± 0.8"], [2, "3.1 ± 1.1"], [3, "3.8 ± 2.2"]]},
    "lambada": {"source": "Table 3 (LAMBADA test perplexity; UT+ACT runs 8.2 ± 2.1 steps)",
                "columns": ["model", "test perplexity"],
                "rows": [["UT, fixed 6 steps", 319], ["UT, fixed 8 steps", 202],
                         ["UT, fixed 9 steps", 239], ["UT + ACT", 142]]},
    "algorithmic": {"source": "§3.4 (train length 40, test 400; char / sequence accuracy)",
                    "columns": ["model", "copy", "reverse", "addition"],
                    "rows": [["Transformer", "0.53 / 0.03", "0.13 / 0.06", "0.07 / 0.0"],
                             ["Universal Transformer", "0.91 / 0.35", "0.96 / 0.46", "0.34 / 0.02"],
                             ["Neural GPU (curriculum)", "1.0 / 1.0", "1.0 / 1.0", "1.0 / 1.0"]]},
    "babi_error": {"source": "§3.1 (bAbI 10k, mean error over the 20 tasks)",
                   "columns": ["model", "mean error"],
                   "rows": [["Transformer", "15.2 %"], ["UT", "0.23 %"], ["UT + ACT", "0.21 %"]],
                   "reading": "UT + ACT passes all 20 tasks; the gap to the Transformer is largest with 1k "
                              "training examples."},
    "agreement": {"source": "§3.2 (subject–verb agreement: UT + ACT's accuracy minus the best earlier model's)",
                  "columns": ["attractors", "difference"],
                  "rows": [[1, "−0.008"], [3, "+0.009"], [4, "+0.016"], [5, "+0.027"]],
                  "reading": "The more attractors (nouns between subject and verb), the larger the gain."},
    "learning_to_execute": {"source": "§3.5 (learning to execute, memorisation tasks; accuracy)",
                            "columns": ["model", "copy", "double", "reverse"],
                            "rows": [["UT", "1.0", "1.0", "1.0"]]},
    "translation": {"source": "§3.6 (WMT14 English–German, BLEU)",
                    "columns": ["model", "BLEU"],
                    "rows": [["Transformer base", "28.0"], ["Transformer big", "28.4"],
                             ["UT small (base's compute)", "26.8"], ["UT base (base's parameters + 6.7 %)", "28.9"]],
                    "reading": "At equal compute sharing the weights costs quality; at equal parameters it gains "
                               "(the calculator's presets)."},
}
# The explainer's §9-§11: where the ideas went next
LINEAGE = [
    {"name": "ALBERT (Lan et al. 2020)",
     "text": "shares every layer's weights: BERT-base ~108M → ALBERT-base ~12M parameters; the compute "
             "per token does not shrink."},
    {"name": "Conditional depth",
     "text": "Mixture-of-Depths (Raposo et al. 2024) and early exit continue per-position halting "
             "(phaseloop generate / eval --exit)."},
    {"name": "Looped Transformers",
     "text": "continue \"more steps for longer inputs\": a shared block run as often as the input needs "
             "(phaseloop's looped and hyperloop architectures, --depth at inference)."},
]
CLAIM_COMMAND = ("python benchmarks/claim_act.py  (writes runs/claim-act/<variant>-s<seed>.json); "
                 "then phaseloop explore runs/claim-act")
TASK_COMMAND = ("phaseloop task copy --arch universal --out runs/task-copy (or phaseloop babi ... "
                "--out DIR; docs/results_tasks.md); then phaseloop explore runs/task-copy")
MAX_SUBFOLDERS = 200  # a served folder's children looked at for task runs


def _claim_files(ctx) -> list[tuple[str, dict]]:
    """(where, record) for every claim_act JSON directly in a served folder or its claim-act/."""
    found = []
    for root in ctx.roots:
        for rel in ("", "claim-act"):
            try:
                folder = ctx.resolve(root, rel)
            except BadInput:
                continue
            if not folder.is_dir():
                continue
            for path in sorted(folder.glob("*-s*.json")):
                if path.is_symlink():
                    continue
                try:
                    rec = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue  # not ours or damaged: listed as skipped below
                if _fits(rec):  # else: not a claim record, or a damaged one: left out
                    found.append((f"{root}/{rel + '/' if rel else ''}{path.name}", rec))
    return found


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _length(k) -> bool:
    return isinstance(k, str) and k.isascii() and k.isdigit()  # "²" is a digit to str.isdigit


def _fits(rec) -> bool:
    """A claim run's record as ``claim-act`` writes it (what ``measured`` reads of it)."""
    per = rec.get("per_length") if isinstance(rec, dict) else None
    return (isinstance(rec.get("name") if per is not None else None, str) and isinstance(per, dict)
            and isinstance(rec.get("seed"), int) and not isinstance(rec["seed"], bool)
            and _number(rec.get("final_loss")) and (_number(rec.get("spearman")) or "spearman" not in rec)
            and all(_length(k) and isinstance(v, dict) and _number(v.get("acc"))
                    and all(_number(v[key]) for key in ("ponder", "halt1") if key in v) for k, v in per.items()))


def _stat(v) -> bool:
    """None, a number or [mean, std] (``mean_std``)."""
    return v is None or _number(v) or (isinstance(v, list) and len(v) == 2 and all(map(_number, v)))


def _optional_numbers(d: dict, keys) -> bool:
    return all(_stat(d.get(k)) for k in keys)


def _task_fits(rec) -> bool:
    """A ``task`` / ``babi`` metrics.json as their reports write it (what ``task_runs`` reads)."""
    s = rec.get("summary")
    if not isinstance(s, dict):
        return False
    if "task" in rec:
        per = s.get("per_length", {})
        return (isinstance(rec["task"], str) and _optional_numbers(s, ("char_acc", "seq_acc"))
                and isinstance(per, dict) and all(_length(k) and isinstance(r, dict) and
                                                  _optional_numbers(r, ("char_acc", "seq_acc", "ponder_mean"))
                                                  for k, r in per.items()))
    errors, ponder = s.get("errors") or {}, s.get("ponder") or {}
    return (_optional_numbers(s, ("mean_error",)) and isinstance(errors, dict) and all(map(_stat, errors.values()))
            and isinstance(ponder, dict) and all(isinstance(v, dict) for v in ponder.values()))


def measured(ctx) -> dict:
    files = _claim_files(ctx)
    if not files:
        return {"found": False, "files": [], "command": CLAIM_COMMAND,
                "message": "No claim-run results among the served folders "
                           f"({', '.join(ctx.roots) or 'none given'})."}
    variants: dict = {}
    for where, rec in files:
        variants.setdefault(rec["name"], []).append((where, rec))
    out = []
    for name, recs in sorted(variants.items()):
        lengths = sorted({int(L) for _, r in recs for L in r["per_length"]})
        rows = []
        for L in lengths:
            vals = [r["per_length"][str(L)] for _, r in recs if str(L) in r["per_length"]]
            row = {"length": L, "seeds": len(vals), "acc": statistics.mean(v["acc"] for v in vals)}
            for key in ("ponder", "halt1"):
                if all(key in v for v in vals):
                    row[key] = statistics.mean(v[key] for v in vals)
            rows.append(row)
        out.append({"name": name, "seeds": sorted(r["seed"] for _, r in recs),
                    "files": [w for w, _ in recs], "rows": rows,
                    "final_loss": statistics.mean(r["final_loss"] for _, r in recs),
                    "spearman": [r.get("spearman") for _, r in recs if "spearman" in r]})
    return {"found": True, "files": [w for w, _ in files], "variants": out, "command": CLAIM_COMMAND}


def _task_metrics(ctx) -> list[tuple[str, dict]]:
    """(where, metrics.json) of task / bAbI runs in a served folder or one level below."""
    found = []
    for root in ctx.roots:
        base = ctx.resolve(root)
        rels = [""] + sorted(p.name for p in list(base.iterdir())[:MAX_SUBFOLDERS]
                             if p.is_dir() and not p.is_symlink())
        for rel in rels:
            try:
                path = ctx.resolve(root, f"{rel}/metrics.json" if rel else "metrics.json")
                rec = json.loads(path.read_text()) if path.is_file() else None
            except (BadInput, OSError, ValueError):
                continue
            if isinstance(rec, dict) and ("task" in rec or "tasks" in rec) and _task_fits(rec):  # else: left out
                found.append((f"{root}/{rel + '/' if rel else ''}metrics.json", rec))
    return found


def task_runs(ctx) -> dict:
    runs = []
    for where, rec in _task_metrics(ctx):
        s = rec["summary"]
        row = {"file": where, "label": rec.get("label"), "arch": rec.get("arch"), "seeds": rec.get("seeds")}
        if "task" in rec:  # algorithmic (tasks/report.summarize_seeds)
            row.update(kind="algorithmic", task=rec["task"], char_acc=s.get("char_acc"),
                       seq_acc=s.get("seq_acc"), train_lengths=rec.get("train_lengths"),
                       per_length=[{"length": L, **{k: r.get(k) for k in ("char_acc", "seq_acc", "ponder_mean")}}
                                   for L, r in s.get("per_length", {}).items()])
        else:  # bAbI: error per task, ponder by number of supporting facts (mean over seeds)
            row.update(kind="babi", tasks=rec["tasks"], mean_error=s.get("mean_error"),
                       errors=s.get("errors"), ponder=s.get("ponder"))
        runs.append(row)
    return {"found": bool(runs), "runs": runs, "command": TASK_COMMAND}


def paper(ctx, params) -> dict:
    """The paper's tables and the lineage, quoted: what the calculator and summary pages show
    (without reading the served folders, as ``results`` does for its measured half)."""
    return {"paper": PAPER, "lineage": LINEAGE}


def results(ctx, params) -> dict:
    return {**paper(ctx, params), "measured": measured(ctx), "tasks": task_runs(ctx)}


# Self-check (§8): each answer is read from a widget's endpoint by the page
SELF_CHECK = [
    {"q": "How many parameters does ut-small have (tensor2tensor conventions)?",
     "endpoint": "/api/learn/accounting", "params": {"preset": "ut-small"}, "field": "model.total",
     "tol": 0.5},
    {"q": "Which shared width d (d_ff = 4d) matches transformer-base's parameters?",
     "endpoint": "/api/learn/accounting", "params": {}, "field": "match.d", "tol": 0.5},
    {"q": "How many scan steps does a length-400 input need?",
     "endpoint": "/api/learn/parity", "params": {"length": 400}, "field": "steps_needed", "tol": 0},
    {"q": "Up to which length does a fixed stack of 6 layers solve prefix parity?",
     "endpoint": "/api/learn/parity", "params": {"length": 8, "layers": 6},
     "field": "max_length_fixed_stack", "tol": 0},
    {"q": "Right after init (p = σ(1) everywhere), what is a position's ponder time N + R?",
     "endpoint": "/api/learn/act", "params": {"preset": "init"}, "field": "ponder_cost.0",
     "tol": 0.001},
    {"q": "With p = 0.05 at every step, how many steps run?",
     "endpoint": "/api/learn/act", "params": {"preset": "hesitating"}, "field": "steps_run", "tol": 0},
    {"q": "Norm of phaseloop's coordinate signal (d 512) at i − t = 997?",
     "endpoint": "/api/learn/coordinates", "params": {"d": 512, "t": 0, "positions": 1},
     "field": "far.t2t", "tol": 0.001},
    {"q": "3PT: the zero-sum diagnostic right after the horn, N = 3, T = 1024?",
     "endpoint": "/api/learn/3pt/horn", "params": {"n": 3, "T": 1024}, "field": "zero_sum",
     "tol": 0.0001},
]


def self_check(ctx, params) -> dict:
    return {"questions": SELF_CHECK}


ENDPOINTS = {"/api/learn/paper": paper, "/api/learn/results": results, "/api/learn/selfcheck": self_check}
