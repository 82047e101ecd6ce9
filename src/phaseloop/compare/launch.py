"""Launchers: who runs a comparison's runs (``runs.CompareRun``: each tuning round's, then the
reported ones; ``runner.execute`` hands each list to the chosen launcher).

* ``sequential`` (the default): one after another in this process (``runner``); under
  torchrun every run spreads over all the processes (DDP / FSDP2).
* ``local``: ``jobs`` worker processes at once (``python -m phaseloop.compare.worker
  SPEC``, or ``torchrun --standalone --nproc-per-node K`` of it with ``nproc_per_run``
  K > 1), each pinned to its own GPUs (CUDA_VISIBLE_DEVICES) or, on CPU, its own share
  of the cores (affinity, torch threads and OMP/MKL_NUM_THREADS = cores / jobs / K). A
  worker that dies leaves its run resumable and the others go on.
* ``slurm``: one Slurm array task per run through submitit (``slurm``).

Options come from the recipe's ``[launcher]`` table, then the command line's flags.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from phaseloop.compare.grid import write_state
from phaseloop.compare.options import EXECUTORS, LAUNCHERS, SLURM_KEYS, LaunchOptions, RecipeError  # noqa: F401
from phaseloop.compare.runs import CompareRun
from phaseloop.errors import PhaseloopError
from phaseloop.files import read_json


# ---------------------------------------------------------------------------- local
def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def local_slots(jobs: int | None, nproc: int, device: str) -> list[dict]:
    """The environment of each worker: its own share of the cores (affinity and threads
    per process) and, on GPUs, its own ``nproc`` of them."""
    import torch

    gpus: list[str] = []
    if device != "cpu" and torch.cuda.is_available():
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g for g in seen.split(",") if g.strip()] if seen else [str(i) for i in range(torch.cuda.device_count())]
        jobs = jobs or max(1, len(gpus) // nproc)
        if jobs * nproc > len(gpus):
            raise PhaseloopError(f"--jobs {jobs} x --nproc-per-run {nproc} needs {jobs * nproc} GPUs and "
                                 f"{len(gpus)} are visible; lower --jobs to {max(1, len(gpus) // nproc)}")
    cores = _cores()
    jobs = jobs or 1
    share = max(1, len(cores) // jobs)
    threads = str(max(1, share // nproc))
    slots = []
    for i in range(jobs):  # more workers than cores: they share, round robin
        mine = [cores[(i * share + j) % len(cores)] for j in range(share)]
        slots.append({"PHASELOOP_CPUS": ",".join(map(str, mine)), "OMP_NUM_THREADS": threads,
                      "MKL_NUM_THREADS": threads, "PHASELOOP_THREADS": threads,
                      "CUDA_VISIBLE_DEVICES": ",".join(gpus[i * nproc:(i + 1) * nproc])})
    return slots


def worker_command(spec_path: Path, nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "phaseloop.compare.worker", str(spec_path)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "phaseloop.compare.worker", str(spec_path)]


def _why(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _last_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][-200:] if lines else ""


def run_local(specs: list[CompareRun], jobs: int | None, nproc: int, device: str,
              log: Callable[[str], None] | None = None, poll_s: float = 0.05) -> list[str]:
    """Run ``specs`` in worker processes, ``jobs`` at a time; returns the failed runs'
    names (their state files say why). Ctrl-C / SIGTERM stop every worker (each run
    stays resumable, its state stopped) and re-raise."""
    slots = local_slots(jobs, nproc, device)
    src = str(Path(__file__).resolve().parents[2])  # src/: the workers import this phaseloop
    path = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    queue, busy, failed = list(specs), {}, []
    say = log or (lambda m: None)
    if len(slots) > len(specs):
        slots = slots[:len(specs)]
    where = lambda env: ((f"GPU {env['CUDA_VISIBLE_DEVICES']}, " if env["CUDA_VISIBLE_DEVICES"] else "")
                         + f"cores {env['PHASELOOP_CPUS']}, {env['PHASELOOP_THREADS']} thread(s)")
    try:
        while queue or busy:
            for i, env in enumerate(slots):
                if i in busy or not queue:
                    continue
                spec = queue.pop(0)
                spec.log_path.parent.mkdir(parents=True, exist_ok=True)
                out = open(spec.log_path, "ab")
                p = subprocess.Popen(worker_command(spec.save(), nproc), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **env, "PYTHONPATH": path})
                out.close()
                write_state(spec, "running", pid=p.pid)  # the worker's heartbeat follows once it has started
                busy[i] = (spec, p)
                say(f"{spec.name}: started ({where(env)}, pid {p.pid})")
            time.sleep(poll_s)
            for i, (spec, p) in list(busy.items()):
                rc = p.poll()
                if rc is None:
                    continue
                del busy[i]
                if rc == 0 and spec.finished:
                    say(f"{spec.name}: done ({len(specs) - len(queue) - len(busy) - len(failed)} of {len(specs)})")
                    continue
                failed.append(spec.name)
                _mark_failed(spec, f"worker {_why(rc)}: {_last_line(spec.log_path)}", p.pid)
                say(f"{spec.name}: failed ({_why(rc)}); its log: {spec.log_path}; it resumes from its "
                    "checkpoint when the command is run again")
    except BaseException:
        for _, p in busy.values():
            p.send_signal(signal.SIGTERM)  # each worker stops at a step and keeps its checkpoint
        for spec, p in busy.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            _mark_stopped(spec, p.pid)
        raise
    return failed


def _mark_failed(spec: CompareRun, why: str, pid: int) -> None:
    """The worker's own word stands (it wrote failed, stopped); a worker killed outright
    said nothing (or still says running): say what the launcher saw."""

    try:
        said = read_json(spec.state_path).get("state") if spec.state_path.exists() else None
    except Exception:  # a damaged state file: replace it
        said = None
    if said not in ("failed", "stopped"):
        write_state(spec, "failed", error=why, pid=pid)


def _mark_stopped(spec: CompareRun, pid: int) -> None:
    """After the launcher stopped a worker: its own word stands (stopped, failed); one
    stopped before it could say anything (still starting) still says running: stopped."""
    try:
        said = read_json(spec.state_path).get("state") if spec.state_path.exists() else None
    except Exception:  # a damaged state file: replace it
        said = None
    if said == "running":
        write_state(spec, "stopped", pid=pid)
