"""Running a comparison: every (variant, seed) run through ``phaseloop.train.train``,
seed-major, resumable; one run per GPU when there are several."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from .. import train as lm
from ..checkpoint import checkpoint_dir, read_json, verify_checkpoint, write_json
from ..files import check_out_dir
from ..validation import first_difference
from ..data import load_corpus
from ..errors import PhaseloopError
from ..engine import dist, resolve_device
from .budget import Planned, plan_variants
from .recipe import Recipe, RecipeError, resolve_variant
from .report import write_report


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
        diff = first_difference(have, want)
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


def _steps_done(run_dir: Path, steps: int) -> int:
    if (run_dir / "summary.json").exists():
        return steps
    ckpt = checkpoint_dir(run_dir)
    if ckpt is None:
        return 0
    verify_checkpoint(ckpt, ("trainer.json",))
    return int(read_json(ckpt / "trainer.json")["step"])


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
    """Train every (variant, seed) run not yet finished, then write the report.

    Runs go seed-major (every variant of seed 0, then seed 1, ...), so an interrupted
    comparison already holds complete pairs, one after another; under torchrun every
    run uses all the processes (rank 0 writes). ``on_step(run_name, step, record)``
    receives every logged record (tests interrupt through it)."""
    out = Path(out_dir)
    w = dist.world()
    log = log if w.main else None
    for v in recipe.variants:  # cheap spec check before the data is read
        resolve_variant(v, recipe.scale)
    check_eval_tasks(recipe)
    with dist.main_first():  # rank 0 builds the token store, then the others read it
        corpus = load_corpus(recipe.data, recipe.tokenizer, text_column=recipe.text_column, doc_sep=recipe.doc_sep)
    plan = plan_variants(recipe, corpus.tokenizer.vocab_size, log)
    device = devices_for(recipe.train["device"])[0]
    resolve_device(device)
    _launch_hint(recipe.train["device"], log)
    with dist.main_first():  # rank 0 stores the recipe; the others then find it there
        _claim_folder(out, recipe)

    steps = recipe.train["steps"]
    runs = [(p, seed, out / "runs" / f"{p.variant.slug}-s{seed}")
            for seed in recipe.seeds for p in plan]
    pending = [r for r in runs if not (r[2] / "summary.json").exists()]
    if log and len(pending) < len(runs):
        log(f"{out}: {len(runs) - len(pending)} of {len(runs)} runs already finished; continuing")
    bar = None
    if progress and w.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps * len(runs), initial=sum(_steps_done(d, steps) for *_, d in runs),
                   unit="step", dynamic_ncols=True, desc=f"compare {recipe.name}")

    def one(p: Planned, seed: int, run_dir: Path) -> None:
        last = [_steps_done(run_dir, steps)]

        def _on_step(step: int, rec: dict) -> None:
            if bar is not None and step > last[0]:
                bar.update(step - last[0])
                if "loss" in rec:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
            last[0] = max(last[0], step)
            if on_step is not None:
                on_step(run_dir.name, step, rec)

        if bar is not None:
            bar.set_description(run_dir.name)
        if not _reset_peak_memory(resolve_device(device)) and log:
            log("note: cannot reset peak memory between runs; it is the process peak")
        tc = dataclasses.replace(recipe.train_config(seed, p.variant), device=device)
        resume = (run_dir / "config.json").exists()
        dist.barrier()  # every rank has looked before rank 0 writes this run's config.json
        lm.train(p.cfg, tc, corpus, run_dir, resume=resume, progress=False, on_step=_on_step)

    try:
        for r in pending:
            one(*r)
    finally:
        if bar is not None:
            bar.close()
    if not w.main:
        return {}
    for _, _, run_dir in runs:  # also runs finished before an interruption
        _lm_eval(recipe, run_dir, device, log)
    return write_report(out, recipe, plan, corpus.describe(), command, log)
