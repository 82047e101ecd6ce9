"""`phaseloop explore` as a command (started as a subprocess, stopped with Ctrl-C) and
``phaseloop.explore.show`` for notebooks (issue 26)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import assert_one_line, run_cli

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

SRC = str(Path(__file__).resolve().parents[1] / "src")


def start(*args, env=None):
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "phaseloop", "explore", "--no-browser", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def read_url(proc, timeout=120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if "http://" in line:
            return line.split()[2]
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read()}")
    raise AssertionError("no URL printed")


def fetch(url, timeout=60) -> bytes:
    """GET ``url``, retrying while the server (URL printed just before it listens) starts."""
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                assert r.status == 200
                return r.read()
        except urllib.error.URLError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)


def test_serves_then_ctrl_c_stops_cleanly(tmp_path):
    (tmp_path / "run").mkdir()
    proc = start(str(tmp_path / "run"), "--port", "0")
    try:
        url = read_url(proc)
        assert url.startswith("http://127.0.0.1:")
        assert b"phaseloop explore" in fetch(url)
        assert b'"steps_needed": 9' in fetch(url + "api/learn/parity?length=400")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "stopped" in err


def test_a_taken_port_gives_a_free_one():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        proc = start("--port", str(taken))
        try:
            url = read_url(proc)
            assert not url.endswith(f":{taken}/")
            assert b"phaseloop explore" in fetch(url)  # it serves on the port it printed
        finally:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_bad_arguments_are_one_line(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    assert_one_line(*run_cli(["explore", tmp_path / "file.txt", "--no-browser"], capsys), "is not a folder")
    assert_one_line(*run_cli(["explore", tmp_path / "missing", "--no-browser"], capsys), "is not a folder")
    assert_one_line(*run_cli(["explore", "--port", "70000"], capsys), "--port")


def test_missing_extra_is_one_line(tmp_path):
    """Without starlette (hidden by a module that fails to import) the command says which
    extra to install."""
    (tmp_path / "starlette").mkdir()
    (tmp_path / "starlette" / "__init__.py").write_text("raise ImportError('hidden', name='starlette')")
    proc = subprocess.run([sys.executable, "-m", "phaseloop", "explore", "--no-browser"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{SRC}"})
    assert_one_line(proc.returncode, proc.stderr.strip(), "pip install 'phaseloop[explore]'")


def test_show_serves_in_the_background_and_needs_ipython(tmp_path, monkeypatch):
    from phaseloop.errors import PhaseloopError
    from phaseloop.explore import notebook, show

    (tmp_path / "run").mkdir()
    try:
        url = notebook.serve_background([tmp_path / "run"])
        assert notebook.serve_background([tmp_path / "run"]) == url  # reused
        with urllib.request.urlopen(url + "/learn/ut/act", timeout=30) as r:
            assert r.status == 200
        monkeypatch.setitem(sys.modules, "IPython", None)  # not installed
        monkeypatch.setitem(sys.modules, "IPython.display", None)
        with pytest.raises(PhaseloopError, match="needs IPython"):
            show(tmp_path / "run", page="/learn/ut/act")
        with pytest.raises(PhaseloopError, match="page must be a path"):
            show(tmp_path / "run", page="http://example.com/")
        monkeypatch.undo()

        class IFrame:  # IPython's IFrame keeps src, width, height
            def __init__(self, src, width, height):
                self.src, self.width, self.height = src, width, height

        fake = type(sys)("IPython.display")
        fake.IFrame = IFrame
        monkeypatch.setitem(sys.modules, "IPython", type(sys)("IPython"))
        monkeypatch.setitem(sys.modules, "IPython.display", fake)
        frame = show(tmp_path / "run", page="/learn/ut/act", height=600)
        assert frame.src == url + "/learn/ut/act" and frame.height == 600
    finally:
        notebook.stop_all()
