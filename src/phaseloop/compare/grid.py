"""How one run of a comparison (``runs.CompareRun``: a tuning run or a reported one) is
run and watched, whichever launcher runs it: in this process, in a worker process
(``phaseloop.compare.worker``), under torchrun or as a Slurm array task.

Run state, for ``phaseloop compare --status`` (``run_state``), read from the files:

* **done**: the run is finished (``CompareRun.finished``: its folder holds ``summary.json``,
  written last by rename, or a tuning run's ``diverged.json``);
* **running**: ``OUT/launch/RUN.state.json`` says running, the process it names is alive
  where that can be told (this host: its pid, start time and boot, ``process_identity``),
  and its heartbeat (the file's mtime, touched every ``HEARTBEAT_S`` seconds by the
  process training the run) is younger than ``STALE_AFTER`` heartbeats;
* **failed**: the state says failed (the worker caught an error and wrote it, or the
  local launcher saw its worker exit with an error), or says running while the process
  it names on this host is gone (killed outright: told at once, also when its pid has
  been given to another process since) or with a stale heartbeat (a lost node);
* **pending**: anything else — never started, queued in Slurm (``RUN.job.json`` names
  the task), stopped by Ctrl-C / SIGTERM, or requeued by Slurm after preemption or a
  time limit.

Every state but done is resumable: the run restarts from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable

from phaseloop.compare.runs import DIVERGED, CompareRun
from phaseloop.engine import dist
from phaseloop.engine.trainer import DivergedError
from phaseloop.errors import PhaseloopError
from phaseloop.files import read_json, write_json
from phaseloop.lm import train as lm

STALE_AFTER = 4  # heartbeats missed before a "running" run counts as failed
STATES = ("done", "running", "pending", "failed")


def heartbeat_s() -> float:
    """Seconds between heartbeats (PHASELOOP_HEARTBEAT_S, default 30)."""
    try:
        return max(0.05, float(os.environ.get("PHASELOOP_HEARTBEAT_S", "30")))
    except ValueError:
        return 30.0


# ---------------------------------------------------------------------------- state
def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def process_identity(pid: int) -> dict:
    """{"start", "boot"} of process ``pid`` of this host: its start time (field 22 of
    /proc/PID/stat, clock ticks since boot) and the boot's id, which together tell it
    from a later process given the same pid; {} when no such process runs (or there is
    no /proc: not Linux)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            stat = f.read()
        start = int(stat[stat.rindex(")") + 2:].split()[19])  # fields from 3 on follow "(comm) "
    except (OSError, ValueError, IndexError):
        return {}
    return {"start": start, "boot": _boot_id()}


def holder_alive(info: dict) -> bool | None:
    """Is the process a state file names (``info``: its pid, host and identity) still
    running? None where that cannot be told: another host, no /proc, a state file that
    names no pid; then the heartbeat decides."""
    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or not os.path.isdir("/proc/self"):
        return None
    now = process_identity(pid)
    if not now:
        return False
    if "start" not in info:  # written before identities were recorded: the pid may be reused
        return None
    return now["start"] == info["start"] and info.get("boot") in (None, now["boot"])


def write_state(spec: CompareRun, state: str, **info) -> None:
    """OUT/launch/RUN.state.json: what the process running ``spec`` last said; ``pid``
    (default this process) is recorded with its identity (``process_identity``)."""
    job = {k: os.environ[k] for k in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_ID")
           if k in os.environ}
    pid = info.pop("pid", os.getpid())
    write_json(spec.state_path, {"state": state, "pid": pid, **process_identity(pid),
                                 "host": socket.gethostname(), "time": time.time(), **job, **info})


