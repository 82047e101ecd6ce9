"""Crash tests: `phaseloop train` killed with SIGKILL at seeded random moments and resumed
(always with --resume, as a preemptible job's loop does) ends with the metrics and
weights of an uninterrupted run and no temporary files; Ctrl-C / SIGTERM end with one
line naming the checkpoint that is intact."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

TIMING = ("tok_per_s", "elapsed_s")


def _cmd(out, text, *extra):
    return [sys.executable, "-m", "phaseloop", "train", "--preset", "rope-tiny", "--steps", "30",
            "--batch-size", "2", "--eval-every", "10", "--eval-windows", "2", "--ckpt-every", "4",
            "--log-every", "1", "--warmup", "2", "--quiet", "--data", str(text), "--out", str(out),
            "--resume", *extra]


def _lines(out) -> int:
    p = out / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def _wait_for(proc, out, n, timeout=120.0) -> bool:
    """Wait until metrics.jsonl has ``n`` lines (True) or the process ended (False)."""
    t0 = time.time()
    while proc.poll() is None:
        if _lines(out) >= n:
            return True
        if time.time() - t0 > timeout:
            proc.kill()
            pytest.fail("training made no progress")
        time.sleep(0.005)
    return False


def _records(out):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _errors(stderr: str) -> str:
    """stderr without the notes printed before (e.g. "holds no run yet; starting it")."""
    return "\n".join(line for line in stderr.strip().splitlines() if not line.startswith("note: "))


def _leftovers(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))


# the last: training for depth (each step's depth drawn from 1..6 by seed and step) resumes as exactly
@pytest.mark.parametrize("seed, extra", [(0, ()), (1, ()),
                                         (2, ("--preset", "universal-tiny", "--depth-sample", "1:6"))])
def test_sigkill_at_random_moments_then_resume_is_exact(tmp_path, text_file, seed, extra):
    ref = tmp_path / "ref"
    subprocess.run(_cmd(ref, text_file, *extra), check=True, capture_output=True)
    out, rng, kills = tmp_path / "crash", random.Random(seed), 0
    for _ in range(4):
        proc = subprocess.Popen(_cmd(out, text_file, *extra), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if not _wait_for(proc, out, _lines(out) + rng.randint(1, 7)):
            break  # finished before the kill
        time.sleep(rng.uniform(0, 0.03))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    r = subprocess.run(_cmd(out, text_file, *extra), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert kills >= 2
    assert _records(out) == _records(ref)
    a, b = load_file(out / "checkpoint" / "model.safetensors"), load_file(ref / "checkpoint" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert _leftovers(out) == []


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_names_the_intact_checkpoint(tmp_path, text_file, sig, code):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, text_file), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert _wait_for(proc, out, 7)  # past the checkpoint of step 4
    proc.send_signal(sig)
    err = _errors(proc.communicate(timeout=60)[1])
    assert proc.returncode == code, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    step = json.loads((out / "checkpoint" / "trainer.json").read_text())["step"]
    assert f"the checkpoint of step {step} is intact" in err and "--resume" in err
    assert _leftovers(out) == []


def test_interrupt_before_the_first_checkpoint_says_so(tmp_path, text_file):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, text_file, "--ckpt-every", "1000"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert _wait_for(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    err = _errors(proc.communicate(timeout=60)[1])
    assert proc.returncode == 130 and "before the first checkpoint" in err, err
    assert not (out / "checkpoint").exists() and _leftovers(out) == []
    assert os.path.exists(out / "config.json")
