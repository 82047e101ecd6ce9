"""Train and evaluate a model on task examples (Dehghani et al. 2019, "Universal
Transformers": §3.1 bAbI, §3.4 algorithmic tasks; a user's JSONL file works the same way).

Every model trains through the one engine (``tasks.task_model.train_pairs``), so a task run
with an output folder has what an LM run has: per seed (and per bAbI task) a run folder
``OUT/seed-<s>[/task-<t>]`` with config.json, metrics.jsonl, checkpoints and
summary.json, resumable with ``resume=True`` (a finished seed is reloaded from its last
checkpoint and decoded again; its numbers come out the same). ``OUT/metrics.json`` holds
the summary over seeds.

Ponder time (ACT models): ``ModelOutput.stats["ponder_time"]`` [B, T] = n_updates +
remainders per position. Reported per test length as mean +- std over every position
the model processed (prompt, SEP and fed-back answer tokens), and for bAbI per example
(mean over its positions, and at the answer position, i.e. SEP) grouped by the number
of supporting facts.

Positions: a task run sizes ``max_seq_len`` to its examples (``positions_needed``) and
logs when that raises the config's value; a config whose ``max_seq_len`` the user set
(``--set max_seq_len=N``, ``fix_max_seq_len``) is a limit instead, and a run with a
longer example stops before training with a ``ConfigError`` naming that example.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from phaseloop import registry
from phaseloop.analysis import plots
from phaseloop.config import PRESETS, ModelConfig
from phaseloop.data.tokenizer import load_tokenizer
from phaseloop.depth import set_model_depth
from phaseloop.engine import RunFolder, TrainConfig, read_metrics, software_versions
from phaseloop.errors import CheckpointError, ConfigError
from phaseloop.files import write_json
from phaseloop.tasks.algorithmic import TASKS, Example, TaskSpec, parse_lengths
from phaseloop.tasks.jsonl import TokenizerVocab, load_jsonl
from phaseloop.tasks.metrics import char_accuracy, sequence_accuracy
from phaseloop.tasks.positions import check_positions, fix_max_seq_len, positions_needed
from phaseloop.tasks.report import length_metrics, length_span, model_label, summarize_seeds
from phaseloop.tasks.task_model import (
    Pair,
    build_task_model,
    decode_pairs,
    encode_pairs,
    is_seq2seq,
    task_model_class,
    train_pairs,
)
from phaseloop.tasks.vocab import CharVocab

MAX_N_TEST = 100_000  # test examples per length: more only fills memory (each one is kept)


# ----------------------------------------------------------------------------- one model

def fit_model_config(model_cfg: ModelConfig, vocab_size: int, max_len: int) -> ModelConfig:
    """The config with the task's vocabulary and a max_seq_len covering ``max_len``."""
    return model_cfg.replace(vocab_size=vocab_size, max_seq_len=max(model_cfg.max_seq_len, max_len))


def _seq_len(pairs: Sequence[Pair]) -> int:
    return max(len(s) + len(t) + 1 for s, t in pairs)


def auto_offset(train_pairs_: Sequence[Pair], test_pairs: Sequence[Pair], seq2seq: bool = False) -> int:
    """Offset range so that training batches reach every position used at test time:
    of the joined sequence (decoder-only), or of the longer of source and target
    (encoder-decoder, where each side counts its own positions)."""
    if seq2seq:
        return max(0, max(len(s) for s, _ in test_pairs) - max(len(s) for s, _ in train_pairs_),
                   max(len(t) for _, t in test_pairs) - max(len(t) for _, t in train_pairs_))
    return max(0, _seq_len(test_pairs) - _seq_len(train_pairs_))


def _fingerprint(*pair_lists: Sequence[Pair]) -> str:
    return hashlib.sha256(json.dumps(pair_lists).encode()).hexdigest()


