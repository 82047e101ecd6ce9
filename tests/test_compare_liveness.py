"""Comparisons whose processes die or are signalled (issue 38, items 2, 3, 5, 6): a run
whose process on this host is gone is failed at once, also when its pid was given to
another process (the start time recorded with it tells them apart), and a rerun resumes
it; a run another live process holds is refused (exit 2, one line naming it), not left
to it with exit 0; SIGINT (also where a script's shell started the command with SIGINT
ignored) and SIGTERM to the parent of ``--launcher local`` stop the workers, leave every
run resumable (stopped, never running) and exit 130 / 143; ``--report`` / ``--status``
without a recipe read the folder's own; ``--launcher slurm`` without srun writes nothing."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_one_line, run_cli, write_corpus
from test_compare import TINY_TRAIN, tiny_recipe

from phaseloop.compare import comparison_status, main_runs, plan_variants
from phaseloop.compare.grid import process_identity, run_state, write_state

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = """
[train]
steps = {steps}
batch_size = 2
seq_len = 16
lr = 0.003
warmup_steps = 1
eval_every = 20
eval_windows = 2
ckpt_every = 10
log_every = 10
"""


def _recipe(root: Path, seeds: str, tune: str = "", steps: int = 100) -> Path:
    text = write_corpus(root / "corpus.txt")
    path = root / "r.toml"
    path.write_text(f'name = "t"\ndata = "{text}"\nscale = "tiny"\nseeds = {seeds}\nvariants = ["rope"]\n'
                    + TRAIN.format(steps=steps) + tune)
    return path


def _start(*argv, ignore_sigint=False) -> subprocess.Popen:
    """``phaseloop ARGV`` as its own process (a script's background job: SIGINT ignored)."""
    pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    return subprocess.Popen([sys.executable, "-m", "phaseloop", *map(str, argv)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=pre,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for(cond, p: subprocess.Popen, timeout=240.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.05)
    raise AssertionError("timed out")


def _step(run_dir: Path) -> int:
    try:
        return max(json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1])
    except (OSError, ValueError):
        return 0


def _state(out: Path, name: str) -> dict:
    try:
        return json.loads((out / "launch" / f"{name}.state.json").read_text())
    except (OSError, ValueError):
        return {}


def test_a_dead_or_reused_pid_is_failed_at_once(tmp_path):
    recipe = tiny_recipe("stdlib", variants=["rope"], seeds=[0], train=dict(TINY_TRAIN, steps=10))
    spec = main_runs(recipe, plan_variants(recipe, 256), tmp_path, {})[0]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_state(spec, "running", pid=gone.pid)  # fresh heartbeat, dead process
    state = run_state(spec)
    assert state["state"] == "failed" and f"pid {gone.pid} on {socket.gethostname()} is gone" in state["detail"]
    write_state(spec, "running")  # this process: alive
    assert run_state(spec)["state"] == "running"
    info = json.loads(spec.state_path.read_text())
    assert info["start"] == process_identity(os.getpid())["start"]
    for reused in ({**info, "start": info["start"] - 1}, {**info, "boot": "another-boot"}):
        spec.state_path.write_text(json.dumps(reused))  # the pid now belongs to another process
        assert run_state(spec)["state"] == "failed"
    legacy = {k: v for k, v in info.items() if k not in ("start", "boot")}  # no identity: the heartbeat decides
    spec.state_path.write_text(json.dumps(legacy))
    assert run_state(spec)["state"] == "running"
    spec.state_path.write_text(json.dumps({**info, "host": "elsewhere", "pid": gone.pid}))
    assert run_state(spec)["state"] == "running"  # another host: its heartbeat is fresh


def test_a_killed_comparison_resumes_at_once_and_a_live_one_is_refused(tmp_path, capsys):
    recipe = _recipe(tmp_path, "[0]", '[tune]\nlr = [0.001, 0.003]\nseeds = [7]\nextend = 0\n')
    out = tmp_path / "cmp"
    p = _start("compare", recipe, "--out", out, "--quiet")
    first = "tune/rope/lr0.001-s7"
    try:
        _wait_for(lambda: _state(out, first).get("pid") == p.pid and _step(out / "tune" / "rope" / "lr0.001-s7") >= 20,
                  p)
        # the same command while it trains: refused, naming the process, nothing trained twice
        code, err = run_cli(["compare", recipe, "--out", out, "--quiet"], capsys)
        assert_one_line(code, err, f"being trained by another live process: {first} (pid {p.pid} on ")
        assert p.poll() is None
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert _state(out, first)["state"] == "running"  # what the killed process last said
    code, err = run_cli(["compare", "--out", out, "--status"], capsys)  # no recipe: the folder's own
    assert code == 0
    row = next(r for r in comparison_status(out) if r["name"] == first)
    assert row["state"] == "failed" and "is gone" in row["detail"] and 20 <= row["step"] < 100
    # a rerun resumes at once and finishes, report included
    code, err = run_cli(["compare", recipe, "--out", out, "--quiet"], capsys)
    assert code == 0, err
    assert (out / "report.md").exists()
    assert [r["state"] for r in comparison_status(out)] == ["done"] * 3
    # --report without a recipe reports the comparison the folder holds (not the built-in quick one)
    (out / "summary.json").unlink()
    code, err = run_cli(["compare", "--out", out, "--report", "--quiet"], capsys)
    assert code == 0, err
    assert json.loads((out / "summary.json").read_text())["variants"][0]["finished_seeds"] == [0]
    code, err = run_cli(["compare", "--out", tmp_path / "none", "--report"], capsys)
    assert_one_line(code, err, "holds no comparison (no recipe.json)")
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"])
def test_a_signal_to_the_local_launchers_parent_stops_its_workers(tmp_path, capsys, sig, status):
    """SIGINT while the workers train, the parent started as a script's background job
    (SIGINT ignored); SIGTERM at once, while the workers may still be starting (before
    their own handler): either way every worker is gone, no run says running, exit 130 /
    143, and (SIGINT) the same command resumes them to the end."""
    # 600 steps: on a loaded machine the second worker may start late, and both must still
    # be training when the first has logged its tenth step
    recipe = _recipe(tmp_path, "[0, 1]", steps=600)
    out = tmp_path / "cmp"
    p = _start("compare", recipe, "--out", out, "--quiet", "--launcher", "local", "--jobs", "2",
               ignore_sigint=sig == signal.SIGINT)
    names = ["rope-s0", "rope-s1"]
    try:
        if sig == signal.SIGINT:
            _wait_for(lambda: all(_step(out / "runs" / n) >= 10 and "pid" in _state(out, n) for n in names), p)
        else:
            _wait_for(lambda: all(_state(out, n).get("state") == "running" for n in names), p)
        workers = [_state(out, n)["pid"] for n in names]
        os.kill(p.pid, sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == status, err
    lines = [x for x in err.strip().splitlines() if not x.startswith("rope-s")]  # the launcher's notes
    assert len(lines) == 1 and lines[0].startswith("phaseloop: ") and "Traceback" not in err, err
    assert all(not process_identity(pid) for pid in workers)  # every worker stopped
    assert all(_state(out, n)["state"] == "stopped" for n in names)
    rows = comparison_status(out)
    assert [r["state"] for r in rows] == ["pending", "pending"] and all(r["detail"] == "stopped" for r in rows)
    if sig == signal.SIGINT:
        code, err = run_cli(["compare", recipe, "--out", out, "--quiet"], capsys)
        assert code == 0, err
        assert [r["state"] for r in comparison_status(out)] == ["done", "done"]


def test_slurm_without_srun_writes_nothing(tmp_path, monkeypatch, capsys):
    pytest.importorskip("submitit")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    monkeypatch.setenv("PATH", str(bin_))  # no srun here
    recipe = _recipe(tmp_path, "[0]")
    code, err = run_cli(["compare", recipe, "--out", tmp_path / "x", "--launcher", "slurm", "--quiet"], capsys)
    assert_one_line(code, err, "srun not found")
    assert not (tmp_path / "x").exists()
