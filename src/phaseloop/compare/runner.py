"""Running a comparison: its runs as descriptions (``runs.CompareRun``) — the tuning rounds
(``tune``, when the recipe has [tune]), then every (variant, seed) run — each list handed
to one executor (``execute``) that gives what is not finished to the launcher
(``launch``: this process one after another, local worker processes, or Slurm); then the
report. ``--status`` and ``--report`` walk the same runs from what is on disk."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from phaseloop.compare.budget import Planned, plan_variants
from phaseloop.compare.grid import execute as execute_one
from phaseloop.compare.grid import run_state
from phaseloop.compare.launch import LaunchOptions, run_local
from phaseloop.compare.recipe import Recipe, RecipeError, resolve_variant, slugify
from phaseloop.compare.report import write_report
from phaseloop.compare.runs import CompareRun, RunsPending, recipe_data, share_compiles
from phaseloop.compare.tune import run_tuning
from phaseloop.data.corpus import load_corpus
from phaseloop.depth import check_depth_sample, parse_depth_range
from phaseloop.engine import dist, resolve_device
from phaseloop.engine import progress as engine_progress
from phaseloop.engine.run import RESUMABLE_CHANGES
from phaseloop.engine.trainer import PeerFailed
from phaseloop.errors import PhaseloopError
from phaseloop.files import check_out_dir, read_json, write_json
from phaseloop.hf import downstream
from phaseloop.hf.harness import lm_eval_run, resolved_tasks, settings
from phaseloop.lm.train import ignore_id_fault
from phaseloop.model import build_model
from phaseloop.validation import first_difference


def _compared(recipe: dict) -> dict:
    """A stored recipe without what a rerun may change: the train settings that change no
    result (device, compile...; not the batch, which seeds still to train would take), the
    ``[launcher]`` (where runs go) and the ``[eval]`` tasks (scored on the finished runs)."""
    keep = ("batch_size", "grad_accum")
    train = {k: v for k, v in recipe.get("train", {}).items() if k not in RESUMABLE_CHANGES or k in keep}
    return {**{k: v for k, v in recipe.items() if k not in ("launcher", "eval")}, "train": train}


def _claim_folder(out: Path, recipe: Recipe) -> None:
    """Store the recipe on first start; refuse a folder holding anything else."""
    stored = out / "recipe.json"
    want = json.loads(json.dumps(recipe.to_dict()))
    if stored.exists():
        have = _stored(stored).get("recipe", {})
        try:  # through today's Recipe: fields added since are filled with their defaults
            have = json.loads(json.dumps(Recipe.from_dict(have, str(stored)).to_dict()))
        except PhaseloopError:
            pass
        diff = first_difference(_compared(have), _compared(want))
        if diff is not None:
            k, there, now = diff
            raise RecipeError(f"{out} holds a different comparison ({k}: {there} there, {now} now); "
                              f"rerun with the same recipe ({stored} holds it) and options to resume it, or "
                              "choose another --out")
        if have.get("eval", {}) != want.get("eval", {}):  # the [eval] the report now follows
            write_json(stored, {"recipe": want})
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
    """Refuse a recipe whose ``eval_tasks`` or ``[eval]`` tasks cannot run (lm-eval missing,
    a task unknown or its data absent) before anything trains or is written. (A --dry-run does not: it
    checks the variants where lm-eval and the data may be absent, as in CI.)"""
    if recipe.eval_tasks:
        with resolved_tasks(recipe.eval_tasks):
            pass
    if recipe.eval:
        downstream.check(recipe.eval["tasks"], recipe.eval["shots"])


def _lm_eval(recipe: Recipe, run_dir: Path, device: str, log) -> None:
    """Score a finished run on the recipe's lm-eval tasks once (RUN/lm_eval/results.json)."""
    if not recipe.eval_tasks or not (run_dir / "summary.json").exists():
        return
    done = run_dir / "lm_eval" / "results.json"  # reused where scored with the recipe's settings only
    if done.exists() and read_json(done).get("phaseloop") == settings(recipe.eval_tasks, recipe.eval_limit,
                                                                        None, None, "float32"):
        return
    if log:
        log(f"lm-eval {','.join(recipe.eval_tasks)} on {run_dir.name}")
    lm_eval_run(run_dir, recipe.eval_tasks, limit=recipe.eval_limit, device=device)


