"""torchrun on CPU (gloo): 2 processes reproduce 1 at the same global batch, for DDP and
FSDP2 and every kind of trunk (weight-shared ones included, ACT's data-dependent depth
too); a checkpoint of a 2-process run resumes in 1 process with the same data order; a
killed rank ends the run with exit status != 0 and the last checkpoint intact."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from phaseloop.engine.checkpoint import verify_checkpoint

TIMING = ("tok_per_s", "elapsed_s")


def _train(out, text, batch, *extra, nproc=1, steps=6):
    cmd = ["-m", "phaseloop", "train", "--steps", str(steps), "--eval-every", "3", "--eval-windows", "4",
           "--ckpt-every", "3", "--log-every", "1", "--warmup", "2", "--quiet", "--data", str(text),
           "--batch-size", str(batch), "--out", str(out), *extra]
    if nproc > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [sys.executable, *cmd], env


def _run(*args, **kw):
    cmd, env = _train(*args, **kw)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _records(out):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_close(a, b, rtol=1e-5):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), (x, y)
        for k in x:
            if isinstance(x[k], float):
                assert abs(x[k] - y[k]) <= rtol * max(abs(x[k]), 1e-12), (k, x, y)
            else:
                assert x[k] == y[k], (k, x, y)


CASES = [("rope-tiny", "ddp"), ("3pt-tiny", "ddp"), ("universal-act-tiny", "ddp"), ("hyperloop-tiny", "ddp"),
         ("mhc-tiny", "ddp"), ("rope-tiny", "fsdp"), ("universal-act-tiny", "fsdp"), ("hyperloop-tiny", "fsdp")]


@pytest.mark.parametrize("preset, how", CASES, ids=[f"{p}-{h}" for p, h in CASES])
def test_two_processes_equal_one_at_the_same_global_batch(tmp_path, text_file, preset, how):
    one, two = tmp_path / "one", tmp_path / "two"
    _run(one, text_file, 4, "--preset", preset)
    _run(two, text_file, 2, "--preset", preset, "--parallel", how, nproc=2)
    _assert_close(_records(one), _records(two))
    cfg = json.loads((two / "config.json").read_text())
    assert cfg["parallel"] == {"world_size": 2} and cfg["train"]["parallel"] == how
    verify_checkpoint(two / "checkpoint")  # one consolidated checkpoint, rank 0's
    assert not any(p.name.startswith(".") for p in two.iterdir())
    r = subprocess.run([sys.executable, "-m", "phaseloop", "eval", str(two), "--json", "--windows", "4"],
                       capture_output=True, text=True)  # read back in one process
    assert r.returncode == 0, r.stderr
    val = json.loads(r.stdout)["val_loss"]
    assert abs(val - _records(two)[-1]["val_loss"]) <= 1e-5 * val


def test_ignored_targets_under_torchrun_equal_one_process(tmp_path, text_file):
    """--loss-ignore-id: each rank's micro-batch weighs by its counted targets over the
    world's (all-reduced), so 2 processes train on the loss one process computes."""
    one, two = tmp_path / "one", tmp_path / "two"
    ignore = ["--preset", "rope-tiny", "--loss-ignore-id", "32", "--seq-len", "16"]
    _run(one, text_file, 4, *ignore)
    _run(two, text_file, 2, *ignore, "--parallel", "ddp", nproc=2)
    _assert_close(_records(one), _records(two))


DEPTH_CASES = [("hyperloop-tiny", "ddp"), ("universal-act-tiny", "fsdp")]


@pytest.mark.parametrize("preset, how", DEPTH_CASES, ids=[f"{p}-{h}" for p, h in DEPTH_CASES])
def test_depth_sample_under_torchrun_equals_one_process(tmp_path, text_file, preset, how):
    """Training for depth: every rank draws the step's depth alike (a rank at another depth
    would change the averaged gradient), and a Hyperloop step at fewer passes than its loops
    leaves their parameters unused, which DDP is told to expect."""
    one, two = tmp_path / "one", tmp_path / "two"
    depth = ["--preset", preset, "--depth-sample", "1:2"]
    _run(one, text_file, 4, *depth)
    _run(two, text_file, 2, *depth, "--parallel", how, nproc=2)
    _assert_close(_records(one), _records(two))


