"""Running a comparison: the grid of (variant, seed) runs as independent ``RunSpec``s
(``grid``), each through ``phaseloop.train.train``, resumable, run by a launcher
(``launch``: in this process, local worker processes, or Slurm); then the report."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint import read_json, write_json
from ..files import check_out_dir
from ..validation import first_difference
from ..data import load_corpus
from ..errors import PhaseloopError
from ..engine import dist, resolve_device
from ..engine.trainer import PeerFailed
from .budget import Planned, plan_variants
from .grid import LAUNCH, RunSpec, execute, run_state, steps_done
from .launch import LaunchOptions, run_local
from .recipe import Recipe, RecipeError, resolve_variant, slugify
from .report import write_report


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _claim_folder(out: Path, recipe: Recipe) -> None:
    """Store the recipe on first start; refuse a folder holding anything else (another
    ``[launcher]`` is the same comparison: it says where runs go, not what they are)."""
    stored = out / "recipe.json"
    want = json.loads(json.dumps(recipe.to_dict()))
    if stored.exists():
        have = read_json(stored).get("recipe", {})
        try:  # through today's Recipe: fields added since are filled with their defaults
            have = json.loads(json.dumps(Recipe.from_dict(have, str(stored)).to_dict()))
        except PhaseloopError:
            pass
        diff = first_difference(*({k: v for k, v in d.items() if k != "launcher"} for d in (have, want)))
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
        log(f"note: {n} GPUs here and this comparison uses one; to train {n} runs at once, one per GPU, "
            f"add --launcher local --jobs {n}; to train each run on all of them, launch it with "
            f"`torchrun --nproc-per-node {n} -m phaseloop compare ...`")


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


def grid_specs(recipe: Recipe, plan: list[Planned], out: Path, device: str) -> list[RunSpec]:
    """The grid as independent runs, seed-major (every variant of seed 0, then seed 1, ...),
    so an interrupted sequential comparison already holds complete pairs."""
    data = {"spec": recipe.data, "tokenizer": recipe.tokenizer, "text_column": recipe.text_column}
    return [RunSpec(name=f"{p.variant.slug}-s{seed}", run_dir=str(out / "runs" / f"{p.variant.slug}-s{seed}"),
                    model=p.cfg.to_dict(), train=dataclasses.replace(recipe.train_config(seed), device=device).to_dict(),
                    data=data, tags={"variant": p.name, "seed": seed})
            for seed in recipe.seeds for p in plan]


def _run_sequential(specs: list[RunSpec], corpus, device: str, steps: int, title: str, progress: bool,
                    on_step, log) -> None:
    """Every run in this process, one after another (under torchrun: across all ranks)."""
    w = dist.world()
    bar = None
    if progress and w.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps * len(specs), initial=sum(steps_done(Path(s.run_dir), steps) for s in specs),
                   unit="step", dynamic_ncols=True, desc=f"compare {title}")

    def one(spec: RunSpec) -> None:
        last = [steps_done(Path(spec.run_dir), steps)]

        def _on_step(step: int, rec: dict) -> None:
            if bar is not None and step > last[0]:
                bar.update(step - last[0])
                if "loss" in rec:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
            last[0] = max(last[0], step)
            if on_step is not None:
                on_step(spec.name, step, rec)

        if bar is not None:
            bar.set_description(spec.name)
        if not _reset_peak_memory(resolve_device(device)) and log:
            log("note: cannot reset peak memory between runs; it is the process peak")
        execute(spec, corpus, on_step=_on_step)

    try:
        for spec in specs:
            if not (Path(spec.run_dir) / "summary.json").exists():
                one(spec)
    finally:
        if bar is not None:
            bar.close()


def _prepare(recipe: Recipe, out: Path, log):
    """(corpus, plan, device): the specs checked, the data tokenised, the budget planned."""
    for v in recipe.variants:  # cheap spec check before the data is read
        resolve_variant(v, recipe.scale)
    check_eval_tasks(recipe)
    with dist.main_first():  # rank 0 builds the token store, then the others read it
        corpus = load_corpus(recipe.data, recipe.tokenizer, text_column=recipe.text_column)
    plan = plan_variants(recipe, corpus.tokenizer.vocab_size, log)
    return corpus, plan


def run_comparison(recipe: Recipe, out_dir: str | Path, *, progress: bool = True,
                   on_step: Callable[[str, int, dict], None] | None = None,
                   log: Callable[[str], None] | None = _stderr,
                   command: str | None = None, launch: LaunchOptions | None = None) -> dict:
    """Train every (variant, seed) run not yet finished, then write the report.

    ``launch`` (default: the recipe's ``[launcher]`` table, else sequential) says who
    runs the grid (``launch``): in this process one after another — under torchrun every
    run uses all the processes (rank 0 writes) — local worker processes, or Slurm. A run
    another process is running (``grid.run_state``) is left to it. ``on_step(run_name,
    step, record)`` receives every logged record of in-process runs (tests interrupt
    through it). Returns the summary; {} on ranks > 0, after a Slurm submission without
    ``wait`` and while other processes still hold runs (``--status`` / ``--report``
    follow them)."""
    out = Path(out_dir)
    w = dist.world()
    log = log if w.main else None
    launch = launch or LaunchOptions.resolve(recipe.launcher)
    if launch.launcher != "sequential" and w.size > 1:
        raise RecipeError(f"--launcher {launch.launcher} starts its own processes; run it without torchrun "
                          "(--nproc-per-run K runs each run under torchrun)")
    if launch.launcher == "slurm":
        from . import slurm  # a missing submitit is refused before anything is written
    corpus, plan = _prepare(recipe, out, log)
    device = devices_for(recipe.train["device"])[0]
    resolve_device(device)
    if launch.launcher == "sequential":
        _launch_hint(recipe.train["device"], log)
    with dist.main_first():  # rank 0 stores the recipe; the others then find it there
        _claim_folder(out, recipe)

    specs = grid_specs(recipe, plan, out, device if launch.launcher == "sequential" else recipe.train["device"])
    states = {s.name: run_state(s)["state"] for s in specs}
    todo = [s for s in specs if states[s.name] not in ("done", "running")]
    if log and len(todo) < len(specs):
        busy = sum(v == "running" for v in states.values())
        log(f"{out}: {sum(v == 'done' for v in states.values())} of {len(specs)} runs already finished"
            + (f", {busy} running elsewhere (left to it)" if busy else "") + "; continuing")
    if w.size > 1:  # rank 0's view of what is left, so every rank trains the same runs
        names = dist.gather_objects([s.name for s in todo])[0]
        todo = [s for s in specs if s.name in names]
    failed: list[str] = []
    if launch.launcher == "sequential":
        _run_sequential(todo, corpus, device, recipe.train["steps"], recipe.name, progress, on_step, log)
    elif launch.launcher == "local":
        failed = run_local(todo, launch.jobs, launch.nproc_per_run, recipe.train["device"], log)
    else:
        held = slurm.still_queued(todo, launch, log)
        todo = [s for s in todo if s.name not in held]
        jobs = slurm.submit(todo, launch, out, slugify(recipe.name)) if todo else []
        if jobs and log:
            kind = "Slurm" if launch.executor == "slurm" else f"submitit {launch.executor}"
            log(f"submitted {len(jobs)} runs as {kind} job {jobs[0].job_id.split('_')[0]} "
                f"(logs in {out / 'slurm'}); follow it with `phaseloop compare RECIPE --out {out} --status`, "
                "report what finished with --report")
        if not launch.wait and jobs:
            return {}
        failed = slurm.wait(jobs, todo, log)
    if not w.main:
        return {}
    if failed:
        raise PeerFailed(f"{len(failed)} of {len(specs)} runs failed ({', '.join(failed)}; logs in "
                         f"{out / 'launch'}); the others finished: run the same command again to resume the "
                         "failed ones from their checkpoints, or --report to report what finished")
    left = [s.name for s in specs if not (Path(s.run_dir) / "summary.json").exists()]
    if left:  # runs another process or Slurm task still holds
        if log:
            log(f"{len(left)} of {len(specs)} runs are still with other processes or Slurm tasks "
                f"({', '.join(left[:4])}{', ...' if len(left) > 4 else ''}); follow them with --status, "
                "then --report (or this command again) writes the report")
        return {}
    return _report(recipe, out, plan, corpus, device, command, log)


def _report(recipe, out, plan, corpus, device, command, log) -> dict:
    for name in [f"{p.variant.slug}-s{seed}" for seed in recipe.seeds for p in plan]:
        _lm_eval(recipe, out / "runs" / name, device, log)  # also runs finished before an interruption
    return write_report(out, recipe, plan, corpus.describe(), command, log)


def stored_recipe(out: Path) -> Recipe:
    """The recipe a comparison folder holds (recipe.json)."""
    if not (out / "recipe.json").is_file():
        raise RecipeError(f"{out} holds no comparison (no recipe.json); start one with "
                          f"`phaseloop compare RECIPE --out {out}`, or pass the --out it was started with")
    return Recipe.from_dict(read_json(out / "recipe.json").get("recipe"), str(out / "recipe.json"))


def comparison_status(out_dir: str | Path) -> list[dict]:
    """{name, state, step, steps, detail} of every run of the comparison in ``out_dir``
    (``grid.run_state``): the recipe's (variant, seed) runs, then any other run a
    launcher described in OUT/launch/."""
    out = Path(out_dir)
    recipe = stored_recipe(out)
    specs = {}
    for seed in recipe.seeds:
        for v in recipe.variants:
            name = f"{v.slug}-s{seed}"
            specs[name] = RunSpec(name, str(out / "runs" / name), {}, {**recipe.train, "seed": seed}, {})
    for path in sorted((out / LAUNCH).glob("*.json")) if (out / LAUNCH).is_dir() else []:
        if not path.name.endswith((".state.json", ".job.json")) and path.stem not in specs:
            specs[path.stem] = RunSpec.load(path)
    return [{"name": n, **run_state(s)} for n, s in specs.items()]


def report_finished(recipe: Recipe, out_dir: str | Path, command: str | None = None,
                    log: Callable[[str], None] | None = _stderr) -> dict:
    """The report from the runs finished so far (``--report``), whatever is still running."""
    out = Path(out_dir)
    stored_recipe(out)
    _claim_folder(out, recipe)  # the same comparison, or a one-line refusal
    corpus, plan = _prepare(recipe, out, log)
    return _report(recipe, out, plan, corpus, devices_for(recipe.train["device"])[0], command, log)
