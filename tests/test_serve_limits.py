"""`phaseloop serve` under pressure and from the command line: a full queue is a 429 (the
`openai` client's RateLimitError), a request past its timeout a 408 (streamed: an error
event), a client that disconnects frees its row, and `phaseloop serve` itself starts,
answers and stops on SIGTERM, refusing bad flags in one line (exit 2)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from conftest import REPO, run_cli  # noqa: E402
from serve_fixtures import fake_run  # noqa: E402

from phaseloop.serve.loading import load  # noqa: E402
from phaseloop.serve.runner import Background, Config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
LONG = 3000  # tokens: seconds of decoding for a tiny model, so the request is still running


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return load(fake_run(tmp_path_factory.mktemp("limits"), "rope-tiny"))


def health(bg) -> dict:
    return httpx.get(f"{bg.url}/health").json()


def wait_for(cond, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def test_full_queue_is_429_and_the_rest_completes(served):
    cfg = Config(port=0, max_batch=1, max_queue=2, max_context=LONG + 16)
    with Background(served, cfg) as bg:
        client = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="x", max_retries=0)
        long = client.completions.create(model=served.name, prompt="the", max_tokens=LONG, temperature=0, stream=True)
        next(iter(long))  # it holds the one row
        results = []
        waiting = [threading.Thread(target=lambda: results.append(client.completions.create(
            model=served.name, prompt="the quick", max_tokens=4, temperature=0))) for _ in range(2)]
        for t in waiting:
            t.start()
        wait_for(lambda: health(bg)["queue"] == 2)
        with pytest.raises(openai.RateLimitError, match="queue holds 2 of 2"):
            client.completions.create(model=served.name, prompt="x", max_tokens=2)
        long.close()  # the client goes away: its row is freed, the queue drains
        for t in waiting:
            t.join(timeout=60)
        assert [r.choices[0].finish_reason for r in results] == ["length", "length"]
        wait_for(lambda: health(bg) == {"status": "ok", "queue": 0, "running": 0})


def test_timeout_is_408_plain_and_streamed(served):
    with Background(served, Config(port=0, timeout=0.4, max_context=LONG + 16)) as bg:
        client = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="x", max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError, match="timeout of 0.4 s") as e:
            client.completions.create(model=served.name, prompt="the", max_tokens=LONG)
        assert e.value.status_code == 408 and time.monotonic() - t0 < 5
        with httpx.stream("POST", f"{bg.url}/v1/completions", json={"prompt": "the", "max_tokens": LONG,
                                                                      "stream": True}, timeout=30) as r:
            frames = [line for line in r.iter_lines() if line]
        last = json.loads(frames[-1][len("data: "):])
        assert last["error"]["code"] == "timeout" and "[DONE]" not in frames[-1]
        wait_for(lambda: health(bg)["running"] == 0)


def test_disconnect_cancels_the_generation(served):
    with Background(served, Config(port=0, max_context=LONG + 16)) as bg:
        tokens = bg.server.metrics.generated_tokens
        with httpx.stream("POST", f"{bg.url}/v1/completions", json={"prompt": "the", "max_tokens": LONG,
                                                                      "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        wait_for(lambda: health(bg)["running"] == 0, 10)
        with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
            httpx.post(f"{bg.url}/v1/completions", json={"prompt": "the", "max_tokens": LONG}, timeout=0.5)
        wait_for(lambda: health(bg)["running"] == 0, 10)
        assert tokens._value.get() < LONG  # both stopped long before their max_tokens
        statuses = {s.labels["status"] for s in bg.server.metrics.requests.collect()[0].samples
                    if s.labels.get("route") == "completions"}
        assert "499" in statuses


@pytest.fixture
def run_dir(served):
    return served.path


def test_cli_serves_until_sigterm(run_dir, tmp_path):
    env = {**os.environ, "PHASELOOP_API_KEY": "k42", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "phaseloop", "serve", str(run_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("phaseloop serve: ") and "/v1" in line, (line, proc.stderr.read())
        url = line.split(" at ")[1].split("/v1")[0]
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from $PHASELOOP_API_KEY
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer k42"},
                       json={"prompt": "the", "max_tokens": 3, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143  # terminated, as every command (docs/reliability.md)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_refuses_bad_flags_in_one_line(run_dir, tmp_path, capsys):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    try:
        for argv, pattern in (
                ([tmp_path / "nope"], "does not exist"),
                ([run_dir, "--depth", "3"], "stack of distinct layers"),
                ([run_dir, "--exit", "kl:1e-2"], "cannot exit early"),
                ([run_dir, "--quantized", tmp_path / "q.safetensors"], "--quantized"),
                ([run_dir, "--chat-template", tmp_path / "t.jinja"], "--chat-template"),
                ([run_dir, "--port", str(taken.getsockname()[1])], "cannot listen on 127.0.0.1"),
                ([run_dir, "--port", "70000"], "out of range"),
                ([run_dir, "--api-key", " "], "--api-key is empty"),
                ([run_dir, "--max-batch", "0"], "out of range")):
            code, err = run_cli(["serve", *argv], capsys)
            assert code == 2 and len(err.splitlines()) == 1 and pattern in err, (argv, err)
    finally:
        taken.close()
