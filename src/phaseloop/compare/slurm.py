"""``--launcher slurm``: one Slurm array task per run, through submitit (the ``slurm``
extra). Each task runs ``RunTask`` — a callable with ``checkpoint()``, submitit's
checkpointing protocol: on preemption or at the time limit submitit calls it, the task
marks its run requeued and is requeued as it is, and the new task resumes the run from
its last checkpoint (the steps since that checkpoint are trained again, to the same
result). With ``nproc_per_run`` K > 1 a task is K Slurm tasks on one node, joined into
one torch.distributed world through submitit's ``TorchDistributedEnvironment``.

submitit pickles what it submits (its protocol); the pickle holds only the path of the
run's JSON description (``runs.CompareRun``), which every task reads again.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from phaseloop.compare.grid import execute, write_state
from phaseloop.compare.launch import LaunchOptions
from phaseloop.compare.runs import CompareRun
from phaseloop.engine import dist
from phaseloop.errors import PhaseloopError
from phaseloop.files import read_json, write_json


def require():
    try:
        import submitit
    except ModuleNotFoundError:
        raise PhaseloopError("--launcher slurm needs submitit; install it with pip install "
                             "'phaseloop[slurm]'") from None
    return submitit


submitit = require()  # RunTask derives from its Checkpointable


class RunTask(submitit.helpers.Checkpointable):
    """One array task: ``grid.execute`` of the run (tuning or reported) described at ``spec_path``."""

    def __init__(self, spec_path: str):
        self.spec_path = str(spec_path)

    def __call__(self) -> str:

        spec = CompareRun.load(self.spec_path)
        env = submitit.JobEnvironment()
        if env.num_tasks > 1:  # a torch.distributed world of this task's processes
            submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
            dist.init(spec.train.device)
        try:
            execute(spec)
        finally:
            dist.close()
        return spec.name

    def checkpoint(self, *args, **kwargs):
        """Preempted or out of time: the run is pending again (its checkpoint stays)."""
        if submitit.JobEnvironment().global_rank == 0:
            write_state(CompareRun.load(self.spec_path), "requeued")
        return super().checkpoint(*args, **kwargs)


def executor(opts: LaunchOptions, folder: Path, name: str):
    """submitit's executor for ``opts`` (``opts.executor``: slurm, or local / debug here)."""
    try:
        ex = submitit.AutoExecutor(folder=folder, cluster=opts.executor)
    except RuntimeError as e:  # no srun: not a Slurm machine
        raise PhaseloopError(f"--launcher slurm: {e} (srun not found); submit from the cluster's login "
                             "node, or use --launcher local on this machine") from None
    params = dict(name=name, timeout_min=opts.time, nodes=1, tasks_per_node=opts.nproc_per_run,
                  gpus_per_node=opts.gpus_per_task, cpus_per_task=opts.cpus_per_task,
                  slurm_partition=opts.partition, slurm_account=opts.account,
                  slurm_array_parallelism=opts.array_parallelism,
                  slurm_additional_parameters=opts.sbatch_parameters() or None,
                  slurm_setup=opts.setup or None)
    try:
        ex.update_parameters(**{k: v for k, v in params.items() if v is not None})
    except (ValueError, NameError) as e:
        raise PhaseloopError(f"--launcher slurm: submitit refused the options: {str(e).splitlines()[0]}") from None
    return ex


def check(opts: LaunchOptions) -> None:
    """Refuse what ``executor`` would (no srun, options submitit refuses) before anything is
    written: the executor is made on a temporary folder (submitit's local one writes there)."""
    with tempfile.TemporaryDirectory() as d:
        executor(opts, Path(d), "check")


def submit(specs: list[CompareRun], opts: LaunchOptions, out: Path, name: str) -> list:
    """Submit ``specs`` as one job array; returns submitit's jobs (one per run). On a
    cluster each run's ``RUN.job.json`` records its task, so a relaunch leaves it alone
    while Slurm holds it (``still_queued``)."""
    ex = executor(opts, out / "slurm", f"phaseloop-{name}")
    jobs = ex.submit_array([RunTask(str(spec.save())) for spec in specs])
    if opts.executor == "slurm":
        for spec, job in zip(specs, jobs):
            write_json(spec.job_path, {"job": job.job_id, "time": time.time()})
    return jobs


# sacct's states of a job Slurm still holds (it will run, or runs, the task)
ALIVE = ("PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
         "RESIZING", "SUSPENDED", "PREEMPTED", "SIGNALING", "STAGE_OUT", "UNKNOWN")


def still_queued(specs: list[CompareRun], opts: LaunchOptions, log: Callable[[str], None] | None = None) -> set[str]:
    """The runs among ``specs`` whose recorded Slurm task the scheduler still holds (sacct,
    through submitit): submitting them again would put two writers in one run folder.
    A task sacct cannot tell about (UNKNOWN) counts as held; cancelling it (scancel)
    lets the next launch resubmit the run."""
    if opts.executor != "slurm":
        return set()
    held = set()
    for spec in specs:
        if not spec.job_path.exists():
            continue
        try:
            job_id = str(read_json(spec.job_path)["job"])
        except (PhaseloopError, KeyError, TypeError):
            continue
        state = submitit.SlurmJob(spec.out / "slurm", job_id).watcher.get_state(job_id, mode="force")
        if state.split()[0] in ALIVE:
            held.add(spec.name)
            if log:
                log(f"{spec.name}: left to Slurm job {job_id} ({state}); scancel {job_id} to resubmit it")
    return held


def wait(jobs: list, specs: list[CompareRun], log: Callable[[str], None] | None = None) -> list[str]:
    """Wait for every task; returns the failed runs' names."""
    failed = []
    for job, spec in zip(jobs, specs):
        try:
            job.result()
        except Exception as e:  # submitit's FailedJobError / UncompletedJobError: the run's own log says why
            failed.append(spec.name)
            if log:
                log(f"{spec.name}: task {job.job_id} failed ({type(e).__name__}); logs in {job.paths.folder}")
    return failed