def _downstream(recipe: Recipe, runs: list[CompareRun], device: str, log) -> None:
    """Score every finished run on the recipe's ``[eval]`` tasks once (RUN/downstream.json),
    the tasks built once for all of them (only when some run is not scored yet)."""
    e = recipe.eval
    built: list = []

    def tasks():
        if not built:
            built.append(downstream.TaskSet(e["tasks"], e["shots"], e["limit"]))
        return built[0]

    for r in runs:
        if e and (r.run_dir / "summary.json").exists():
            downstream.run_results(r.run_dir, e["tasks"], limit=e["limit"], shots=e["shots"],
                                   batch_size=e["batch_size"], device=device, tasks=tasks, log=log)


def main_runs(recipe: Recipe, plan: list[Planned], out: Path, tuned: dict) -> list[CompareRun]:
    """The reported runs, seed-major (every variant of seed 0, then seed 1, ...), so an
    interrupted comparison already holds complete pairs; each at [train], then its own
    settings, then its tuned point (``tuned``: {variant: {lr: ...}})."""
    return [CompareRun(f"{p.variant.slug}-s{seed}", p.name, seed, p.cfg,
                    recipe.train_config(seed, p.variant, **tuned.get(p.name, {})), out, recipe_data(recipe))
            for seed in recipe.seeds for p in plan]


def _chosen(tuning: dict) -> dict:
    return {k: r["chosen"] for k, r in tuning.items()}


def execute(runs: list[CompareRun], launch: LaunchOptions, corpus, device: str, *, progress: bool = False,
            on_step=None, log=None, title: str = "") -> None:
    """Run the runs not finished yet through the launcher (a half-done one resumes from
    its last checkpoint). A run another live process is training is refused here (it
    would be trained twice), before anything runs, naming that process; under Slurm it
    is left to its task. Returns when all are finished; raises PeerFailed when some
    failed, RunsPending when some are left to Slurm tasks. Tuning rounds and the reported
    runs alike."""
    if not runs:
        return
    w = dist.world()
    kind = "tuning runs" if runs[0].tuning else "runs"
    seen = {r.name: run_state(r) for r in runs}
    states = {name: v["state"] for name, v in seen.items()}
    held = [f"{name} ({seen[name]['detail']})" for name, v in states.items() if v == "running"]
    todo = [r for r in runs if states[r.name] not in ("done", "running")]
    if w.size > 1:  # rank 0's view of what is left, so every rank trains the same runs
        names, held = dist.gather_objects(([r.name for r in todo], held))[0]
        todo = [r for r in runs if r.name in names]
    if held and launch.launcher != "slurm":
        verb = "is" if len(held) == 1 else "are"
        raise PhaseloopError(f"{runs[0].out}: {len(held)} of the {len(runs)} {kind} {verb} "
                             f"being trained by another live process: {', '.join(held[:3])}"
                             f"{', ...' if len(held) > 3 else ''}; a second command would train them twice: "
                             "wait for it (follow it with --status) or stop it, then run this command again")
    if log and len(todo) < len(runs):
        busy = sum(v == "running" for v in states.values())
        log(f"{sum(v == 'done' for v in states.values())} of {len(runs)} {kind} already finished"
            + (f", {busy} running in Slurm tasks (left to them)" if busy else "") + ("; continuing" if todo else ""))
    todo = share_compiles(todo)
    failed: list[str] = []
    out = runs[0].out
    if launch.launcher == "sequential":
        _run_sequential(todo, runs, corpus, device, progress, on_step, log, title)
    elif launch.launcher == "local":
        failed = run_local(todo, launch.jobs, launch.nproc_per_run, device, log)
    else:
        from phaseloop.compare import slurm  # submitit: an optional extra

        held = slurm.still_queued(todo, launch, log)
        todo = [r for r in todo if r.name not in held]
        jobs = slurm.submit(todo, launch, out, slugify(title)) if todo else []
        if jobs and log:
            how = "Slurm" if launch.executor == "slurm" else f"submitit {launch.executor}"
            log(f"submitted {len(jobs)} {kind} as {how} job {jobs[0].job_id.split('_')[0]} "
                f"(logs in {out / 'slurm'}); follow it with `phaseloop compare RECIPE --out {out} --status`, "
                "report what finished with --report")
        failed = slurm.wait(jobs, todo, log) if launch.wait else []
    if failed:
        raise PeerFailed(f"{len(failed)} of {len(runs)} {kind} failed ({', '.join(failed)}; logs in "
                         f"{out / 'launch'}); the others finished: run the same command again to resume the "
                         "failed ones from their checkpoints, or --report to report what finished")
    dist.barrier()  # rank 0 wrote the last summary before anyone counts what is left
    left = [r.name for r in runs if not r.finished]
    if left:
        raise RunsPending(left, runs[0].tuning)


