"""Errors under torchrun (issue 24, class 1). torchrun itself always ends a failed job with
its ChildFailedError summary and exit status 1 (it has no way to pass a worker's status
on); phaseloop makes what it shows phaseloop's: its one line, printed once (rank 0, also
for argparse errors before the process group exists), and the elastic error file each
worker is given (TORCHELASTIC_ERROR_FILE) holding the line and the exit status, so the
summary's root cause reads ``exitcode : 2`` and ``traceback : phaseloop: error: ...``.
Two real torchrun runs (CPU, gloo), the rest in process with torchrun's variables set."""

import json
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

import phaseloop.cli as cli
from phaseloop.cli import main


def _torchrun(tmp_path, *argv):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "phaseloop", *map(str, argv)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def _check_torchrun_output(r, line):
    err = r.stderr
    assert r.returncode == 1, err[-2000:]  # torchrun's own status for any failed worker
    ours = [x for x in err.splitlines() if x.startswith("phaseloop: ")]
    assert ours == [line], err[-3000:]  # printed once, by rank 0
    assert "[rank0]:" not in err and "[rank1]:" not in err, err[-3000:]
    assert "phaseloop/" not in err.split("ChildFailedError")[0].replace("phaseloop/__main__", ""), err[-3000:]
    root = err.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2 " in root and f"traceback : {line}" in root, root


def test_bad_train_input_under_torchrun(tmp_path):
    (tmp_path / "c.txt").write_text("hello world\n" * 200)
    r = _torchrun(tmp_path, "train", "--preset", "rope-tiny", "--steps", "2", "--quiet", "--data", "c.txt",
                  "--out", "run", "--lr", "inf")
    _check_torchrun_output(r, "phaseloop: error: invalid train config: lr=inf: must be a finite number")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]  # nothing written


def test_an_argparse_error_under_torchrun_is_printed_once(tmp_path):
    r = _torchrun(tmp_path, "train", "--stepz", "3")
    _check_torchrun_output(r, "phaseloop: error: unrecognized arguments: --stepz 3 (see phaseloop --help)")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------- in process, as torchrun's worker
@pytest.fixture
def worker(tmp_path, monkeypatch):
    """This process as worker ``rank`` of a 2-process torchrun world, with its error file."""
    def as_rank(rank):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29999")
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error-{rank}.json"))
        monkeypatch.setattr(cli.exits, "PEER_EXIT_DELAY_S", 0.0)
        return tmp_path / f"error-{rank}.json"
    return as_rank


def _run(argv, capsys):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip()


BAD = [
    (["eval", "{tmp}/nosuch"], 2, "does not exist"),
    (["params", "--preset", "nope"], 2, "unknown preset"),
    (["eval", "{tmp}", "--windows", "zero"], 2, "invalid int value"),  # argparse
    (["nosuch-command"], 2, "invalid choice"),  # argparse
]


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("argv, status, words", BAD, ids=[" ".join(a[:2]) for a, _, _ in BAD])
def test_a_worker_prints_on_rank_0_only_and_tells_torchrun(worker, tmp_path, capsys, rank, argv, status,
                                                           words):
    error_file = worker(rank)
    code, err = _run([a.format(tmp=tmp_path) for a in argv], capsys)
    assert code == status
    if rank == 0:
        assert len(err.splitlines()) == 1 and err.startswith("phaseloop") and "error: " in err and words in err, err
    else:
        assert err == ""
    data = json.loads(error_file.read_text())
    assert data["message"]["errorCode"] == status and words in data["message"]["message"]
    failure = ProcessFailure(local_rank=rank, pid=1, exitcode=code, error_file=str(error_file))
    summary = ChildFailedError("phaseloop", {rank: failure}).format_msg()
    assert f"exitcode  : {status} " in summary and "traceback : phaseloop" in summary, summary
    assert sorted(p.name for p in tmp_path.iterdir()) == [error_file.name]  # nothing else written


def test_torchrun_copies_the_line_and_status_for_a_scheduler(worker, tmp_path, capsys, monkeypatch):
    """torchrun's own error file (a scheduler's) gets the root cause's line and status."""
    error_file = worker(0)
    code, _ = _run(["params", "--preset", "nope"], capsys)
    parent = tmp_path / "torchrun-error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(parent))
    ErrorHandler().dump_error_file(str(error_file), code)
    data = json.loads(parent.read_text())["message"]
    assert data["errorCode"] == 2 and data["message"].startswith("phaseloop: error: unknown preset")


def test_an_unwritable_error_file_still_ends_with_the_line(worker, tmp_path, capsys, monkeypatch):
    worker(0)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "no" / "such" / "error.json"))
    code, err = _run(["params", "--preset", "nope"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "unknown preset" in err


def test_without_torchrun_no_error_file_is_written(tmp_path, capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    code, err = _run(["params", "--preset", "nope"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_help_is_printed_once_per_world(worker, tmp_path, capsys, rank):
    error_file = worker(rank)
    with pytest.raises(SystemExit) as e:
        main(["archs", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and ("usage: phaseloop archs" in out) == (rank == 0)
    assert not error_file.exists()  # not a failure


@pytest.mark.parametrize("lag", [0.0, 0.4, 1.1, 2.9])
def test_rank_0_is_the_root_cause_when_it_fails_a_second_later(worker, tmp_path, capsys, monkeypatch, lag):
    """torchrun's root cause is the smallest timestamp (whole seconds) of the error files.
    Rank 1 meets the error first, at 1000.9 s; rank 0 ``lag`` seconds later (a loaded
    machine), before rank 1's wait ends, and torchrun then stops rank 1 (SIGTERM: -15).
    Rank 0's line and status must be the root cause, whichever second each wrote in."""
    import phaseloop.cli.exits as exits

    monkeypatch.setattr(exits, "PEER_EXIT_DELAY_S", 3.0)
    monkeypatch.setattr(exits.time, "sleep", lambda s: None)
    files = {}
    for rank, now in ((1, 1000.9), (0, 1000.9 + lag)):
        files[rank] = worker(rank)
        monkeypatch.setattr(exits, "PEER_EXIT_DELAY_S", 3.0)  # worker() set it to 0
        monkeypatch.setattr(exits.time, "time", lambda now=now: now)
        code, _ = _run(["params", "--preset", "nope"], capsys)
        assert code == 2
    # torchrun's order: rank 0 seen exiting first, rank 1 after it was stopped
    failures = {0: ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(files[0])),
                1: ProcessFailure(local_rank=1, pid=2, exitcode=-15, error_file=str(files[1]))}
    root_rank, root = ChildFailedError("phaseloop", failures).get_first_failure()
    assert root_rank == 0 and root.exitcode == 2
    assert root.message["message"].startswith("phaseloop: error: unknown preset")
