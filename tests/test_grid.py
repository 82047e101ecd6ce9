"""Comparison grids through launchers (issue 29): local worker processes give the
sequential comparison's runs exactly, a killed worker's run resumes, the Slurm path
through submitit's debug / local executors and the sbatch script it would submit,
--status and --report; [tune] comparisons through the same launchers (issue 27's tuning
rounds run as the reported runs do)."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import assert_one_line
from test_compare import TINY_TRAIN, _one_thread, tiny_recipe  # noqa: F401 (the fixture applies here too)

from phaseloop import compare
from phaseloop.cli import main
from phaseloop.compare import LaunchOptions, RecipeError, comparison_status, run_comparison
from phaseloop.compare import launch as launch_mod
from phaseloop.engine.trainer import PeerFailed

TIMING = ("tok_per_s", "mfu", "elapsed_s")  # wall-clock fields: everything else must be equal


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without its timings."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    """The reference: the tiny grid (2 variants x 2 seeds) in this process, one thread."""
    import torch

    d = tmp_path_factory.mktemp("seq")
    text = d / "corpus.txt"
    from conftest import write_corpus

    write_corpus(text)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_comparison(tiny_recipe(text), d / "cmp", progress=False, log=None)
    finally:
        torch.set_num_threads(n)
    return text, d / "cmp"


def assert_same_runs(a: Path, b: Path, names=None) -> None:
    names = names or sorted(p.name for p in (a / "runs").iterdir())
    assert names
    for name in names:
        got, want = records(b / "runs" / name), records(a / "runs" / name)
        assert got == want, name  # exactly: same seeds, same batches, same arithmetic
        sa, sb = (json.loads((x / "runs" / name / "summary.json").read_text()) for x in (a, b))
        assert sa["val_loss"] == sb["val_loss"] and sa["step"] == sb["step"]


def test_local_two_workers_equal_sequential(sequential, tmp_path, monkeypatch):
    text, seq = sequential
    cores = launch_mod._cores()
    monkeypatch.setattr(launch_mod, "_cores", lambda: (cores * 2)[:2])  # one core, one thread per worker
    msgs = []
    s = run_comparison(tiny_recipe(text), tmp_path / "loc", progress=False, log=msgs.append,
                       launch=LaunchOptions(launcher="local", jobs=2))
    assert_same_runs(seq, tmp_path / "loc")
    started = [m for m in msgs if ": started (" in m]
    assert len(started) == 4 and {m.split("(")[1].split(",")[0] for m in started} == \
        {f"cores {c}" for c in (cores * 2)[:2]}  # two workers, each on its own core
    assert all("1 thread(s)" in m for m in started)
    assert [v["name"] for v in s["variants"]] == ["rope", "three_phase N=3"]
    rows = comparison_status(tmp_path / "loc")
    assert [r["state"] for r in rows] == ["done"] * 4


def test_slurm_debug_executor_equals_sequential(sequential, tmp_path):
    text, seq = sequential
    run_comparison(tiny_recipe(text), tmp_path / "dbg", progress=False, log=None,
                   launch=LaunchOptions(launcher="slurm", executor="debug", wait=True))
    assert_same_runs(seq, tmp_path / "dbg")
    assert (tmp_path / "dbg" / "report.md").exists()


def _wait_for(cond, timeout=300.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.005)
    raise AssertionError("timed out")


def _step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return max(json.loads(x)["step"] for x in lines[:-1]) if len(lines) > 1 else 0
    except (OSError, ValueError):
        return 0


LONG = dict(TINY_TRAIN, steps=40, eval_every=10, ckpt_every=2, log_every=1)


def test_killed_worker_resumes_and_status_and_report(tmp_path, text_file, capsys):
    recipe = tiny_recipe(text_file, variants=["rope"], train=LONG)
    out = tmp_path / "cmp"
    opts = LaunchOptions(launcher="local", jobs=2)
    err = []

    def launch():
        try:
            run_comparison(recipe, out, progress=False, log=None, launch=opts)
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=launch)
    t.start()
    victim = out / "runs" / "rope-s0"
    _wait_for(lambda: _step(victim) >= 3)
    pid = json.loads((out / "launch" / "rope-s0.state.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)  # the worker dies mid-run, between or inside any write
    t.join()
    assert not (victim / "summary.json").exists()
    assert len(err) == 1 and isinstance(err[0], PeerFailed) and "rope-s0" in str(err[0])
    assert (out / "runs" / "rope-s1" / "summary.json").exists()  # the other worker went on

    assert main(["compare", str(out / "recipe.json"), "--out", str(out), "--status"]) == 0
    status = capsys.readouterr().out
    assert "SIGKILL" in status and "1 done, 0 running, 0 pending, 1 failed" in status
    rows = {r["name"]: r for r in comparison_status(out)}
    assert rows["rope-s0"]["state"] == "failed" and 2 <= rows["rope-s0"]["step"] < 40

    # --report: what finished (seed 1 only), nothing trained
    assert main(["compare", str(out / "recipe.json"), "--out", str(out), "--report", "--quiet"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["variants"][0]["finished_seeds"] == [1]
    assert not (victim / "summary.json").exists()

    # the same command again resumes the killed run from its checkpoint, to the clean result
    run_comparison(recipe, out, progress=False, log=None, launch=opts)
    assert [r["state"] for r in comparison_status(out)] == ["done", "done"]
    clean = tmp_path / "clean"
    run_comparison(tiny_recipe(text_file, variants=["rope"], seeds=[0], train=LONG), clean, progress=False, log=None)
    assert records(victim) == records(clean / "runs" / "rope-s0")


def test_state_rules(tmp_path, monkeypatch):
    """running needs a fresh heartbeat; a stale one is a dead worker; requeued is pending."""
    from phaseloop.compare import main_runs, plan_variants
    from phaseloop.compare.grid import run_state, write_state

    recipe = tiny_recipe("stdlib", variants=["rope"], seeds=[0], train=dict(TINY_TRAIN, steps=10))
    spec = main_runs(recipe, plan_variants(recipe, 256), tmp_path, {})[0]
    assert run_state(spec)["state"] == "pending"
    write_state(spec, "running")
    assert run_state(spec)["state"] == "running"
    monkeypatch.setenv("PHASELOOP_HEARTBEAT_S", "1")
    stale = run_state(spec, now=time.time() + 5)
    assert stale["state"] == "failed" and "no heartbeat" in stale["detail"]
    write_state(spec, "requeued")
    assert run_state(spec, now=time.time() + 60) == {"state": "pending", "step": 0, "steps": 10, "detail": "requeued"}
    write_state(spec, "failed", error="DataError: gone")
    assert run_state(spec)["detail"] == "DataError: gone"
    spec.run_dir.mkdir(parents=True)
    (spec.run_dir / "summary.json").write_text("{}")
    assert run_state(spec)["state"] == "done"


def test_run_description_round_trips_through_json(tmp_path, text_file):
    """What a worker or a Slurm task reads is the run the runner described: tuning flag,
    the variant's own settings, its tuned point, folder and data."""
    from phaseloop.compare import CompareRun, Tune, plan_variants
    from phaseloop.compare.tune import tuning_runs

    recipe = tiny_recipe(text_file, variants=[{"spec": "rope", "train": {"beta2": 0.99}}], seeds=[0],
                         tune={"lr": [1e-3, 2e-3], "seeds": [7]})
    plan = plan_variants(recipe, 256)
    for spec in [*tuning_runs(recipe, Tune(**recipe.tune), plan[0], [1e-3, 2e-3], tmp_path),
                 *compare.main_runs(recipe, plan, tmp_path, {"rope": {"lr": 2e-3}})]:
        back = CompareRun.load(spec.save())
        assert back == spec and back.run_dir == spec.run_dir and back.train.beta2 == 0.99
    assert (tmp_path / "launch" / "tune" / "rope" / "lr0.002-s7.json").exists()
    assert back.train.lr == 2e-3 and not back.tuning and spec.run_dir == tmp_path / "runs" / "rope-s0"


