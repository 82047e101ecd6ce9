"""Running a comparison: every (variant, seed) run through ``phaseloop.train.train``,
seed-major, resumable; one run per GPU when there are several."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from queue import Queue
from typing import Callable

import torch

from .. import train as lm
from ..checkpoint import checkpoint_dir, read_json, verify_checkpoint, write_json
from ..files import check_out_dir
from ..validation import first_difference
from ..data import load_corpus
from ..errors import PhaseloopError
from ..engine import resolve_device
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
    """Devices to spread runs over: every GPU when there are several (device auto or
    cuda), else just the recipe's device."""
    if name in ("auto", "cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [name]


def run_comparison(recipe: Recipe, out_dir: str | Path, *, progress: bool = True,
                   on_step: Callable[[str, int, dict], None] | None = None,
                   log: Callable[[str], None] | None = _stderr,
                   command: str | None = None) -> dict:
    """Train every (variant, seed) run not yet finished, then write the report.

    Runs go seed-major (every variant of seed 0, then seed 1, ...), so an interrupted
    comparison already holds complete pairs; one at a time, or one per device when
    there are several GPUs. ``on_step(run_name, step, record)`` receives every logged
    record (tests interrupt through it)."""
    out = Path(out_dir)
    for v in recipe.variants:  # cheap spec check before the data is read
        resolve_variant(v, recipe.scale)
    corpus = load_corpus(recipe.data, recipe.tokenizer, text_column=recipe.text_column)
    plan = plan_variants(recipe, corpus.tokenizer.vocab_size, log)
    devices = devices_for(recipe.train["device"])
    for d in devices:
        resolve_device(d)
    _claim_folder(out, recipe)

    steps = recipe.train["steps"]
    runs = [(p, seed, out / "runs" / f"{p.variant.slug}-s{seed}")
            for seed in recipe.seeds for p in plan]
    pending = [r for r in runs if not (r[2] / "summary.json").exists()]
    if log and len(pending) < len(runs):
        log(f"{out}: {len(runs) - len(pending)} of {len(runs)} runs already finished; continuing")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps * len(runs), initial=sum(_steps_done(d, steps) for *_, d in runs),
                   unit="step", dynamic_ncols=True, desc=f"compare {recipe.name}")
    lock, stop = threading.Lock(), threading.Event()
    # train() seeds torch's global RNG, then initialises the model from it: concurrent
    # runs take turns from the seed to their first logged step, so inits stay per-seed.
    init_lock = threading.Lock()

    def one(p: Planned, seed: int, run_dir: Path, device: str) -> None:
        last = [_steps_done(run_dir, steps)]

        def _on_step(step: int, rec: dict) -> None:
            if init_lock.locked() and holding[0]:
                holding[0] = False
                init_lock.release()
            if stop.is_set():  # another run failed or was interrupted
                raise KeyboardInterrupt
            with lock:
                if bar is not None and step > last[0]:
                    bar.update(step - last[0])
                    if "loss" in rec:
                        bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                last[0] = max(last[0], step)
            if on_step is not None:
                on_step(run_dir.name, step, rec)

        if bar is not None and len(devices) == 1:
            bar.set_description(run_dir.name)
        if not _reset_peak_memory(resolve_device(device)) and log:
            log("note: cannot reset peak memory between runs; it is the process peak")
        tc = dataclasses.replace(recipe.train_config(seed), device=device)
        holding = [len(devices) > 1]
        if holding[0]:
            init_lock.acquire()
        try:
            lm.train(p.cfg, tc, corpus, run_dir, resume=(run_dir / "config.json").exists(),
                  progress=False, on_step=_on_step)
        finally:
            if holding[0]:
                init_lock.release()

    try:
        if len(devices) == 1:
            for r in pending:
                one(*r, devices[0])
        else:
            free: Queue = Queue()
            for d in devices:
                free.put(d)

            def worker(r) -> None:
                d = free.get()
                try:
                    if not stop.is_set():
                        one(*r, d)
                finally:
                    free.put(d)

            with ThreadPoolExecutor(len(devices)) as ex:
                futures = [ex.submit(worker, r) for r in pending]
                try:
                    for f in as_completed(futures):
                        f.result()  # re-raises the first failure or interruption
                except BaseException:
                    stop.set()  # running workers stop at their next logged step
                    for f in futures:
                        f.cancel()
                    raise
    finally:
        if bar is not None:
            bar.close()
    return write_report(out, recipe, plan, corpus.describe(), command, log)
