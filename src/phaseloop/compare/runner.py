"""Running a comparison: the tuning runs (``tune``, when the recipe has [tune]), then
every (variant, seed) run, each a ``runs.RunSpec`` trained through ``phaseloop.train.train``,
seed-major, resumable; one run per GPU when there are several."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from .. import train as lm
from ..checkpoint import read_json, write_json
from ..files import check_out_dir
from ..validation import first_difference
from ..data import load_corpus
from ..depth import check_depth_sample, parse_depth_range
from ..model import build_model
from ..errors import PhaseloopError
from ..engine import dist, resolve_device
from ..engine.trainer import DivergedError
from .budget import Planned, plan_variants
from .recipe import Recipe, RecipeError, resolve_variant
from .report import write_report
from .runs import DIVERGED, RunSpec, tuning_corpus
from .tune import run_tuning


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _compared(recipe: dict) -> dict:
    """A stored recipe without the train settings a run may change on resume (device, compile...)."""
    from ..engine.run import RESUMABLE_CHANGES

    train = {k: v for k, v in recipe.get("train", {}).items() if k not in RESUMABLE_CHANGES}
    return {**recipe, "train": train}


def _claim_folder(out: Path, recipe: Recipe) -> None:
    """Store the recipe on first start; refuse a folder holding anything else."""
    stored = out / "recipe.json"
    want = json.loads(json.dumps(recipe.to_dict()))
    if stored.exists():
        have = read_json(stored).get("recipe", {})
        try:  # through today's Recipe: fields added since are filled with their defaults
            have = json.loads(json.dumps(Recipe.from_dict(have, str(stored)).to_dict()))
        except PhaseloopError:
            pass
        diff = first_difference(_compared(have), _compared(want))
        if diff is not None:
            k, there, now = diff
            raise RecipeError(f"{out} holds a different comparison ({k}: {there} there, {now} now); "
                              "rerun with the same recipe and options to resume it, or choose another --out")
        return
    check_out_dir(out)
    if out.exists() and any(out.iterdir()):
        raise RecipeError(f"{out} exists and holds no comparison; choose another --out")
    write_json(stored, {"recipe": want})


def _reset_peak_memory(device) -> bool:
    """Peak memory per run: CUDA's allocator peak, or Linux's peak RSS (VmHWM, which
    getrusage reports) reset by writing 5 to /proc/self/clear_refs."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def devices_for(name: str) -> list[str]:
    """The device this process trains on: its own GPU under torchrun, else the recipe's
    (several GPUs without torchrun: say how to use them all)."""
    w = dist.world()
    if w.size > 1:
        return [dist.local_device(name, w)]
    return [name]


def _launch_hint(name: str, log) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if log and n > 1 and name in ("auto", "cuda") and dist.world().size == 1:
        log(f"note: {n} GPUs here and this comparison uses one; to train each run on all of them, "
            f"launch it with `torchrun --nproc-per-node {n} -m phaseloop compare ...`")


def check_eval_tasks(recipe: Recipe) -> None:
    """Refuse a recipe whose ``eval_tasks`` cannot run (lm-eval missing, a task unknown or
    its data absent) before anything trains or is written. (A --dry-run does not: it
    checks the variants where lm-eval and the data may be absent, as in CI.)"""
    if recipe.eval_tasks:
        from ..hf.harness import resolved_tasks

        with resolved_tasks(recipe.eval_tasks):
            pass


def _lm_eval(recipe: Recipe, run_dir: Path, device: str, log) -> None:
    """Score a finished run on the recipe's lm-eval tasks once (RUN/lm_eval/results.json)."""
    if not recipe.eval_tasks or not (run_dir / "summary.json").exists():
        return
    done = run_dir / "lm_eval" / "results.json"
    if done.exists() and sorted(read_json(done).get("results", {})) == sorted(recipe.eval_tasks):
        return
    from ..hf.harness import lm_eval_run

    if log:
        log(f"lm-eval {','.join(recipe.eval_tasks)} on {run_dir.name}")
    lm_eval_run(run_dir, recipe.eval_tasks, limit=recipe.eval_limit, device=device)