def _run_sequential(todo: list[CompareRun], runs: list[CompareRun], corpus, device: str, progress: bool,
                    on_step, log, title: str) -> None:
    """``todo`` in this process, one after another (under torchrun: across all ranks),
    with one progress bar over ``runs``."""
    bar = None
    if progress and dist.world().main and todo:  # no terminal: a line each evaluation, not bar frames
        bar = engine_progress.bar(total=sum(r.train.steps for r in runs), initial=sum(r.steps_done() for r in runs),
                                  unit="step", desc=f"compare {title}")
    try:
        for r in todo:
            last, trained = [r.steps_done()], []

            def _on_step(step: int, rec: dict, r=r, last=last, trained=trained) -> None:
                if bar is not None and step > last[0]:
                    bar.update(step - last[0])
                    if "loss" in rec:
                        bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                last[0] = max(last[0], step)
                trained[:] = [rec] if "loss" in rec else trained
                if bar is not None and bar.disable and "val_loss" in rec:
                    dist.say(engine_progress.eval_line(r.name, step, r.train.steps, trained, rec))
                if on_step is not None:
                    on_step(r.name, step, rec)

            if bar is not None:
                bar.set_description(r.name)
            if not _reset_peak_memory(resolve_device(device)) and log:
                log("note: cannot reset peak memory between runs; it is the process peak")
            execute_one(r, corpus, on_step=_on_step, log=log, device=device)
    finally:
        if bar is not None:
            bar.close()


def _prepare(recipe: Recipe, log, eval_tasks: bool = True):
    """(corpus, plan): the specs checked, the data tokenised (or read from the token
    store), the budget planned."""
    for v in recipe.variants:  # cheap spec check before the data is read
        resolve_variant(v, recipe.scale)
    if eval_tasks:
        check_eval_tasks(recipe)
    with dist.main_first():  # rank 0 builds the token store, then the others read it
        corpus = load_corpus(**recipe_data(recipe))
    plan = plan_variants(recipe, corpus.tokenizer.vocab_size, log)
    for p in plan:  # before the folder is written
        tc = recipe.train_config(0, p.variant)
        why = ignore_id_fault(tc.loss_ignore_id, p.cfg)
        if why is not None:
            raise RecipeError(f"variant {p.variant.name!r}: {why}")
        if tc.seq_len is not None and tc.seq_len > p.cfg.max_seq_len:  # else every run fails in training
            raise RecipeError(f"variant {p.name!r}: seq_len {tc.seq_len} is longer than its model's max_seq_len "
                              f"{p.cfg.max_seq_len}; lower [train] seq_len or add max_seq_len={tc.seq_len} to its spec")
    for p in plan if recipe.train.get("depth_sample") else ():  # training for depth: refused before any trains
        try:
            check_depth_sample(build_model(p.cfg, device="meta"), parse_depth_range(recipe.train["depth_sample"]),
                               recipe.train.get("extend_loops"))
        except PhaseloopError as e:
            raise RecipeError(f"variant {p.variant.name!r}: {e}") from None
    return corpus, plan


def run_comparison(recipe: Recipe, out_dir: str | Path, *, progress: bool = True,
                   on_step: Callable[[str, int, dict], None] | None = None,
                   log: Callable[[str], None] | None = dist.say,
                   command: str | None = None, launch: LaunchOptions | None = None) -> dict:
    """Tune (when the recipe has [tune]), train every (variant, seed) run not yet
    finished (``main_runs``), then write the report.

    ``launch`` (default: the recipe's ``[launcher]`` table, else sequential) says who runs
    each list of runs (``execute``): this process one after another — under torchrun every
    run uses all the processes (rank 0 writes) — local worker processes, or Slurm.
    ``on_step(run_name, step, record)`` receives every logged record of in-process runs
    (tests interrupt through it). Returns the summary; {} on ranks > 0, and while runs
    are left to Slurm or other processes (``--status`` follows them; the same command
    goes on from the finished ones, round by round through tuning)."""
    out = Path(out_dir)
    w = dist.world()
    log = log if w.main else None
    launch = launch or LaunchOptions.resolve(recipe.launcher)
    if launch.launcher != "sequential" and w.size > 1:
        raise RecipeError(f"--launcher {launch.launcher} starts its own processes; run it without torchrun "
                          "(--nproc-per-run K runs each run under torchrun)")
    if launch.launcher == "slurm":  # submitit (an optional extra), srun and the options: refused
        from phaseloop.compare import slurm  # before anything is written

        slurm.check(launch)
    corpus, plan = _prepare(recipe, log)
    device = devices_for(recipe.train["device"])[0]
    resolve_device(device, "the recipe's train.device")
    if launch.launcher == "sequential":
        _launch_hint(recipe.train["device"], log)
    with dist.main_first():  # rank 0 stores the recipe; the others then find it there
        _claim_folder(out, recipe)

    def run(runs: list[CompareRun]) -> None:
        execute(runs, launch, corpus, device, progress=progress, on_step=on_step, log=log, title=recipe.name)

    try:
        tuning = run_tuning(recipe, plan, out, run, log) if recipe.tune else {}
        runs = main_runs(recipe, plan, out, _chosen(tuning))
        run(runs)
    except RunsPending as e:
        if log:
            log(f"{len(e.names)} {'tuning ' if e.tuning else ''}runs are still with other processes or Slurm "
                f"tasks ({', '.join(e.names[:4])}{', ...' if len(e.names) > 4 else ''}); follow them with "
                "--status; then this command again goes on" + (" to the next tuning round or the reported runs"
                                                              if e.tuning else " to the report (or --report)"))
        return {}
    if not w.main:
        return {}
    return _report(recipe, out, plan, runs, corpus, device, command, log, tuning)