def run_examples(model_cfg: ModelConfig, train: Sequence[Example], test: Sequence[Example],
                 tc: TrainConfig, vocab=None, arch: str | None = None,
                 log: Callable[[dict], None] | None = None, *, max_offset: int = 0,
                 eval_batch_size: int = 100, run_dir=None, resume: bool = False,
                 describe: dict | None = None, note: Callable[[str], None] | None = None,
                 too_long_hint: str = "", test_depths: Sequence[int] = (),
                 extend_loops: str | None = None) -> dict:
    """Train a fresh model (seed ``tc.seed``) on ``train``, greedy-decode ``test``.
    ``run_dir``: checkpoint there (``resume``: continue the run found there; ``describe``
    is stored as its config's ``task`` section). max_seq_len: see ``check_positions``
    (``note`` gets its message; ``too_long_hint`` is added to the fix it names).
    Returns ``{"per_length": {L: {char_acc, seq_acc, n[, ponder_mean, ponder_std]}},
    "char_acc", "seq_acc", "train_log", "params", "seconds", "preds", "decoded"}``;
    ``test_depths``: also decode at each of these depths (``depth.set_model_depth``; UT steps,
    loop passes) -> ``"per_depth": {d: {per_length, char_acc, seq_acc}}`` (and the
    predictions, ``"depth_preds": {d: [...]}``)."""
    vocab = vocab or CharVocab.for_examples(list(train) + list(test))
    if not train or not test:
        raise ConfigError(f"no {'training' if not train else 'test'} examples; a task run needs both")
    tr, te = encode_pairs(train, vocab), encode_pairs(test, vocab)
    need, where = positions_needed(train, test, tr, te, max_offset, is_seq2seq(arch))
    cfg = fit_model_config(model_cfg, len(vocab), check_positions(model_cfg, need, where, too_long_hint, note))
    run = None
    if run_dir is not None:
        task = {"arch": arch or cfg.arch, "max_offset": max_offset, "eval_batch_size": eval_batch_size,
                **(describe or {})}
        run_cfg = {"model": cfg.to_dict(), "train": tc.to_dict(), "task": task,
                   "data": {"examples": [len(tr), len(te)], "fingerprint": _fingerprint(tr, te)},
                   "software": software_versions(cfg.arch)}
        run = RunFolder.open(run_dir, run_cfg, resume and (Path(run_dir) / "config.json").exists())
    t0 = time.perf_counter()
    trainer = train_pairs(cfg, tr, tc, arch, max_offset, run, log)
    targets = [e.target for e in test]

    def score():  # greedy-decode the test set at the model's current depth
        dec = decode_pairs(task_model_class(arch)(trainer.model), te, eval_batch_size, trainer.device)
        preds = [vocab.decode(ids) for ids in dec.ids]
        return dec, preds, {"per_length": length_metrics(test, preds, dec.ponder),
                            "char_acc": char_accuracy(preds, targets), "seq_acc": sequence_accuracy(preds, targets)}

    dec, preds, scores = score()
    train_log = [r for r in (read_metrics(run.path) if run else trainer.records) if "loss" in r]
    res = {**scores, "train_log": train_log, "final_loss": train_log[-1]["loss"],
           "params": sum(p.numel() for p in trainer.model.parameters()),
           "train_seconds": trainer.elapsed, "seconds": time.perf_counter() - t0,
           "model": cfg.to_dict()}
    depth_preds = {}
    if test_depths:  # depth extrapolation (UT §4): the trained weights at other depths
        res["per_depth"] = {}
        try:
            for d in test_depths:
                set_model_depth(trainer.model, d, extend_loops)
                _, depth_preds[d], res["per_depth"][d] = score()
        finally:  # the model is returned at its trained depth
            getattr(trainer.model, "trunk", trainer.model).reset_depth()
    if run is not None:
        run.finish({**trainer.summary(), **{k: v for k, v in res.items() if k != "train_log"}})
    return {**res, "preds": preds, "depth_preds": depth_preds, "decoded": dec}


def algorithmic_data(spec: TaskSpec, n_train: int, n_test: int, seed: int,
                     test_seed: int = 10_000) -> tuple[list[Example], list[Example]]:
    """Training pool for ``seed``; the test set is fixed (``test_seed``) so every model
    and seed is scored on the same examples."""
    return spec.train(n_train, seed), spec.test(n_test, test_seed)


def split_examples(examples: Sequence[Example], test_fraction: float = 0.1,
                   seed: int = 0) -> tuple[list[Example], list[Example]]:
    """Deterministic train/test split of a user's examples (at least one of each)."""
    if len(examples) < 2:
        raise ConfigError(f"need at least 2 examples to hold some out for testing, got {len(examples)}; "
                          "add examples or pass a separate test file")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(examples), generator=g).tolist()
    k = min(len(examples) - 1, max(1, round(test_fraction * len(examples))))
    test_idx = set(perm[:k])
    return ([e for i, e in enumerate(examples) if i not in test_idx],
            [e for i, e in enumerate(examples) if i in test_idx])