def run_comparison(recipe: Recipe, out_dir: str | Path, *, progress: bool = True,
                   on_step: Callable[[str, int, dict], None] | None = None,
                   log: Callable[[str], None] | None = _stderr,
                   command: str | None = None) -> dict:
    """Tune (when the recipe has [tune]), train every (variant, seed) run not yet
    finished (``main_runs``), then write the report. Under torchrun every run uses all
    the processes (rank 0 writes). ``on_step(run_name, step, record)`` receives every
    logged record (tests interrupt through it)."""
    out = Path(out_dir)
    w = dist.world()
    log = log if w.main else None
    for v in recipe.variants:  # cheap spec check before the data is read
        resolve_variant(v, recipe.scale)
    check_eval_tasks(recipe)
    with dist.main_first():  # rank 0 builds the token store, then the others read it
        corpus = load_corpus(recipe.data, recipe.tokenizer, text_column=recipe.text_column, doc_sep=recipe.doc_sep)
    plan = plan_variants(recipe, corpus.tokenizer.vocab_size, log)
    for p in plan if recipe.train.get("depth_sample") else ():  # training for depth: refused before any trains
        try:
            check_depth_sample(build_model(p.cfg, device="meta"), parse_depth_range(recipe.train["depth_sample"]),
                               recipe.train.get("extend_loops"))
        except PhaseloopError as e:
            raise RecipeError(f"variant {p.variant.name!r}: {e}") from None
    device = devices_for(recipe.train["device"])[0]
    resolve_device(device)
    _launch_hint(recipe.train["device"], log)
    with dist.main_first():  # rank 0 stores the recipe; the others then find it there
        _claim_folder(out, recipe)

    def execute(runs: list[RunSpec]) -> None:
        _execute(runs, corpus, device, progress, on_step, log, recipe.name)

    tuning = run_tuning(recipe, plan, out, execute, log) if recipe.tune else {}
    runs = main_runs(recipe, plan, out, {k: r["chosen"] for k, r in tuning.items()})
    execute(runs)
    if not w.main:
        return {}
    for r in runs:  # also runs finished before an interruption
        _lm_eval(recipe, r.run_dir, device, log)
    return write_report(out, recipe, plan, corpus.describe(), command, log, tuning=tuning)


def main_runs(recipe: Recipe, plan: list[Planned], out: Path, tuned: dict) -> list[RunSpec]:
    """The reported runs, seed-major (every variant of seed 0, then seed 1, ...), so an
    interrupted comparison already holds complete pairs; each at [train], then its own
    settings, then its tuned point (``tuned``: {variant: {lr: ...}})."""
    return [RunSpec(f"{p.variant.slug}-s{seed}", p.name, seed, p.cfg,
                    recipe.train_config(seed, p.variant, **tuned.get(p.name, {})),
                    out / "runs" / f"{p.variant.slug}-s{seed}")
            for seed in recipe.seeds for p in plan]


def data_for(run: RunSpec, corpus):
    """The corpus a run reads: the reported one, or for a tuning run its tuning slice."""
    return tuning_corpus(corpus, run.train, run.train.seq_len or run.cfg.max_seq_len) if run.tuning else corpus


def _execute(runs: list[RunSpec], corpus, device: str, progress: bool,
             on_step, log, desc: str) -> None:
    """Train the runs not finished yet, one after another (a half-done one resumes from
    its last checkpoint); under torchrun every run uses all the processes. A tuning run
    that diverges is recorded (diverged.json) and scored as infinite."""
    w = dist.world()
    pending = [r for r in runs if not r.finished]
    if log and len(pending) < len(runs):
        log(f"{len(runs) - len(pending)} of {len(runs)} {'tuning ' if runs[0].tuning else ''}runs "
            f"already finished{'; continuing' if pending else ''}")
    bar = None
    if progress and w.main and pending:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(r.train.steps for r in runs), initial=sum(r.steps_done() for r in runs),
                   unit="step", dynamic_ncols=True, desc=f"compare {desc}")
    try:
        for r in pending:
            last = [r.steps_done()]

            def _on_step(step: int, rec: dict, r=r, last=last) -> None:
                if bar is not None and step > last[0]:
                    bar.update(step - last[0])
                    if "loss" in rec:
                        bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                last[0] = max(last[0], step)
                if on_step is not None:
                    on_step(r.name, step, rec)

            if bar is not None:
                bar.set_description(r.name)
            if not _reset_peak_memory(resolve_device(device)) and log:
                log("note: cannot reset peak memory between runs; it is the process peak")
            tc = dataclasses.replace(r.train, device=device)
            resume = (r.run_dir / "config.json").exists()
            dist.barrier()  # every rank has looked before rank 0 writes this run's config.json
            try:
                lm.train(r.cfg, tc, data_for(r, corpus), r.run_dir, resume=resume,
                         progress=False, on_step=_on_step)
            except DivergedError as e:
                if not r.tuning:
                    raise
                if w.main:
                    write_json(r.run_dir / DIVERGED, {"error": str(e)})
                dist.barrier()  # every rank sees it before deciding what is finished
                if log:
                    log(f"tuning run {r.name} diverged; scored as infinite")
    finally:
        if bar is not None:
            bar.close()