def run_state(spec: CompareRun, now: float | None = None) -> dict:
    """{state, step, steps, detail} of a run (the module docstring's rules)."""
    steps = spec.train.steps
    try:
        step = spec.steps_done()
    except PhaseloopError:
        step = None
    if spec.finished:
        return {"state": "done", "step": steps, "steps": steps,
                "detail": "diverged (scored as infinite)" if (spec.run_dir / DIVERGED).exists() else ""}
    info: dict = {}
    if spec.state_path.exists():
        try:
            info = read_json(spec.state_path)
            age = (now or time.time()) - spec.state_path.stat().st_mtime
        except (PhaseloopError, OSError):
            info, age = {"state": "failed", "error": f"{spec.state_path} is damaged"}, 0.0
    where = " on ".join(f"{k} {info[k]}" if k == "pid" else str(info[k]) for k in ("pid", "host") if k in info)
    job = info.get("SLURM_JOB_ID")
    where += f" job {job}" if job else ""
    said = info.get("state")
    if said == "running" and holder_alive(info) is False:
        return {"state": "failed", "step": step, "steps": steps,
                "detail": f"{where} is gone: the process died without saying so (killed?)"}
    if said == "running" and age <= STALE_AFTER * heartbeat_s():
        return {"state": "running", "step": step, "steps": steps, "detail": where}
    if said == "running":
        return {"state": "failed", "step": step, "steps": steps,
                "detail": f"no heartbeat for {age:.0f} s from {where}: the worker died"}
    if said == "failed":
        return {"state": "failed", "step": step, "steps": steps, "detail": str(info.get("error", ""))}
    detail = {"requeued": "requeued", "stopped": "stopped"}.get(said, "")
    if said != "stopped" and spec.job_path.exists():
        try:
            detail = f"{detail or 'queued'} as Slurm job {read_json(spec.job_path)['job']}"
        except (PhaseloopError, KeyError, TypeError):
            pass
    return {"state": "pending", "step": step, "steps": steps, "detail": detail}


class Heartbeat:
    """Marks a run running and touches its state file every ``heartbeat_s()`` seconds
    from a daemon thread, until the body ends (then: nothing; the caller says how)."""

    def __init__(self, spec: CompareRun):
        self.spec, self._stop = spec, threading.Event()

    def __enter__(self):
        write_state(self.spec, "running")
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(heartbeat_s()):
            try:
                os.utime(self.spec.state_path)
            except OSError:
                pass

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


# ---------------------------------------------------------------------------- one run
def execute(spec: CompareRun, corpus=None, *, on_step: Callable[[int, dict], None] | None = None,
            log: Callable[[str], None] | None = None, device: str | None = None) -> dict | None:
    """Train (or resume, or skip when finished) the run ``spec`` describes; its state
    file follows (rank 0 writes it). ``corpus``: the recipe's corpus, already loaded (else
    it is loaded). A tuning run that diverges is recorded (diverged.json: finished,
    scored as infinite; returns None); a reported run that diverges fails."""

    tc = spec.train if device is None else dataclasses.replace(spec.train, device=device)
    run_dir = spec.run_dir
    if spec.finished:
        return read_json(run_dir / "summary.json") if (run_dir / "summary.json").exists() else None
    data = spec.corpus(corpus)
    main = dist.world().main
    resume = (run_dir / "config.json").exists()
    dist.barrier()  # every rank has looked before rank 0 writes this run's config.json
    beat = Heartbeat(spec) if main else None
    try:
        if beat is not None:
            beat.__enter__()
        summary = lm.train(spec.cfg, tc, data, run_dir, resume=resume, progress=False, on_step=on_step, log=log,
                           compile_share=spec.compile_share)
    except KeyboardInterrupt:
        if main:
            write_state(spec, "stopped")
        raise
    except SystemExit:  # submitit's requeue exits from its signal handler: its state says requeued
        raise
    except DivergedError as e:
        if not spec.tuning:
            if main:
                write_state(spec, "failed", error=f"DivergedError: {e}")
            raise
        if main:
            write_json(run_dir / DIVERGED, {"error": str(e)})
        dist.barrier()  # every rank sees it before deciding what is finished
        (log or dist.say)(f"tuning run {spec.name} diverged; scored as infinite")
        summary = None
    except BaseException as e:
        if main:
            write_state(spec, "failed", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        if beat is not None:
            beat.__exit__(None, None, None)
    if main:
        spec.state_path.unlink(missing_ok=True)  # summary.json (diverged.json) says done
    return summary


def format_status(rows: list[dict]) -> str:
    """``--status``: one line per run, then the count of each state."""
    width = max([len(r["name"]) for r in rows] + [3])
    lines = [f"{'run':<{width}}  {'state':<8} {'steps':>11}  detail"]
    for r in rows:
        done = f"{'?' if r['step'] is None else r['step']}/{r['steps']}"
        lines.append(f"{r['name']:<{width}}  {r['state']:<8} {done:>11}  {r['detail']}".rstrip())
    counts = ", ".join(f"{sum(r['state'] == s for r in rows)} {s}" for s in STATES)
    return "\n".join(lines + [f"{len(rows)} runs: {counts}"])