# ----------------------------------------------------------------------------- commands
def parse_task(text: str) -> tuple[str, Path | None]:
    """``"copy"`` -> ("copy", None); ``"jsonl:PATH"`` -> ("jsonl", PATH)."""
    if text.startswith("jsonl:"):
        raw = text[len("jsonl:"):]
        if not raw.strip():  # Path("") would be "." (a folder)
            raise ConfigError(f"--task {text!r} has an empty path; write --task jsonl:PATH/TO/FILE.jsonl")
        return "jsonl", Path(raw)
    if text not in TASKS:
        raise ConfigError(f"unknown task {text!r}; choose {', '.join(TASKS)} or jsonl:PATH")
    return text, None


def task_model_config(arch: str | None, preset: str | None, overrides: dict | None = None
                      ) -> tuple[ModelConfig, str | None]:
    """``(model config, seq2seq arch or None)`` for the task commands: ``--preset`` wins;
    else ``--arch X`` uses the ``X-tiny`` preset, or another ``*-tiny`` preset of that
    arch (``three_phase`` -> ``3pt-tiny``). A ``max_seq_len`` in ``overrides`` is a limit
    (``fix_max_seq_len``); otherwise the run sizes max_seq_len to its examples."""
    overrides = overrides or {}
    cfg, seq2seq = _task_model_config(arch, preset, overrides)
    return (fix_max_seq_len(cfg) if "max_seq_len" in overrides else cfg), seq2seq


def _task_model_config(arch: str | None, preset: str | None, overrides: dict) -> tuple[ModelConfig, str | None]:
    if is_seq2seq(arch):
        spec = registry.seq2seq_archs()[arch]
        base = preset or f"{spec.prefixes[0]}-tiny"
        if preset is None and spec.seq2seq_defaults is not None:  # what its tiny preset lacks
            overrides = {**spec.seq2seq_defaults(ModelConfig.from_preset(base).d_model), **overrides}
        return ModelConfig.from_preset(base, **overrides), arch
    want = arch or registry.default_arch()
    name = preset or f"{want}-tiny"
    if preset is None and name not in PRESETS:  # e.g. three_phase -> 3pt-tiny
        name = next((p for p, d in PRESETS.items() if p.endswith("-tiny") and d.get("arch") == want), name)
    if name not in PRESETS:
        raise ConfigError(f"no preset {name!r} for --arch {arch}; pass --preset (phaseloop params --all "
                          f"lists them) or one of the archs with a -tiny preset")
    cfg = ModelConfig.from_preset(name, **overrides)
    if arch is not None and cfg.arch != arch:
        raise ConfigError(f"--preset {name} is arch {cfg.arch!r}, not --arch {arch!r}; drop one of them")
    return cfg, None


def _prepare_out(out_dir, resume: bool) -> Path | None:
    """A new run needs an absent or empty folder; ``resume`` one that holds seed runs."""
    if out_dir is None:
        return None
    out = Path(out_dir)
    if resume and not any(out.glob("seed-*/config.json")) and not any(out.glob("seed-*/*/config.json")):
        raise CheckpointError(f"{out} holds no task run to resume; drop --resume to start one")
    if not resume and out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; pass --resume to continue it or "
                              "choose another --out")
    return out


def _step_log(log):
    return (lambda r: log(f"  step {r['step']:>5} loss {r['loss']:.4f}")) if log else None


def check_test_depths(model_cfg: ModelConfig, arch: str | None, depths: Sequence[int],
                      extend_loops: str | None = None) -> None:
    """Refuse a depth the task model cannot run at (a stack, beyond Hyperloop's loops
    without ``extend_loops``), on a meta-device twin, before anything trains."""
    if not depths:
        return
    with torch.device("meta"):
        model = build_task_model(model_cfg, arch)
    for d in depths:
        set_model_depth(model, d, extend_loops)


