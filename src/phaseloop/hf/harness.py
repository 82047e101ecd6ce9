"""lm-evaluation-harness on a phaseloop run (``phaseloop lm-eval``), with local tasks.

The run is wrapped in memory (``from_run``: no export) and handed to lm-eval's ``HFLM``.
Local task definitions for what ``$PHASELOOP_DATA_DIR`` holds offline, written next to
the results (``RUN/lm_eval/tasks``) with the data paths filled in:

* ``lambada_local``: LAMBADA test (``lambada/lambada_test.jsonl``, 5,153 passages), the
  UT paper's last-word task, exactly as lm-eval's ``lambada_openai``: context = all but
  the last space-separated word, target = " " + that word; accuracy (the word is the
  greedy continuation) and perplexity.
* ``wikitext2_local``: WikiText-2 test (``wikitext-2/wiki.test.raw``) cut into its
  articles (phaseloop's WikiText reader: 62 documents), scored as lm-eval's ``wikitext``
  (rolling loglikelihood over max_length windows of the detokenised page; word
  perplexity, byte perplexity, bits per byte, counted on the raw page).

A text with no context is conditioned on ``prefix_token_id`` (the tokenizer's EOS, else
its newline token: phaseloop models train on raw text with no BOS/EOS).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

from phaseloop.data.sources import _articles
from phaseloop.engine import resolve_device
from phaseloop.engine.checkpoint import run_folder
from phaseloop.errors import ConfigError, DataError, PhaseloopError, first_line
from phaseloop.files import atomic_write_bytes, dumps, why_missing
from phaseloop.hf import require
from phaseloop.hf.export import from_run
from phaseloop.hf.tokenizer import prefix_token_id

LOCAL_TASKS = {
    "lambada_local": ("lambada/lambada_test.jsonl", """\
task: lambada_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""),
    "wikitext2_local": ("wikitext-2/wiki.test.raw", """\
task: wikitext2_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: !function wikitext_local.wikitext_detokenizer
process_results: !function wikitext_local.process_results
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 2.0
"""),
}
# lm-eval's own WikiText functions, imported beside the YAML that names them
_WIKITEXT_PY = ("from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer"
                "  # noqa: F401\n")


def data_dir(given: str | None = None) -> Path | None:
    d = given or os.environ.get("PHASELOOP_DATA_DIR")
    return Path(d).expanduser() if d else None


def write_local_tasks(dest: Path, data: Path | None, wanted: list[str]) -> None:
    """Write the YAML of every local task in ``wanted`` into ``dest``."""

    dest.mkdir(parents=True, exist_ok=True)
    for name in wanted:
        if name not in LOCAL_TASKS:
            continue
        rel, template = LOCAL_TASKS[name]
        if data is None or not (data / rel).is_file():
            where = f"{data / rel} is missing" if data else "no data folder is set"
            raise ConfigError(f"task {name} reads {rel} under the data folder, but {where}; pass "
                              "--data-dir DIR or set PHASELOOP_DATA_DIR to the folder holding it")
        path = data / rel
        if name == "wikitext2_local":  # one JSON line {"page": article} per article
            try:
                with open(path, "rb") as raw:
                    lines = [json.dumps({"page": b"".join(a).decode("utf-8")}) for a in _articles(raw, False)]
            except UnicodeDecodeError as e:
                raise DataError(f"task {name}: {path} is not UTF-8 text (byte {e.start}): the file is damaged; "
                                "restore it from WikiText-2's raw release") from None
            if not lines:
                raise DataError(f"task {name}: {path} holds no article (WikiText's ' = Title = ' lines): the file "
                                "is empty or damaged; restore it from WikiText-2's raw release")
            path = dest / "wikitext2_test_pages.jsonl"
            atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
            atomic_write_bytes(dest / "wikitext_local.py", _WIKITEXT_PY.encode())
        else:  # JSON lines: checked here, where lm-eval's loader fails deep in datasets
            _check_jsonl(name, path)
        atomic_write_bytes(dest / f"{name}.yaml", template.format(data=json.dumps(str(path.resolve()))).encode())


def _check_jsonl(task: str, path: Path) -> None:
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"task {task}: {path} is not UTF-8 text (byte {e.start}): the file is damaged; restore it "
                        "from its release") from None
    records = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            raise DataError(f"task {task}: {path} line {n} is not a JSON object: the file is damaged; restore it "
                            "from its release")
        if not isinstance(obj.get("text"), str):  # the task's template reads doc.text
            raise DataError(f"task {task}: {path} line {n} has no \"text\" string (it has "
                            f"{', '.join(map(repr, list(obj)[:5])) or 'no field'}): the file is damaged; restore "
                            "it from its release")
        records += 1
    if not records:
        raise DataError(f"task {task}: {path} holds no record: the file is empty or damaged; restore it from its "
                        "release")


def _hflm(HFLM):
    """lm-eval's ``HFLM`` for a tokenizer that may have no EOS (a run's bytes): a
    ``generate_until`` task then stops at its own ``until`` strings and ``max_gen_toks``
    only (lm-eval decodes the EOS id into one more stop string, and fails on None)."""

    class PhaseloopLM(HFLM):
        def tok_decode(self, tokens, skip_special_tokens: bool = True):
            return None if tokens is None else super().tok_decode(tokens, skip_special_tokens=skip_special_tokens)
    return PhaseloopLM


def settings(tasks: list[str], limit, depth, extend_loops, dtype: str) -> dict:
    """What a results.json was scored with (``phaseloop`` key): reused only where it matches."""
    return {"tasks": sorted(tasks), "limit": limit, "depth": depth, "extend_loops": extend_loops, "dtype": dtype}