def test_preempted_task_is_requeued_and_resumes(tmp_path, text_file):
    """submitit's local executor runs the task in its own process and requeues it as
    Slurm would; USR2 (what Slurm sends before preemption or the time limit) makes
    submitit call RunTask.checkpoint: the run shows pending (requeued), then the
    requeued task resumes it from its checkpoint to the uninterrupted result."""
    recipe = tiny_recipe(text_file, variants=["rope"], seeds=[0], train=LONG)
    out = tmp_path / "cmp"
    run_comparison(recipe, out, progress=False, log=None,
                   launch=LaunchOptions(launcher="slurm", executor="local", time=5))
    run = out / "runs" / "rope-s0"
    _wait_for(lambda: _step(run) >= 3)
    pid = json.loads((out / "launch" / "rope-s0.state.json").read_text())["pid"]
    os.kill(pid, signal.SIGUSR2)
    seen = []
    _wait_for(lambda: seen.append(comparison_status(out)[0]) or seen[-1]["detail"] == "requeued")
    assert seen[-1]["state"] == "pending" and 2 <= seen[-1]["step"] < 40
    _wait_for(lambda: (run / "summary.json").exists())
    logs = "".join(p.read_text() for p in (out / "slurm").glob("*_log.out"))
    assert "Calling checkpoint method" in logs and "Requeued job" in logs
    assert logs.count("Loading pickle") == 2  # the task ran twice: before and after its requeue
    clean = tmp_path / "clean"
    run_comparison(recipe, clean, progress=False, log=None)
    assert records(run) == records(clean / "runs" / "rope-s0")
    assert comparison_status(out)[0]["state"] == "done"


