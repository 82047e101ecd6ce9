"""A comparison's grid as independent run descriptions, and how one is run and watched.

A ``RunSpec`` is everything one run needs — its folder, model and training configs and
the data settings — as JSON, so any launcher can run it: in this process, in a worker
process (``phaseloop.compare.worker``), under torchrun or as a Slurm array task. Runs
share nothing but the token store: the seed and the data order come from the run's own
``TrainConfig`` (``data.TrainBatches``), never from which worker runs it.

Run state, for ``phaseloop compare --status`` (``run_state``), read from the files:

* **done**: the run folder holds ``summary.json`` (written last, by rename);
* **running**: ``OUT/launch/RUN.state.json`` says running and its heartbeat (the file's
  mtime, touched every ``HEARTBEAT_S`` seconds by the process training the run) is
  younger than ``STALE_AFTER`` heartbeats;
* **failed**: the state says failed (the worker caught an error and wrote it, or the
  local launcher saw its worker exit with an error), or says running with a stale
  heartbeat (a worker killed outright, a lost node);
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
from pathlib import Path
from typing import Callable

from ..checkpoint import checkpoint_dir, read_json, write_json
from ..errors import CheckpointError, PhaseloopError

LAUNCH = "launch"  # OUT/launch/: run descriptions, worker state and logs
STALE_AFTER = 4  # heartbeats missed before a "running" run counts as failed
STATES = ("done", "running", "pending", "failed")


def heartbeat_s() -> float:
    """Seconds between heartbeats (PHASELOOP_HEARTBEAT_S, default 30)."""
    try:
        return max(0.05, float(os.environ.get("PHASELOOP_HEARTBEAT_S", "30")))
    except ValueError:
        return 30.0


@dataclasses.dataclass
class RunSpec:
    """One run of a grid: ``train(ModelConfig(model), TrainConfig(train), data, run_dir)``."""
    name: str  # the run folder's name, unique in the grid
    run_dir: str
    model: dict  # ModelConfig.to_dict()
    train: dict  # TrainConfig.to_dict() (seed included)
    data: dict  # load_corpus arguments: spec, tokenizer, text_column
    tags: dict = dataclasses.field(default_factory=dict)  # e.g. variant, seed (not used to train)

    @property
    def out(self) -> Path:
        """The comparison folder (run folders lie in OUT/runs/)."""
        return Path(self.run_dir).parent.parent

    @property
    def spec_path(self) -> Path:
        return self.out / LAUNCH / f"{self.name}.json"

    @property
    def state_path(self) -> Path:
        return self.out / LAUNCH / f"{self.name}.state.json"

    @property
    def job_path(self) -> Path:
        """The Slurm task this run was last submitted as (``slurm.submit``)."""
        return self.out / LAUNCH / f"{self.name}.job.json"

    @property
    def log_path(self) -> Path:
        return self.out / LAUNCH / f"{self.name}.log"

    def save(self) -> Path:
        write_json(self.spec_path, dataclasses.asdict(self))
        return self.spec_path

    @classmethod
    def load(cls, path: str | Path) -> "RunSpec":
        d = read_json(Path(path))
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(d, dict) or any(k not in d for k in names[:5]) or set(d) - set(names):
            raise CheckpointError(f"{path} is not a run description (keys {', '.join(names)}); "
                                  "rerun `phaseloop compare` to write it again")
        return cls(**d)

    def configs(self):
        """(ModelConfig, TrainConfig), validated."""
        from ..config import ModelConfig
        from ..engine import TrainConfig

        return ModelConfig.from_dict(self.model), TrainConfig.from_dict(self.train)


def steps_done(run_dir: Path, steps: int) -> int:
    """Steps a run has behind it: all when finished, else its checkpoint's."""
    if (run_dir / "summary.json").exists():
        return steps
    ckpt = checkpoint_dir(run_dir)
    if ckpt is None:
        return 0
    from ..checkpoint import verify_checkpoint

    verify_checkpoint(ckpt, ("trainer.json",))
    return int(read_json(ckpt / "trainer.json")["step"])


# ---------------------------------------------------------------------------- state
def write_state(spec: RunSpec, state: str, **info) -> None:
    """OUT/launch/RUN.state.json: what the process running ``spec`` last said."""
    job = {k: os.environ[k] for k in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_ID")
           if k in os.environ}
    write_json(spec.state_path, {"state": state, "pid": os.getpid(), "host": socket.gethostname(),
                                 "time": time.time(), **job, **info})


def run_state(spec: RunSpec, now: float | None = None) -> dict:
    """{state, step, steps, detail} of a run (the module docstring's rules)."""
    steps = int(spec.train.get("steps", 0))
    run_dir = Path(spec.run_dir)
    try:
        step = steps_done(run_dir, steps)
    except PhaseloopError:
        step = None
    if (run_dir / "summary.json").exists():
        return {"state": "done", "step": steps, "steps": steps, "detail": ""}
    info: dict = {}
    if spec.state_path.exists():
        try:
            info = read_json(spec.state_path)
            age = (now or time.time()) - spec.state_path.stat().st_mtime
        except (PhaseloopError, OSError):
            info, age = {"state": "failed", "error": f"{spec.state_path} is damaged"}, 0.0
    where = " ".join(str(info[k]) for k in ("host", "pid") if k in info)
    job = info.get("SLURM_JOB_ID")
    where += f" job {job}" if job else ""
    said = info.get("state")
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

    def __init__(self, spec: RunSpec):
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
def execute(spec: RunSpec, corpus=None, *, on_step: Callable[[int, dict], None] | None = None,
            log: Callable[[str], None] | None = None, device: str | None = None) -> dict:
    """Train (or resume, or skip when finished) the run ``spec`` describes; its state
    file follows (rank 0 writes it). ``corpus``: already loaded (else it is loaded)."""
    from .. import train as lm
    from ..data import load_corpus
    from ..engine import dist

    cfg, tc = spec.configs()
    if device is not None:
        tc = dataclasses.replace(tc, device=device)
    run_dir = Path(spec.run_dir)
    if (run_dir / "summary.json").exists():
        return read_json(run_dir / "summary.json")
    if corpus is None:
        with dist.main_first():
            corpus = load_corpus(spec.data["spec"], spec.data["tokenizer"],
                                 text_column=spec.data["text_column"])
    main = dist.world().main
    resume = (run_dir / "config.json").exists()
    dist.barrier()  # every rank has looked before rank 0 writes this run's config.json
    beat = Heartbeat(spec) if main else None
    try:
        if beat is not None:
            beat.__enter__()
        summary = lm.train(cfg, tc, corpus, run_dir, resume=resume, progress=False, on_step=on_step, log=log)
    except KeyboardInterrupt:
        if main:
            write_state(spec, "stopped")
        raise
    except SystemExit:  # submitit's requeue exits from its signal handler: its state says requeued
        raise
    except BaseException as e:
        if main:
            write_state(spec, "failed", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        if beat is not None:
            beat.__exit__(None, None, None)
    if main:
        spec.state_path.unlink(missing_ok=True)  # summary.json says done
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