def _check_include_path(include_path: str | Path | None) -> None:
    """Refuse an ``--include-path`` that is not a folder, or holds a task YAML lm-eval
    cannot read (it would skip that file silently and then call its task unknown)."""
    if include_path is None:
        return

    path = Path(include_path)
    if not path.exists():
        raise PhaseloopError(f"--include-path {path} {why_missing(path)}; pass a folder of lm-eval "
                             "task YAMLs")
    if not path.is_dir():
        raise PhaseloopError(f"--include-path {path} is a file, not a folder; pass the folder holding it")
    try:  # lm-eval's own loader, as its task index reads the files (!function not resolved)
        from lm_eval.tasks._index import TaskIndex
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # another lm-eval layout: it reports what it cannot read itself
        return
    for yaml_path in TaskIndex._iter_yaml_files(path):
        try:
            TaskIndex.process_cfg(load_yaml(yaml_path, resolve_func=False), yaml_path, {})
        except Exception as e:  # yaml.YAMLError, ValueError, KeyError, ...: lm-eval's "skip"
            first = first_line(" ".join(str(e).replace(str(Path(yaml_path).resolve()), "it").split()), 160)
            raise PhaseloopError(f"--include-path {path}: {yaml_path} is not a task lm-eval can read "
                                 f"({type(e).__name__}: {first}); fix or remove it") from None


@contextlib.contextmanager
def resolved_tasks(tasks: list[str], *, include_path: str | Path | None = None, data: str | None = None):
    """(lm-eval's TaskManager for ``tasks``, the local tasks' folder), every task known, or a refusal (one line) before
    anything is written anywhere: ``--tasks`` empty, a local task whose data is missing, an
    ``--include-path`` missing or holding a broken YAML, an unknown task. The local tasks'
    YAMLs live in a temporary folder while it is open. ``lm-eval`` and ``compare`` (a
    recipe's ``eval_tasks``, before anything trains) check tasks through here."""
    require("transformers", "lm_eval")
    if not tasks:
        raise PhaseloopError("--tasks is empty; name tasks, e.g. --tasks lambada_local,wikitext2_local")
    if any(not t for t in tasks):  # "a,,b", a trailing comma
        raise PhaseloopError(f"--tasks {','.join(tasks)!r} has an empty name between its commas; name tasks "
                             "separated by commas, e.g. --tasks lambada_local,wikitext2_local")
    _check_include_path(include_path)
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="phaseloop-lm-eval-") as tmp:
        local = Path(tmp) / "tasks"
        write_local_tasks(local, data_dir(data), tasks)
        includes = [str(local)] + ([str(include_path)] if include_path else [])
        # lm-eval indexes its ~15k built-in tasks in ~12 s: only when a task is not ours
        manager = TaskManager(include_path=includes, include_defaults=False)
        if any(t not in manager.all_tasks for t in tasks):
            manager = TaskManager(include_path=includes)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if unknown:
            raise ConfigError(f"unknown lm-eval task {unknown[0]!r}; the local ones are "
                              f"{', '.join(LOCAL_TASKS)}; list the others with `lm-eval ls tasks` "
                              "(or give --include-path DIR of task YAMLs)")
        yield manager, local


def lm_eval_run(run: str | Path, tasks: list[str], *, include_path: str | None = None,
                limit: int | float | None = None, batch_size: int = 8, device: str = "cpu",
                dtype: str = "float32", data: str | None = None, log_samples: bool = False,
                write: bool = True, depth: int | None = None, extend_loops: str | None = None) -> dict:
    """Run lm-eval's ``simple_evaluate`` on ``run``; returns its results dict (with
    ``samples`` when ``log_samples``) and, with ``write``, writes
    ``RUN/lm_eval/results.json`` and ``results.md`` (its table) and the local tasks'
    YAMLs it used (``RUN/lm_eval/tasks``). A refused task, or an evaluation that fails,
    writes nothing in the run."""
    if batch_size < 1 or (limit is not None and not (limit > 0 and math.isfinite(limit))):
        raise PhaseloopError(f"--batch-size {batch_size}, --limit {limit}: both must be positive and finite "
                             "(--limit: examples per task, or a fraction of them below 1)")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import make_table

    run_dir = run_folder(run)
    dev = resolve_device(device)
    out = run_dir / "lm_eval"
    # the tasks are resolved (and refused: empty, unknown, broken YAML) before the model loads
    with resolved_tasks(tasks, include_path=include_path, data=data) as (manager, local):

        hf, fast, run_cfg, tok = from_run(run, dev, dtype, depth=depth, extend_loops=extend_loops)
        lm = _hflm(HFLM)(pretrained=hf, tokenizer=fast, backend="causal", batch_size=batch_size,
                  max_length=hf.model.cfg.max_seq_len, prefix_token_id=prefix_token_id(tok, fast))
        res = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                              log_samples=log_samples, bootstrap_iters=0)
    if write:
        write_local_tasks(out / "tasks", data_dir(data), tasks)  # the definitions the results used
        keep = {k: v for k, v in res.items() if k != "samples"}
        keep["phaseloop"] = settings(tasks, limit, depth, extend_loops, dtype)
        text = dumps(keep, indent=2, default=str).replace(str(local), str(out / "tasks"))
        atomic_write_bytes(out / "results.json", text.encode())
        atomic_write_bytes(out / "results.md", (make_table(res) + "\n").encode())
    return res


def scores(res: dict) -> dict[str, float]:
    """Flat {task/metric: value} of a results dict (lm-eval's ``metric,filter`` keys)."""
    flat = {}
    for task, metrics in res.get("results", {}).items():
        for key, value in metrics.items():
            name = key.split(",")[0]
            if isinstance(value, (int, float)) and not name.endswith("_stderr") and name != "sample_len":
                flat[f"{task}/{name}"] = float(value)
    return flat
