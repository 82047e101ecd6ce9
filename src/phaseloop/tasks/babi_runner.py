"""bAbI runs (Dehghani et al. 2019, "Universal Transformers" §3.1): per task or joint,
error per task over seeds, ponder time by supporting facts, error per task x depth
(``test_depths``). The shared machinery (one model's run, output folders, depth checks)
is ``tasks.runner``'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from phaseloop.analysis.stats import mean_std
from phaseloop.config import ModelConfig
from phaseloop.engine import TrainConfig
from phaseloop.errors import ConfigError
from phaseloop.files import write_json
from phaseloop.tasks.algorithmic import Example
from phaseloop.tasks.babi import N_TASKS as N_BABI_TASKS
from phaseloop.tasks.babi import (
    BabiExample,
    WordVocab,
    failed_tasks,
    format_example,
    load_babi,
    ponder_by_supporting,
    task_error,
)
from phaseloop.tasks.positions import check_positions, positions_needed
from phaseloop.tasks.report import model_label
from phaseloop.tasks.runner import _jsonable, _prepare_out, _step_log, check_test_depths, run_examples
from phaseloop.tasks.task_model import encode_pairs, is_seq2seq


def babi_pairs(examples: Sequence[BabiExample], max_sentences: int | None) -> list[Example]:
    """bAbI questions as ``Example(prompt, answer, length=n_supporting)``."""
    out = []
    for ex in examples:
        prompt, answer = format_example(ex, max_sentences)
        out.append(Example(prompt, answer, ex.n_supporting))
    return out


def check_babi_tasks(tasks: Sequence[int], seeds: Sequence[int] = (0,)) -> None:
    """Refuse, before anything is read, trained or written, a bAbI task list that is empty,
    names a task outside 1..20 or names one twice (each task is one run folder, so the
    second would be refused only after the first had trained), and repeated seeds."""
    if not tasks:
        raise ConfigError("--tasks names no bAbI task; write task numbers like 1,2,3")
    bad = [t for t in tasks if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= N_BABI_TASKS]
    if bad:
        raise ConfigError(f"--tasks: bAbI task must be an integer 1..{N_BABI_TASKS}, got {bad[0]!r}")
    for what, items in (("--tasks", list(tasks)), ("--seeds", list(seeds))):
        twice = next((x for i, x in enumerate(items) if x in items[:i]), None)
        if twice is not None:
            raise ConfigError(f"{what} {','.join(map(str, items))} names {twice} twice; name each once")


def run_babi(model_cfg: ModelConfig, data_dir, tasks: Sequence[int], tc: TrainConfig,
             joint: bool = False, max_sentences: int | None = 20, arch: str | None = None,
             log: Callable[[dict], None] | None = None, max_test: int | None = None,
             out_dir=None, resume: bool = False, note: Callable[[str], None] | None = None,
             test_depths: Sequence[int] = (), extend_loops: str | None = None) -> dict:
    """Train per task (one model each) or jointly (one model on all tasks' training
    questions) and score the test questions: error per task, failed tasks (> 5%),
    and for ACT models ponder time by number of supporting facts per task.
    ``max_sentences``: keep the last k story sentences (None: all); ``max_test``: score
    only the first k test questions per task (None: all); ``out_dir``: one run folder
    per model (``task-<t>`` or ``joint``); ``note``: see ``check_positions``; ``test_depths``:
    the error per task at each depth too (``"per_depth": {d: {errors, failed, mean_error}}``)."""
    check_babi_tasks(tasks)
    check_test_depths(model_cfg, arch, test_depths, extend_loops)
    if max_test is not None and (isinstance(max_test, bool) or not isinstance(max_test, int) or max_test < 1):
        raise ConfigError(f"--n-test {max_test!r}: score at least 1 test question per task (an integer >= 1), "
                          "or leave it out to score them all")
    train = {t: load_babi(data_dir, t, "train") for t in tasks}
    test = {t: load_babi(data_dir, t, "test")[:max_test] for t in tasks}
    texts = [s for d in (train, test) for exs in d.values() for e in babi_pairs(exs, max_sentences)
             for s in (e.input, e.target)]
    vocab = WordVocab.for_texts(texts)
    groups = [list(tasks)] if joint else [[t] for t in tasks]
    hint = " (or keep fewer story sentences with --max-sentences)"
    data = {}
    for grp in groups:  # a max_seq_len too small for any model stops the run before the first trains
        tr = [e for t in grp for e in babi_pairs(train[t], max_sentences)]
        te_raw = [e for t in grp for e in test[t]]
        te = babi_pairs(te_raw, max_sentences)
        check_positions(model_cfg, *positions_needed(tr, te, encode_pairs(tr, vocab), encode_pairs(te, vocab),
                                                     seq2seq=is_seq2seq(arch)), hint)
        data[grp[0]] = tr, te_raw, te
    errors, ponder, ans_ponder, covered, seconds, params = {}, {}, {}, {}, 0.0, 0
    depth_errors: dict[int, dict] = {d: {} for d in test_depths}
    for grp in groups:
        tr, te_raw, te = data[grp[0]]
        run_dir = None if out_dir is None else Path(out_dir) / ("joint" if joint else f"task-{grp[0]}")
        res = run_examples(model_cfg, tr, te, tc, vocab, arch, log, run_dir=run_dir, resume=resume,
                           describe={"babi_tasks": grp, "max_sentences": max_sentences, "max_test": max_test},
                           note=note, too_long_hint=hint, test_depths=test_depths, extend_loops=extend_loops)
        seconds += res["seconds"]
        params = res["params"]
        errors.update(task_error(res["preds"], te_raw))
        for d in test_depths:
            depth_errors[d].update(task_error(res["depth_preds"][d], te_raw))
        dec = res["decoded"]
        for t in grp:
            sel = [i for i, e in enumerate(te_raw) if e.task == t]
            kept = [te_raw[i] for i in sel]
            covered[t] = _supporting_kept(kept, max_sentences)
            if dec.ponder[sel[0]] is not None:
                ponder[t] = ponder_by_supporting([dec.ponder[i] for i in sel], kept)
                ans_ponder[t] = ponder_by_supporting([dec.answer_ponder[i] for i in sel], kept)
    per_depth = {d: _babi_errors(e) for d, e in depth_errors.items()}
    return {**_babi_errors(errors), "ponder_by_supporting": ponder, "answer_ponder_by_supporting": ans_ponder,
            "supporting_in_window": covered, "vocab_size": len(vocab), "params": params,
            "seconds": seconds, **({"per_depth": per_depth} if test_depths else {})}


def _babi_errors(errors: dict[int, float]) -> dict:
    return {"errors": errors, "failed": failed_tasks(errors), "mean_error": sum(errors.values()) / len(errors)}


def _babi_summary(per_seed: Sequence[dict], tasks: Sequence[int]) -> dict:
    """Error per task, failed tasks and mean error: mean and std over seeds."""
    return {"errors": {t: mean_std((r["errors"][t] for r in per_seed), ddof=0) for t in tasks},
            "failed": mean_std((len(r["failed"]) for r in per_seed), ddof=0),
            "mean_error": mean_std((r["mean_error"] for r in per_seed), ddof=0)}


def run_babi_seeds(model_cfg: ModelConfig, data_dir, tasks: Sequence[int], tc: TrainConfig,
                   seeds: Sequence[int], joint: bool = False, max_sentences: int | None = 20,
                   out_dir=None, arch: str | None = None,
                   log: Callable[[str], None] | None = print, max_test: int | None = None,
                   resume: bool = False, test_depths: Sequence[int] = (),
                   extend_loops: str | None = None) -> dict:
    """``run_babi`` for several seeds; summary (mean +- std over seeds) of error per
    task and of ponder time per task and number of supporting facts; writes
    ``metrics.json`` into ``out_dir`` when given (run folders ``seed-<s>/...``);
    ``test_depths``: ``summary.per_depth`` too, the same summary at each depth."""
    check_babi_tasks(tasks, seeds)
    check_test_depths(model_cfg, arch, test_depths, extend_loops)
    out = _prepare_out(out_dir, resume)
    label = model_label(model_cfg, arch)
    per_seed = []
    for seed in seeds:
        if log:
            log(f"[seed {seed}] {label} on bAbI tasks {','.join(map(str, tasks))} "
                f"({'joint' if joint else 'per task'}), {tc.steps} steps")
        res = run_babi(model_cfg, data_dir, tasks, tc.replace(seed=seed), joint, max_sentences, arch,
                       _step_log(log), max_test, out / f"seed-{seed}" if out else None, resume, note=log,
                       test_depths=test_depths, extend_loops=extend_loops)
        res["seed"] = seed
        per_seed.append(res)
    summary: dict = {**_babi_summary(per_seed, tasks), "ponder": {}, "answer_ponder": {}}
    for t in tasks:
        for key, src in (("ponder", "ponder_by_supporting"), ("answer_ponder", "answer_ponder_by_supporting")):
            if t in per_seed[0][src]:
                summary[key][t] = {k: tuple(mean_std((r[src][t][k][i] for r in per_seed), ddof=0) for i in (0, 1))
                                   for k in per_seed[0][src][t]}
    if test_depths:
        summary["per_depth"] = {d: _babi_summary([r["per_depth"][d] for r in per_seed], tasks) for d in test_depths}
    result = {"tasks": list(tasks), "arch": arch or model_cfg.arch, "label": label, "joint": joint,
              "seeds": list(seeds), "max_sentences": max_sentences, "data_dir": str(data_dir),
              "train_config": tc.to_dict(), "summary": summary, "per_seed": per_seed}
    if out is not None:
        write_json(out / "metrics.json", _jsonable(result))
    return result


def _supporting_kept(examples: Sequence[BabiExample], max_sentences: int | None) -> float:
    """Fraction of questions whose supporting facts are all inside the story window."""
    if max_sentences is None:
        return 1.0
    ok = sum(all(i >= len(e.story) - max_sentences for i in e.supporting_index) for e in examples)
    return ok / len(examples)
