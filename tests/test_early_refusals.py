"""Refusals that used to come late or leave things behind (issue 24, class 8): every
input is checked before anything trains or is written, and what a killed command leaves
is removed by the next one. Each case: one line, its exit status, no traceback, nothing
on disk changed: a recipe's unknown ``eval_tasks``; ``babi --tasks 1,1``; ``lm-eval``
with a bad task, a missing or broken ``--include-path``, an evaluation that fails; the
temporary folder of an export killed midway; Ctrl-C while the command imports torch."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import assert_one_line, run_cli, snapshot, tiny_run

from phaseloop.cli import main


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    made = tiny_run(tmp_path_factory.mktemp("early"))
    (made["root"] / "afile").write_text("x")
    return made


@pytest.fixture
def own_tasks_only(monkeypatch):
    """lm-eval without its ~15k built-in tasks (indexing them takes 12-50 s): a name that
    is not a local or included task is then unknown at once, as it would be after them."""
    lm_tasks = pytest.importorskip("lm_eval.tasks")
    pytest.importorskip("transformers")
    real = lm_tasks.TaskManager

    class Own(real):
        def __init__(self, *a, **k):
            k["include_defaults"] = False
            super().__init__(*a, **k)
    monkeypatch.setattr(lm_tasks, "TaskManager", Own)


# ------------------------------------------------------------- compare: a recipe's eval_tasks
def _recipe(root, name, tasks):
    path = root / f"{name}.toml"
    path.write_text(f'name = "{name}"\ndata = "{root / "corpus.txt"}"\nscale = "tiny"\nseeds = [0]\n'
                    f'variants = ["rope"]\neval_tasks = {json.dumps(tasks)}\n[train]\nsteps = 2\n'
                    'batch_size = 2\neval_every = 2\neval_windows = 2\nckpt_every = 2\nwarmup_steps = 1\n')
    return path


@pytest.mark.parametrize("tasks, words", [
    (["nosuch_task_xyz"], "unknown lm-eval task 'nosuch_task_xyz'"),
    (["lambada_local", "nosuch_task_xyz"], "unknown lm-eval task 'nosuch_task_xyz'"),
])
def test_a_recipe_with_an_unknown_eval_task_is_refused_before_training(world, tmp_path, capsys, own_tasks_only,
                                                                      data_dir, tasks, words):
    recipe = _recipe(world["root"], "bad", tasks)
    before = snapshot(world["root"])
    code, err = run_cli(["compare", recipe, "--out", tmp_path / "c", "--quiet"], capsys)
    assert_one_line(code, err, words)
    assert not (tmp_path / "c").exists() and snapshot(world["root"]) == before


def test_a_recipe_whose_local_task_has_no_data_is_refused_before_training(world, tmp_path, capsys,
                                                                         own_tasks_only, monkeypatch):
    monkeypatch.setenv("PHASELOOP_DATA_DIR", str(tmp_path / "nodata"))
    recipe = _recipe(world["root"], "nodata", ["lambada_local"])
    code, err = run_cli(["compare", recipe, "--out", tmp_path / "c", "--quiet"], capsys)
    assert_one_line(code, err, "lambada/lambada_test.jsonl")
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------- babi: tasks named twice
@pytest.mark.parametrize("tasks, words", [
    ("1,1", "--tasks 1,1 names 1 twice"),
    ("1,2,1", "names 1 twice"),
    ("3,21", "bAbI task must be an integer 1..20, got 21"),
    ("0", "got 0"),
])
def test_babi_task_lists_are_refused_before_training(tmp_path, capsys, tasks, words):
    code, err = run_cli(["babi", "--tasks", tasks, "--steps", "2", "--out", tmp_path / "b", "--quiet"], capsys)
    assert_one_line(code, err, words)
    assert list(tmp_path.iterdir()) == []


def test_run_babi_seeds_refuses_repeated_seeds(tmp_path):
    from phaseloop.errors import ConfigError
    from phaseloop.tasks.babi_runner import run_babi_seeds

    with pytest.raises(ConfigError, match="--seeds 0,0 names 0 twice"):
        run_babi_seeds(None, tmp_path, [1], None, [0, 0], out_dir=tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------- lm-eval: nothing left in the run
def _lm_eval_case(world, capsys, argv, words):
    before = snapshot(world["root"])
    code, err = run_cli(["lm-eval", world["run"], *argv], capsys)
    assert_one_line(code, err, words)
    assert snapshot(world["root"]) == before and not (world["run"] / "lm_eval").exists()


def test_lm_eval_with_one_unknown_task_leaves_nothing(world, capsys, own_tasks_only, data_dir):
    _lm_eval_case(world, capsys, ["--tasks", "wikitext2_local,nosuch_task_xyz"],
                  "unknown lm-eval task 'nosuch_task_xyz'")


def test_lm_eval_missing_include_path(world, capsys, own_tasks_only):
    _lm_eval_case(world, capsys, ["--tasks", "t1", "--include-path", world["root"] / "nosuch"],
                  "nosuch does not exist")


def test_lm_eval_include_path_that_is_a_file(world, capsys, own_tasks_only):
    _lm_eval_case(world, capsys, ["--tasks", "t1", "--include-path", world["root"] / "afile"],
                  "is a file, not a folder")


@pytest.mark.parametrize("yaml_text, words", [
    ("task: t1\n  bad: [\n", "ScannerError"),
    ("task: t1\ndataset_path: [json\n", "ParserError"),
    ("- task: t1\n", "ValueError: Expected YAML dict from it, got list"),
], ids=["scanner", "parser", "a-list"])
def test_lm_eval_include_path_with_a_broken_yaml_says_so(world, tmp_path, capsys, own_tasks_only, yaml_text,
                                                        words):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "t1.yaml").write_text(yaml_text)
    _lm_eval_case(world, capsys, ["--tasks", "t1", "--include-path", inc],
                  f"{inc / 't1.yaml'} is not a task lm-eval can read ({words}")


def test_lm_eval_that_fails_while_evaluating_leaves_nothing(world, capsys, own_tasks_only, monkeypatch,
                                                           data_dir):
    import lm_eval

    from phaseloop.errors import PhaseloopError

    def fails(*a, **k):
        raise PhaseloopError("evaluation failed midway")
    monkeypatch.setattr(lm_eval, "simple_evaluate", fails)
    _lm_eval_case(world, capsys, ["--tasks", "wikitext2_local"], "evaluation failed midway")


# ------------------------------------------------------------- export: a killed export's folder
def test_the_next_export_removes_what_a_killed_one_left(world, tmp_path, capsys):
    pytest.importorskip("transformers")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that no longer runs
    orphans = [tmp_path / f".hf.tmp-{dead.pid}-abc", tmp_path / ".hf.tmp-x1y2z3"]  # today's, an older name
    live = tmp_path / f".hf.tmp-{os.getpid()}-def"  # an export still running here
    for p in (*orphans, live):
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"\0" * 4096)
    (tmp_path / ".other.tmp-1-x").mkdir()  # another export's target: not ours to remove
    assert main(["export", str(world["run"]), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", live.name, ".other.tmp-1-x"])


def test_export_killed_with_sigkill_then_exported_again(world, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    proc = subprocess.Popen([sys.executable, "-m", "phaseloop", "export", str(world["run"]), "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0, seen = time.time(), False
    while proc.poll() is None and time.time() - t0 < 120:
        if any(p.name.startswith(".hf.tmp-") for p in tmp_path.iterdir()):
            proc.kill()
            seen = True
            break
        time.sleep(0.001)
    proc.wait()
    if not seen:
        pytest.skip("the export finished before it could be killed mid-write")
    assert any(p.name.startswith(".hf.tmp-") for p in tmp_path.iterdir()) and not out.exists()
    assert main(["export", str(world["run"]), "--out", str(out)]) == 0  # the next export, in process
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


# ------------------------------------------------------------- Ctrl-C while torch imports
def _interrupt_at_start(cmd, delay, cwd):
    """SIGINT ``delay`` s after the startup handler is in place (the process says so through
    PHASELOOP_STARTUP_READY_FILE): a signal before Python reaches phaseloop at all is
    Python's own, which no code of ours can catch, and a loaded machine can delay that."""
    ready = Path(tempfile.mkdtemp()) / "ready"
    env = {**os.environ, "PHASELOOP_STARTUP_READY_FILE": str(ready)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    shutil.rmtree(ready.parent, ignore_errors=True)
    return proc.returncode, err


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_ctrl_c_while_python_m_phaseloop_starts(tmp_path, delay):
    code, err = _interrupt_at_start([sys.executable, "-m", "phaseloop", "params"], delay, tmp_path)
    if code == 0:
        pytest.skip("started before the signal came")
    assert code == 130 and err == "phaseloop: interrupted while starting; nothing was done\n", err
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_the_console_script_starts(tmp_path):
    script = tmp_path / "bin" / "phaseloop"  # as pip writes it
    script.parent.mkdir()
    script.write_text("import sys\nfrom phaseloop.cli import main\nsys.exit(main())\n")
    code, err = _interrupt_at_start([sys.executable, str(script), "params"], 0.1, tmp_path)
    if code == 0:
        pytest.skip("started before the signal came")
    assert code == 130 and err == "phaseloop: interrupted while starting; nothing was done\n", err


@pytest.mark.parametrize("ignored", [False, True])
def test_importing_phaseloop_as_a_library_leaves_ctrl_c_alone(ignored):
    """As it was before the import: Python's handler, or SIG_IGN where the program was
    started with SIGINT ignored (a background job of a script; CI run so once failed here)."""
    pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else (
        lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    r = subprocess.run([sys.executable, "-c", "import signal; before = signal.getsignal(signal.SIGINT); "
                        "import phaseloop; print(before == signal.SIG_IGN, before is signal.default_int_handler, "
                        "signal.getsignal(signal.SIGINT) == before)"],
                       capture_output=True, text=True, preexec_fn=pre)
    assert r.stdout.split() == [str(ignored), str(not ignored), "True"], r.stderr