def _report(recipe, out, plan, runs, corpus, device, command, log, tuning: dict) -> dict:
    for r in runs:  # also runs finished before an interruption
        _lm_eval(recipe, r.run_dir, device, log)
    _downstream(recipe, runs, device, log)
    return write_report(out, recipe, plan, corpus.describe(), command, log, tuning=tuning)


def stored_recipe(out: Path) -> Recipe:
    """The recipe a comparison folder holds (recipe.json)."""
    if not (out / "recipe.json").is_file():
        raise RecipeError(f"{out} holds no comparison (no recipe.json); start one with "
                          f"`phaseloop compare RECIPE --out {out}`, or pass the --out it was started with")
    return Recipe.from_dict(_stored(out / "recipe.json").get("recipe"), str(out / "recipe.json"))


def _stored(path: Path) -> dict:
    """A comparison's recipe.json: a JSON object, or damage named."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise RecipeError(f"{path} is damaged (not a JSON object); restore it, or start the comparison "
                          "again in another --out")
    return data


def runs_on_disk(recipe: Recipe, plan: list[Planned],
                 out: Path) -> tuple[list[CompareRun], dict | None, list[CompareRun]]:
    """(the tuning runs of every round reached so far, the tuning results or None while
    tuning is unfinished, the reported runs): ``run_tuning`` walked over what is on disk,
    training nothing. While tuning is unfinished the reported runs' tuned point is not
    known yet: they are described at [train]'s (their folder and steps are what --status
    reads)."""
    seen: dict[str, CompareRun] = {}

    def look(runs: list[CompareRun]) -> None:
        seen.update((r.name, r) for r in runs)
        left = [r.name for r in runs if not r.finished]
        if left:
            raise RunsPending(left, True)

    tuning = {}
    if recipe.tune:
        try:
            tuning = run_tuning(recipe, plan, out, look)
        except RunsPending:
            tuning = None
    return list(seen.values()), tuning, main_runs(recipe, plan, out, _chosen(tuning or {}))


def comparison_status(out_dir: str | Path) -> list[dict]:
    """{name, state, step, steps, detail} of every run of the comparison in ``out_dir``
    (``grid.run_state``): the tuning runs of the rounds reached so far, then the
    reported (variant, seed) runs."""
    out = Path(out_dir)
    recipe = stored_recipe(out)
    _, plan = _prepare(recipe, None, eval_tasks=False)
    tuning_runs, _, runs = runs_on_disk(recipe, plan, out)
    return [{"name": r.name, **run_state(r)} for r in tuning_runs + runs]


def report_finished(recipe: Recipe, out_dir: str | Path, command: str | None = None,
                    log: Callable[[str], None] | None = dist.say) -> dict:
    """The report from the runs finished so far (``--report``), whatever is still running;
    with [tune], once tuning has finished (its choice decides what the reported runs are)."""
    out = Path(out_dir)
    stored_recipe(out)
    _claim_folder(out, recipe)  # the same comparison, or a one-line refusal
    corpus, plan = _prepare(recipe, log)
    tuning_runs, tuning, runs = runs_on_disk(recipe, plan, out)
    if tuning is None:
        done = sum(r.finished for r in tuning_runs)
        raise RecipeError(f"{out}: tuning has not finished ({done} of the {len(tuning_runs)} tuning runs so far); "
                          "the reported runs start after it: follow it with --status, report once it is done")
    return _report(recipe, out, plan, runs, corpus, devices_for(recipe.train["device"])[0], command, log, tuning)
