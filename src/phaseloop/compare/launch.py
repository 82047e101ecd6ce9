"""Launchers: who runs a comparison's runs (``runs.RunSpec``: each tuning round's, then the
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

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .grid import write_state
from .runs import RunSpec

LAUNCHERS = ("sequential", "local", "slurm")
EXECUTORS = ("slurm", "local", "debug")  # submitit's: a real cluster, or this machine (tests)
SLURM_KEYS = ("partition", "time", "gpus_per_task", "cpus_per_task", "account", "sbatch", "setup",
              "executor", "array_parallelism", "wait")


@dataclasses.dataclass
class LaunchOptions:
    launcher: str = "sequential"
    jobs: int | None = None  # local: workers at once (default: GPUs / nproc_per_run, or 1 on CPU)
    nproc_per_run: int = 1  # processes (GPUs) per run, under torchrun / Slurm tasks
    partition: str | None = None  # slurm ...
    time: int = 60  # minutes per task (then requeued, resuming from its checkpoint)
    gpus_per_task: int | None = None  # GPUs per array task (= per run)
    cpus_per_task: int | None = None
    account: str | None = None
    sbatch: list = dataclasses.field(default_factory=list)  # extra options, e.g. ["--qos=high"]
    setup: list = dataclasses.field(default_factory=list)  # shell lines before srun (module load ...)
    executor: str = "slurm"  # submitit's slurm, or local / debug on this machine
    array_parallelism: int | None = None  # tasks running at once (default: all)
    wait: bool = False  # slurm: wait for the array, then report (default: submit and return)

    @classmethod
    def resolve(cls, table: dict | None, flags: dict | None = None, where: str = "recipe [launcher]") -> "LaunchOptions":
        """The recipe's ``[launcher]`` table with the given command-line ``flags`` on top
        (None values: not given); refuses unknown keys and bad values (one line)."""
        from .recipe import RecipeError, _check_keys

        table, flags = dict(table or {}), {k: v for k, v in (flags or {}).items() if v is not None}
        _check_keys(cls, table, where, "launcher key")
        o = cls(**{**table, **flags})
        bad = o._problem()
        if bad:
            raise RecipeError(f"{where if bad[0] in table and bad[0] not in flags else 'command line'}: {bad[1]}")
        if o.launcher != "slurm":
            given = [k for k in SLURM_KEYS if k in flags and flags[k] not in (False, [])]
            if given:
                raise RecipeError(f"--{given[0].replace('_', '-')} applies to --launcher slurm (this is "
                                  f"--launcher {o.launcher}); add --launcher slurm or drop it")
        if o.launcher == "sequential" and "nproc_per_run" in flags:
            raise RecipeError("--nproc-per-run applies to --launcher local or slurm (a sequential comparison "
                              "under torchrun spreads every run over all its processes); add --launcher local")
        if o.launcher != "local" and "jobs" in flags:
            raise RecipeError(f"--jobs applies to --launcher local (this is --launcher {o.launcher}); "
                              "add --launcher local" + ("; Slurm runs one array task per run, "
                                                        "--array-parallelism caps how many at once"
                                                        if o.launcher == "slurm" else ""))
        return o

    def _problem(self) -> tuple[str, str] | None:
        def whole(v, low):
            return isinstance(v, int) and not isinstance(v, bool) and v >= low

        if self.launcher not in LAUNCHERS:
            return "launcher", f"launcher={self.launcher!r}: choose one of {', '.join(LAUNCHERS)}"
        if self.executor not in EXECUTORS:
            return "executor", f"executor={self.executor!r}: choose one of {', '.join(EXECUTORS)}"
        for k, low in (("jobs", 1), ("nproc_per_run", 1), ("time", 1), ("gpus_per_task", 0),
                       ("cpus_per_task", 1), ("array_parallelism", 1)):
            v = getattr(self, k)
            if (v is not None or k in ("nproc_per_run", "time")) and not whole(v, low):
                return k, f"{k}={v!r}: must be an integer >= {low}" + (" (minutes)" if k == "time" else "")
        for k in ("partition", "account"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v or any(c.isspace() for c in v)):
                return k, f"{k}={v!r}: must be a Slurm {k} name (no spaces)"
        if not isinstance(self.wait, bool):
            return "wait", f"wait={self.wait!r}: must be true or false"
        for k in ("sbatch", "setup"):
            v = getattr(self, k)
            if not isinstance(v, list) or any(not isinstance(x, str) or not x.strip() for x in v):
                return k, f"{k}={v!r}: must be a list of strings"
        for x in self.sbatch:
            if not x.startswith("--") or len(x) < 3 or any(c.isspace() for c in x.partition("=")[0]):
                return "sbatch", (f"sbatch option {x!r}: write it as sbatch's long option, --KEY=VALUE or "
                                  "--FLAG, e.g. --qos=high or --exclusive")
        if self.gpus_per_task and self.nproc_per_run > 1 and self.gpus_per_task < self.nproc_per_run:
            return "gpus_per_task", (f"gpus_per_task={self.gpus_per_task} for nproc_per_run={self.nproc_per_run}: "
                                     "each process of a run needs its own GPU; ask for at least as many")
        return None

    def sbatch_parameters(self) -> dict:
        """--KEY=VALUE options as submitit's ``additional_parameters`` (True: a bare flag)."""
        out = {}
        for x in self.sbatch:
            k, sep, v = x[2:].partition("=")
            out[k.replace("-", "_")] = v if sep else True
        return out


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

    from ..errors import PhaseloopError

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


def run_local(specs: list[RunSpec], jobs: int | None, nproc: int, device: str,
              log: Callable[[str], None] | None = None, poll_s: float = 0.05) -> list[str]:
    """Run ``specs`` in worker processes, ``jobs`` at a time; returns the failed runs'
    names (their state files say why). Ctrl-C / SIGTERM stop every worker (each run
    stays resumable) and re-raise."""
    import phaseloop

    slots = local_slots(jobs, nproc, device)
    src = str(Path(phaseloop.__file__).resolve().parents[1])  # the workers import this phaseloop
    path = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    queue, busy, failed = list(specs), {}, []
    say = log or (lambda m: None)
    if len(slots) > len(specs):
        slots = slots[:len(specs)]
    where = lambda env: ((f"GPU {env['CUDA_VISIBLE_DEVICES']}, " if env["CUDA_VISIBLE_DEVICES"] else "")  # noqa: E731
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
        raise
    return failed


def _mark_failed(spec: RunSpec, why: str, pid: int) -> None:
    """The worker's own word stands (it wrote failed, stopped); a worker killed outright
    said nothing (or still says running): say what the launcher saw."""
    from ..checkpoint import read_json

    try:
        said = read_json(spec.state_path).get("state") if spec.state_path.exists() else None
    except Exception:  # a damaged state file: replace it
        said = None
    if said not in ("failed", "stopped"):
        write_state(spec, "failed", error=why, pid=pid)