def _wait_for_checkpoint(proc, out, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout and proc.poll() is None:
        if (out / "checkpoint" / "manifest.json").exists():
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("how", ["ddp", "fsdp"])
def test_a_two_process_checkpoint_resumes_in_one_process(tmp_path, text_file, how):
    ref, out = tmp_path / "ref", tmp_path / "run"
    _run(ref, text_file, 4, "--preset", "rope-tiny", steps=12)
    cmd, env = _train(out, text_file, 2, "--preset", "rope-tiny", "--parallel", how, nproc=2, steps=12)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert _wait_for_checkpoint(proc, out)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to its workers
    proc.communicate(timeout=120)
    step = json.loads((out / "checkpoint" / "trainer.json").read_text())["step"]
    assert step < 12 and not (out / "summary.json").exists()
    r = subprocess.run(_train(out, text_file, 2, "--preset", "rope-tiny", "--resume", steps=12)[0],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "global batch" in r.stderr and "--batch-size 4" in r.stderr, r.stderr
    _run(out, text_file, 4, "--preset", "rope-tiny", "--resume", steps=12)
    _assert_close(_records(ref), _records(out))
    assert json.loads((out / "summary.json").read_text())["step"] == 12


def test_a_two_process_checkpoint_resumes_in_four(tmp_path, text_file):
    """World 2 -> 4 at the same global batch (4 x 1): the uninterrupted run's records."""
    ref, out = tmp_path / "ref", tmp_path / "run"
    _run(ref, text_file, 4, "--preset", "rope-tiny", steps=9)
    cmd, env = _train(out, text_file, 2, "--preset", "rope-tiny", nproc=2, steps=9)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert _wait_for_checkpoint(proc, out)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert not (out / "summary.json").exists()
    _run(out, text_file, 1, "--preset", "rope-tiny", "--resume", nproc=4, steps=9)
    _assert_close(_records(ref), _records(out))


def test_a_killed_rank_ends_the_run_and_keeps_the_checkpoint(tmp_path, text_file):
    out = tmp_path / "run"
    cmd, env = _train(out, text_file, 2, "--preset", "rope-tiny", nproc=2, steps=400)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert _wait_for_checkpoint(proc, out)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[-1]), signal.SIGKILL)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode != 0
    # rank 0 meets the dead peer in a collective (exit 4), or torchrun's agent stops it with
    # SIGTERM first (a race the agent's monitor wins when rank 0 is computing): both say
    # which checkpoint is intact (docs/reliability.md, "Under torchrun")
    peer = "phaseloop: error: another process of this 2-process run failed"
    stopped = "phaseloop: terminated at step"
    assert (peer in err or stopped in err) and "is intact" in err, err[-3000:]
    assert "[rank0]: Traceback" not in err
    verify_checkpoint(out / "checkpoint")
    assert not (out / "summary.json").exists()


def test_compare_under_torchrun_equals_one_process(tmp_path, text_file):
    """Each (variant, seed) run on both processes, one after another (no threads)."""
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(f'name = "tiny"\ndata = "{text_file}"\nscale = "tiny"\nseeds = [0]\n'
                      'variants = ["rope", "universal+act"]\n[train]\nsteps = 4\nbatch_size = 4\n'
                      'eval_every = 2\neval_windows = 4\nckpt_every = 2\nlog_every = 1\nwarmup_steps = 1\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = ["-m", "phaseloop", "compare", str(recipe), "--quiet"]
    one = subprocess.run([sys.executable, *base, "--out", str(tmp_path / "one")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    two_recipe = tmp_path / "tiny2.toml"  # the same global batch over 2 processes
    two_recipe.write_text(recipe.read_text().replace("batch_size = 4", "batch_size = 2"))
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "phaseloop", "compare", str(two_recipe), "--quiet", "--out", str(tmp_path / "two")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("| rope |") == 1  # rank 0 reports, once
    for run in ("rope-s0", "universal+act-s0"):
        _assert_close(_records(tmp_path / "one" / "runs" / run), _records(tmp_path / "two" / "runs" / run))


def test_fsdp2_shards_on_the_runs_device_mesh(monkeypatch):
    """FSDP2 is given a mesh of the run's device: its default mesh is the machine's
    accelerator, which would move a `--device cpu` run's parameters onto a GPU its gloo
    group cannot reduce on. Checked in one process by standing in for a world of 2."""
    import torch
    import torch.distributed.device_mesh as dm
    import torch.distributed.fsdp as fsdp
    from conftest import tiny_model_config

    from phaseloop.engine import dist
    from phaseloop.models import build_model

    meshes, sharded = [], []
    monkeypatch.setattr(dist, "world", lambda: dist.World(0, 2, 0))
    monkeypatch.setattr(dist, "_MESHES", {})
    monkeypatch.setattr(dm, "init_device_mesh", lambda kind, shape: meshes.append((kind, shape)) or f"mesh:{kind}")
    monkeypatch.setattr(fsdp, "fully_shard", lambda m, mesh=None: sharded.append(mesh))
    model = build_model(tiny_model_config("rope"))
    assert dist.parallelize(model, "fsdp", torch.device("cpu")) is model
    assert meshes == [("cpu", (2,))]
    assert sharded == ["mesh:cpu"] * (len(dist.blocks_of(model)) + 1)  # every block, then the model
    dist.parallelize(build_model(tiny_model_config("rope")), "fsdp", torch.device("cpu"))
    assert meshes == [("cpu", (2,))]  # made once in a process group (a comparison's runs share it)