def _fake_slurm(tmp_path, monkeypatch) -> Path:
    """sbatch, sacct and srun on PATH: sbatch keeps each script it is given (as
    submitted.JOBID) and answers as Slurm does, job ids from 4242 up; sacct prints
    tmp/sacct.txt."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "sbatch").write_text(f'#!/bin/sh\nn=$(cat {tmp_path}/next 2>/dev/null || echo 4242)\n'
                                 f'echo $((n + 1)) > {tmp_path}/next\ncp "$1" {tmp_path}/submitted.$n\n'
                                 'echo "Submitted batch job $n"\n')
    (bin_ / "sacct").write_text(f"#!/bin/sh\ncat {tmp_path}/sacct.txt\n")
    (bin_ / "srun").write_text("#!/bin/sh\nexit 1\n")
    for f in ("sbatch", "sacct", "srun"):
        (bin_ / f).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


REPO = Path(__file__).resolve().parents[1]


def test_sbatch_script_status_and_resubmission(tmp_path, text_file, monkeypatch, capsys):
    fake = _fake_slurm(tmp_path, monkeypatch)
    out = tmp_path / "cmp"
    base = ["compare", str(REPO / "recipes" / "ci.toml"), "--data", str(text_file), "--out", str(out),
            "--steps", "4", "--seeds", "0", "--quiet"]
    slurm = [*base, "--launcher", "slurm", "--partition", "gpu", "--time", "90", "--gpus-per-task", "2",
             "--nproc-per-run", "2", "--cpus-per-task", "4", "--account", "proj",
             "--sbatch=--qos=high", "--sbatch=--exclusive"]
    assert main(slurm) == 0
    assert "submitted 2 runs as Slurm job 4242" in capsys.readouterr().err
    script = (fake / "submitted.4242").read_text().splitlines()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --time=90", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --ntasks-per-node=2", "#SBATCH --cpus-per-task=4", "#SBATCH --account=proj",
                 "#SBATCH --qos=high", "#SBATCH --exclusive", "#SBATCH --array=0-1%2", "#SBATCH --nodes=1",
                 "#SBATCH --signal=USR2@90"):
        assert line in script, line
    assert any(x.startswith("srun ") and "submitit.core._submit" in x for x in script)
    assert sorted(p.name for p in (out / "launch").glob("*-s0.json")) == ["rope-s0.json", "three_phase-N3-s0.json"]

    assert main([*base, "--status"]) == 0
    status = capsys.readouterr().out
    assert "2 runs: 0 done, 0 running, 2 pending, 0 failed" in status
    assert "queued as Slurm job 4242_0" in status and "queued as Slurm job 4242_1" in status

    # launched again: the task Slurm still holds is left alone, the cancelled one resubmitted
    (fake / "sacct.txt").write_text("JobID|State|NodeList\n4242_0|PENDING|\n4242_1|CANCELLED by 7|n1\n")
    assert main(slurm) == 0
    err = capsys.readouterr().err
    assert "rope-s0: left to Slurm job 4242_0 (PENDING)" in err and "submitted 1 runs as Slurm job 4243" in err
    assert json.loads((out / "launch" / "three_phase-N3-s0.job.json").read_text())["job"] == "4243"
    assert json.loads((out / "launch" / "rope-s0.job.json").read_text())["job"] == "4242_0"

    # the [launcher] table: the same options from the recipe; flags on top
    r = compare.Recipe.from_dict({"variants": ["rope"], "launcher": {"launcher": "slurm", "partition": "a",
                                                                      "sbatch": ["--qos=low"]}})
    o = LaunchOptions.resolve(r.launcher, {"partition": "b"})
    assert (o.launcher, o.partition, o.sbatch_parameters()) == ("slurm", "b", {"qos": "low"})


@pytest.mark.parametrize("flags, msg", [
    (["--launcher", "slurm", "--sbatch", "qos=high"], "write it as sbatch's long option"),
    (["--launcher", "slurm", "--jobs", "2"], "--jobs applies to --launcher local"),
    (["--launcher", "local", "--partition", "gpu"], "--partition applies to --launcher slurm"),
    (["--launcher", "slurm", "--gpus-per-task", "1", "--nproc-per-run", "2"], "its own GPU"),
    (["--status"], "holds no comparison"),
    (["--nproc-per-run", "2"], "--nproc-per-run applies to --launcher local or slurm"),
])
def test_bad_launcher_options(tmp_path, capsys, flags, msg):
    code = main(["compare", str(REPO / "recipes" / "ci.toml"), "--out", str(tmp_path / "x"), *flags])
    assert_one_line(code, capsys.readouterr().err, msg)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("table, msg", [
    ({"jobs": 4}, 'recipe [launcher]: jobs applies to launcher = "local"'),
    ({"partition": "gpu", "time": 240}, 'recipe [launcher]: partition applies to launcher = "slurm"'),
    ({"nproc_per_run": 2}, 'recipe [launcher]: nproc_per_run applies to launcher = "local" or slurm'),
    ({"launcher": "slurm", "jobs": 2}, 'jobs applies to launcher = "local" (this is slurm'),
])
def test_launcher_keys_of_a_recipe_that_do_not_apply_are_refused_as_flags_are(table, msg):
    with pytest.raises(RecipeError) as e:
        LaunchOptions.resolve(table)
    assert msg in str(e.value)
    assert LaunchOptions.resolve({"nproc_per_run": 1, "time": 60, "wait": False}).launcher == "sequential"  # defaults
    slurm = {"launcher": "slurm", "partition": "gpu", "time": 240, "gpus_per_task": 2, "nproc_per_run": 2}
    for launcher in ("local", "sequential"):  # a flag switching the launcher: the same folder resumed elsewhere
        assert LaunchOptions.resolve(slurm, {"launcher": launcher}).launcher == launcher


def test_bad_launcher_table():
    with pytest.raises(RecipeError, match="unknown launcher key 'partiton'.*did you mean 'partition'"):
        compare.Recipe.from_dict({"variants": ["rope"], "launcher": {"partiton": "gpu"}})
    for bad in (0, 2**40):  # minutes, at most MAX_INT
        with pytest.raises(RecipeError, match=f"time={bad}: must be an integer from 1 to 2,147,483,647"):
            LaunchOptions.resolve(compare.Recipe.from_dict({"variants": ["rope"], "launcher": {
                "launcher": "slurm", "time": bad}}).launcher)


def test_missing_submitit_is_one_line(tmp_path, text_file, monkeypatch, capsys):
    import phaseloop.compare as pkg

    monkeypatch.setitem(sys.modules, "submitit", None)
    monkeypatch.delitem(sys.modules, "phaseloop.compare.slurm", raising=False)
    monkeypatch.delattr(pkg, "slurm", raising=False)
    code = main(["compare", str(REPO / "recipes" / "ci.toml"), "--data", str(text_file), "--out",
                 str(tmp_path / "x"), "--steps", "2", "--seeds", "0", "--launcher", "slurm", "--quiet"])
    assert_one_line(code, capsys.readouterr().err, "pip install 'phaseloop[slurm]'")
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_local_nproc_per_run_uses_torchrun(tmp_path, text_file):
    """--nproc-per-run 2: each run is a torchrun world of two processes (gloo on CPU)."""
    recipe = tiny_recipe(text_file, variants=["rope"], seeds=[0], train=dict(TINY_TRAIN, steps=2))
    run_comparison(recipe, tmp_path / "c", progress=False, log=None,
                   launch=LaunchOptions(launcher="local", jobs=1, nproc_per_run=2))
    run = tmp_path / "c" / "runs" / "rope-s0"
    assert json.loads((run / "config.json").read_text())["parallel"]["world_size"] == 2
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2


def test_local_slots_pin_gpus_and_cores(monkeypatch):
    """An 8-GPU, 16-core node: --jobs 4 --nproc-per-run 2 gives each worker two GPUs of its
    own and four cores (two threads per process); too many workers is refused."""
    import torch

    from phaseloop.errors import PhaseloopError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(launch_mod, "_cores", lambda: list(range(16)))
    slots = launch_mod.local_slots(4, 2, "auto")
    assert [s["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0,1", "2,3", "4,5", "6,7"]
    assert [s["PHASELOOP_CPUS"] for s in slots][1] == "4,5,6,7" and slots[0]["OMP_NUM_THREADS"] == "2"
    assert len(launch_mod.local_slots(None, 1, "cuda")) == 8  # default: a worker per GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert [s["CUDA_VISIBLE_DEVICES"] for s in launch_mod.local_slots(2, 1, "auto")] == ["3", "5"]
    with pytest.raises(PhaseloopError, match="needs 4 GPUs and 2 are visible; lower --jobs to 1"):
        launch_mod.local_slots(2, 2, "auto")
    assert launch_mod.local_slots(2, 1, "cpu")[0]["CUDA_VISIBLE_DEVICES"] == ""


def test_tuned_comparison_through_launchers_equals_sequential(tmp_path, text_file, monkeypatch):
    """[tune] through the launchers: every tuning round (the grid grows at its edge once,
    so there are two) and the reported runs go through 2 local workers, then through
    submitit's debug executor; each gives the sequential comparison's tuning losses, chosen
    rate and per-run metrics exactly. --status lists the tuning runs, --report rebuilds
    the tuning section from them."""
    cores = launch_mod._cores()
    monkeypatch.setattr(launch_mod, "_cores", lambda: (cores * 2)[:2])
    recipe = tiny_recipe(text_file, variants=["rope"], tune={"lr": [1e-3, 3e-3], "seeds": [7], "extend": 1})
    seq = run_comparison(recipe, tmp_path / "seq", progress=False, log=None)
    assert seq["tuning"]["rope"]["extensions"] == 1 and seq["tuning"]["rope"]["lrs"] == [1e-3, 3e-3, 9e-3]
    tuned = [f"tune/rope/lr{x:g}-s7" for x in (1e-3, 3e-3, 9e-3)]
    msgs = {"loc": [], "dbg": []}
    for name, launch in (("loc", LaunchOptions(launcher="local", jobs=2)),
                         ("dbg", LaunchOptions(launcher="slurm", executor="debug", wait=True))):
        got = run_comparison(recipe, tmp_path / name, progress=False, log=msgs[name].append, launch=launch)
        assert got["tuning"] == seq["tuning"]  # the same losses per grid point, the same chosen rate
        assert_same_runs(tmp_path / "seq", tmp_path / name)  # the reported runs at that rate
        for t in tuned:
            assert records(tmp_path / name / t) == records(tmp_path / "seq" / t), t
    # each tuning round, then the reported runs, went to the workers
    assert [m.split(":")[0] for m in msgs["loc"] if ": started (" in m] == [*tuned, "rope-s0", "rope-s1"]
    assert any(m.startswith("submitted 2 tuning runs as submitit debug job") for m in msgs["dbg"])
    rows = comparison_status(tmp_path / "loc")
    assert [(r["name"], r["state"]) for r in rows] == [(n, "done") for n in [*tuned, "rope-s0", "rope-s1"]]
    (tmp_path / "loc" / "summary.json").unlink()
    assert main(["compare", str(tmp_path / "loc" / "recipe.json"), "--out", str(tmp_path / "loc"),
                 "--report", "--quiet"]) == 0
    reported = json.loads((tmp_path / "loc" / "summary.json").read_text())
    assert reported["tuning"] == json.loads((tmp_path / "seq" / "summary.json").read_text())["tuning"]
    assert "## Learning-rate tuning" in (tmp_path / "loc" / "report.md").read_text()


def test_tuning_left_to_slurm_goes_on_round_by_round(tmp_path, text_file, capsys):
    """Slurm without --wait (submitit's local executor: background tasks): the command
    submits the tuning round and returns; --status lists the tuning runs and the reported
    ones still pending, --report refuses while tuning is unfinished; run again once the
    round is done, it scores it and submits the reported runs at the chosen rate; run
    again, it writes the report."""
    recipe = tiny_recipe(text_file, variants=["rope"], seeds=[0], tune={"lr": [1e-3, 3e-3], "seeds": [7], "extend": 0})
    out = tmp_path / "cmp"
    opts = LaunchOptions(launcher="slurm", executor="local")
    msgs = []
    assert run_comparison(recipe, out, progress=False, log=msgs.append, launch=opts) == {}
    assert any("2 tuning runs are still with other processes or Slurm tasks" in m for m in msgs)
    names = [r["name"] for r in comparison_status(out)]
    assert names == ["tune/rope/lr0.001-s7", "tune/rope/lr0.003-s7", "rope-s0"]
    code = main(["compare", str(out / "recipe.json"), "--out", str(out), "--report", "--quiet"])
    assert_one_line(code, capsys.readouterr().err, "tuning has not finished")
    _wait_for(lambda: all(r["state"] == "done" for r in comparison_status(out)[:2]))
    assert run_comparison(recipe, out, progress=False, log=None, launch=opts) == {}
    _wait_for(lambda: comparison_status(out)[2]["state"] == "done")
    s = run_comparison(recipe, out, progress=False, log=None, launch=opts)
    chosen = s["tuning"]["rope"]["chosen"]["lr"]
    assert json.loads((out / "runs" / "rope-s0" / "config.json").read_text())["train"]["lr"] == chosen
    clean = run_comparison(recipe, tmp_path / "clean", progress=False, log=None)
    assert s["tuning"] == clean["tuning"]
    assert records(out / "runs" / "rope-s0") == records(tmp_path / "clean" / "runs" / "rope-s0")