def run_task(task: str, model_cfg: ModelConfig, tc: TrainConfig, seeds: Sequence[int],
             train_lengths="1-20", test_lengths="40,80", out_dir=None, n_test: int = 100,
             n_train: int | None = None, test_file=None, offsets: str | int = 0,
             arch: str | None = None, log: Callable[[str], None] | None = print,
             resume: bool = False, eval_batch_size: int = 100, tokenizer: str | None = None,
             test_depths: Sequence[int] = (), extend_loops: str | None = None) -> dict:
    """Run one task for several seeds (``n_test`` test examples per test length); write
    ``metrics.json`` and ``accuracy_vs_length.png`` into ``out_dir`` (when given, with one
    run folder per seed; ``resume`` continues them). ``task``: an algorithmic task name or
    ``jsonl:PATH`` (held-out 10% test split unless ``test_file``). ``offsets``: max random
    start offset in training, or ``"auto"`` (reach the longest test position).
    ``tokenizer``: encode a JSONL task's text with a corpus tokenizer instead of characters.
    A JSONL task reports the lengths in its data (``length_span`` of the training and the
    test examples) as ``train_lengths`` / ``test_lengths``; ``train_lengths`` and
    ``test_lengths`` apply to the algorithmic tasks only. ``test_depths``: accuracy per
    (test length x depth) too (``run_examples``), checked before any training."""
    name, path = parse_task(task)
    check_test_depths(model_cfg, arch, test_depths, extend_loops)
    if tokenizer is not None and name != "jsonl":
        raise ConfigError(f"--tokenizer applies to jsonl: tasks; the {name} task has its own "
                          "character vocabulary")
    if test_file is not None and name != "jsonl":
        raise ConfigError(f"--test-file applies to jsonl: tasks; the {name} task makes its own test set "
                          "(--test-len, --n-test)")
    if test_file is not None and not str(test_file).strip():
        raise ConfigError("--test-file has an empty path; write --test-file PATH/TO/FILE.jsonl")
    if name != "jsonl" and (isinstance(n_test, bool) or not isinstance(n_test, int)
                            or not 1 <= n_test <= MAX_N_TEST):
        raise ConfigError(f"--n-test {n_test!r}: the test set needs 1 .. {MAX_N_TEST:,} examples per test "
                          "length; pass an integer in that range")
    vocab_of = (lambda examples: TokenizerVocab(load_tokenizer(tokenizer))) if tokenizer else CharVocab.for_examples
    label = model_label(model_cfg, arch)
    out = _prepare_out(out_dir, resume)
    per_seed = []
    for seed in seeds:
        if name == "jsonl":
            data = load_jsonl(path)
            train, test = (data, load_jsonl(test_file)) if test_file is not None else split_examples(data, 0.1, seed=0)
            train_lengths, test_lengths = length_span(train), length_span(test)
        else:
            spec = TaskSpec(name, train_lengths, test_lengths)
            n_lens = len(parse_lengths(test_lengths)) if isinstance(test_lengths, str) else len(test_lengths)
            train, test = algorithmic_data(spec, n_train or tc.steps * tc.batch_size, n_test * n_lens, seed)
        vocab = vocab_of(list(train) + list(test))
        max_off = offsets
        if offsets == "auto":
            max_off = auto_offset(encode_pairs(train, vocab), encode_pairs(test, vocab), is_seq2seq(arch))
        tcs = tc.replace(seed=seed)
        if log:
            done = resume and out is not None and (out / f"seed-{seed}" / "summary.json").is_file()
            log(f"[seed {seed}] {'reloading (finished)' if done else 'training'} {label} on {task}: "
                f"{len(train)} examples, {tcs.steps} steps, max offset {int(max_off)}")
        fixes = ([] if name == "jsonl" else ["shorter --train-len / --test-len"]) + (
            ["a smaller --offsets"] if max_off else [])
        hint = f" (or use {' or '.join(fixes)})" if fixes else ""
        res = run_examples(model_cfg, train, test, tcs, vocab, arch, _step_log(log), max_offset=int(max_off),
                           eval_batch_size=eval_batch_size, run_dir=out / f"seed-{seed}" if out else None,
                           resume=resume, describe={"task": task, "train_lengths": str(train_lengths),
                                                    "test_lengths": str(test_lengths),
                                                    "tokenizer": tokenizer or "characters"},
                           note=log, too_long_hint=hint, test_depths=test_depths, extend_loops=extend_loops)
        res.pop("decoded"), res.pop("depth_preds")
        res["seed"], res["max_offset"] = seed, int(max_off)
        res["examples"] = [{"input": e.input, "target": e.target, "pred": p}
                           for e, p in list(zip(test, res.pop("preds")))[:5]]
        per_seed.append(res)
    result = {"task": task, "arch": arch or model_cfg.arch, "label": label, "seeds": list(seeds),
              "train_lengths": str(train_lengths), "test_lengths": str(test_lengths),
              "max_seq_len": max(r["model"]["max_seq_len"] for r in per_seed),
              "train_config": tc.to_dict(), "summary": summarize_seeds(per_seed), "per_seed": per_seed}
    if test_depths:  # accuracy per (test length x depth), mean and std over seeds
        result["summary"]["per_depth"] = {d: summarize_seeds([{**r["per_depth"][d], "final_loss": r["final_loss"]}
                                                              for r in per_seed]) for d in test_depths}
    result["plot"] = False
    if out is not None:
        write_json(out / "metrics.json", _jsonable(result))
        if plots.available():
            plots.plot_accuracy(per_seed, out / "accuracy_vs_length.png", f"{task} - {label}")
            result["plot"] = True
    return result


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- bAbI

