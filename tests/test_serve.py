"""`phaseloop serve` through real clients (issue 42): the `openai` package (plain and streamed
completions equal `phaseloop generate`, errors as its exception types), curl for the SSE
framing, httpx for every invalid field (a 400 naming it, never a 500), the API key, limits,
/metrics, a queue that fills (429), the timeout (408), a client that disconnects, and a
bounded load test on loopback (200 requests from 16 clients, 0 errors, every output the
prompt's output alone)."""

import json
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("prometheus_client")

from conftest import write_corpus  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_cli import TINY_TRAIN  # noqa: E402

from phaseloop.cli import main  # noqa: E402
from phaseloop.serve.loading import load  # noqa: E402
from phaseloop.serve.runner import Background, Config, warnings  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
KEY = "test-key-42"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    assert main(["train", *TINY_TRAIN, "--data", str(write_corpus(d / "corpus.txt")), "--out", str(d / "run")]) == 0
    return d / "run"


@pytest.fixture(scope="module")
def server(run):
    with Background(load(run), Config(port=0, api_key=KEY, max_batch=8, max_queue=64, timeout=60)) as bg:
        yield bg


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30)


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers["Content-Type"] = "application/json"  # json.dumps writes NaN as clients may
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), headers=headers, timeout=30, **kw)


def generated(capsys, run, prompt, *flags):
    """The text `phaseloop generate` adds to ``prompt``."""
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", prompt, *flags]) == 0
    out = capsys.readouterr().out[:-1]
    assert out.startswith(prompt)
    return out[len(prompt):]


def test_openai_completions_equal_generate(client, run, capsys):
    name = client.models.list().data[0].id
    assert name == run.name
    for prompt in ("the quick", "over the lazy dog. "):
        want = generated(capsys, run, prompt, "--temperature", "0", "--max-new-tokens", "20")
        got = client.completions.create(model=name, prompt=prompt, max_tokens=20, temperature=0)
        assert got.choices[0].text == want and got.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == 20 and got.usage.prompt_tokens == len(prompt.encode())
        parts = list(client.completions.create(model=name, prompt=prompt, max_tokens=20, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in parts) == want
        assert parts[-1].choices[0].finish_reason == "length"
    # sampled: choice 0 draws as `phaseloop generate --seed`; ids as a prompt; n choices
    want = generated(capsys, run, "the", "--temperature", "0.8", "--top-k", "40", "--seed", "3",
                     "--max-new-tokens", "16")
    got = client.completions.create(model=name, prompt=list(b"the"), max_tokens=16, temperature=0.8, seed=3, n=3,
                                    extra_body={"top_k": 40})
    assert [c.index for c in got.choices] == [0, 1, 2] and got.choices[0].text == want
    again = client.completions.create(model=name, prompt="the", max_tokens=16, temperature=0.8, seed=3, n=3,
                                      extra_body={"top_k": 40})
    assert [c.text for c in again.choices] == [c.text for c in got.choices]  # seeded: reproducible


def test_echo_logprobs_stop_and_several_prompts(client, server):
    name = server.server.served.name
    got = client.completions.create(model=name, prompt=["the quick", "jumps"], max_tokens=1, temperature=0,
                                    echo=True, logprobs=2)
    assert [c.index for c in got.choices] == [0, 1]
    for c, prompt in zip(got.choices, ["the quick", "jumps"]):
        lp = c.logprobs
        assert c.text.startswith(prompt) and len(lp.tokens) == len(prompt) + 1 == len(lp.token_logprobs)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:])
        assert all(max(t.values()) >= v - 1e-9 for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
        assert max(lp.top_logprobs[-1].values()) == lp.token_logprobs[-1]  # greedy: the top token
    full = client.completions.create(model=name, prompt="the quick", max_tokens=30, temperature=0).choices[0].text
    stop = full[5:7]
    cut = client.completions.create(model=name, prompt="the quick", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=name, prompt="the quick", max_tokens=30, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_errors_are_the_openai_exception_types(client, server):
    name = server.server.served.name
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=name, prompt="x", temperature=5)
    with pytest.raises(openai.BadRequestError, match="stack of distinct layers"):
        client.completions.create(model=name, prompt="x", extra_body={"phaseloop": {"depth": 3}})
    with pytest.raises(openai.BadRequestError, match="maximum context is 64 tokens"):
        client.completions.create(model=name, prompt="x" * 60, max_tokens=10)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


BAD = [({}, "prompt"), ({"prompt": 3}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [[1, 2], 3]}, "prompt"),
       ({"prompt": [1, 999]}, "prompt"), ({"prompt": [True]}, "prompt"),
       ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
       ({"prompt": "x", "max_tokens": "9"}, "max_tokens"), ({"prompt": "x", "max_tokens": 1e9}, "max_tokens"),
       ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "n": 99}, "n"), ({"prompt": "x", "stop": ["a"] * 5}, "stop"),
       ({"prompt": "x", "stop": [""]}, "stop"), ({"prompt": "x", "logprobs": 99}, "logprobs"),
       ({"prompt": "x", "top_p": 0}, "top_p"), ({"prompt": "x", "top_k": "a"}, "top_k"),
       ({"prompt": "x", "temperature": float("nan")}, "temperature"), ({"prompt": "x", "seed": -1}, "seed"),
       ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": "x", "stream_options": {"include_usage": True}},
                                                       "stream_options"),
       ({"prompt": "x", "echo": 1}, "echo"), ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
       ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": "x", "best_of": 3}, "best_of"),
       ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"), ({"prompt": "x", "model": 5}, "model"),
       ({"prompt": "x", "user": 5}, "user"), ({"prompt": "x", "user": {"a": 1}}, "user"),  # taken before
       ({"prompt": "x", "presence_penalty": False}, "presence_penalty"),  # false == 0: taken as neutral before
       ({"prompt": "x", "phaseloop": "deep"}, "phaseloop"),
       ({"prompt": "x", "phaseloop": {"depth": 0}}, "phaseloop.depth"),
       ({"prompt": "x", "phaseloop": {"depth": 2}}, "phaseloop.depth"),
       ({"prompt": "x", "phaseloop": {"exit": "kl:x"}}, "phaseloop.exit"),
       ({"prompt": "x", "phaseloop": {"exit": "kl:1e-2"}}, "phaseloop.exit"),
       ({"prompt": "x", "phaseloop": {"extend_loops": "first"}}, "phaseloop.extend_loops"),
       ({"prompt": "x", "phaseloop": {"kv_share": 2}}, "phaseloop.kv_share"),
       ({"prompt": "x", "phaseloop": {"speculative": 2}}, "phaseloop.speculative"),
       ({"prompt": "x", "phaseloop": {"nope": 1}}, "phaseloop.nope")]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_every_invalid_field_is_a_400_naming_it(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, err


def test_null_is_the_default(server):
    """OpenAI's client sends a parameter set to None as null: each optional field then takes
    its default (temperature: null was a 500 from inside the decode loop)."""
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "n", "logprobs", "stop", "echo")}
    got = post(server, "/v1/completions", {"prompt": "the", "seed": 7, **nulls})
    want = post(server, "/v1/completions", {"prompt": "the", "seed": 7, "max_tokens": 16, "temperature": 1.0, "n": 1})
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["choices"] == want.json()["choices"] and got.json()["usage"]["completion_tokens"] == 16


def test_a_failing_first_token_is_a_500_and_the_server_goes_on(server, monkeypatch):
    """An exception while a sequence is admitted (prefill, first token) ends it with a 500
    at once (it was in no group and no queue: before, the client waited forever)."""
    engine = server.server.engine

    def broken(*a, **k):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    monkeypatch.setattr(engine, "_pick", broken)
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert r.status_code == 500 and time.monotonic() - t0 < 30, r.text
    monkeypatch.undo()
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3}).status_code == 200


def test_temperature_and_top_p_below_float_precision_are_their_limits(server):
    """A temperature whose logits / T overflow samples the argmax (the T -> 0 limit), and a
    top_p that rounds to 0 keeps the most probable token: both are greedy decoding."""
    greedy = post(server, "/v1/completions", {"prompt": "the ", "max_tokens": 6, "temperature": 0}).json()
    for extra in ({"temperature": 1e-45}, {"temperature": 1.0, "top_p": 1e-320}):
        r = post(server, "/v1/completions", {"prompt": "the ", "max_tokens": 6, "seed": 3, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy["choices"][0]["text"], r.text


def test_bodies_routes_and_key(server):
    for raw, status in ((b"{not json", 400), (b"[1, 2]", 400), (b"\xff\xfe", 400),
                        (b'{"prompt": "\\ud800abc"}', 400), (b"[" * 200_000, 400),  # a lone surrogate; deep
                        (json.dumps({"prompt": "x" * 2_000_000}).encode(), 413)):
        r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == status and "message" in r.json()["error"], r.text
    chat_bad = post(server, "/v1/chat/completions", {"messages": "hi"})
    assert chat_bad.status_code == 400  # no template: said before the messages are read
    assert httpx.get(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}).status_code == 405
    assert httpx.get(f"{server.url}/nowhere").json()["error"]["message"].startswith("GET /nowhere")
    for path in ("/v1/models", "/metrics", f"/v1/models/{server.server.served.name}"):
        assert httpx.get(f"{server.url}{path}").status_code == 401
        assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert post(server, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"  # no key needed


def test_requests_name_no_path_the_server_opens(server, run):
    """Path-like fields are compared or refused, never opened: no file is opened by the
    server's threads while they answer them (an audit hook sees every open)."""
    opened, watching = [], threading.Event()

    def hook(event, args):
        if watching.is_set() and event == "open" and threading.current_thread().name.startswith("phaseloop-serve"):
            opened.append(args[0])

    sys.addaudithook(hook)
    watching.set()
    try:
        for body in ({"prompt": str(run / "config.json"), "max_tokens": 2}, {"prompt": "x", "model": str(run)},
                     {"prompt": "x", "phaseloop": {"exit": "/etc/passwd"}}, {"prompt": "x", "user": "../../x"}):
            assert post(server, "/v1/completions", body).status_code in (200, 400, 404)
    finally:
        watching.clear()
    assert opened == []


def test_curl_sse_framing(server):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"prompt": "the quick", "max_tokens": 4, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    out = subprocess.run([curl, "-sN", "-i", f"{server.url}/v1/completions", "-H", f"Authorization: Bearer {KEY}",
                          "-H", "Content-Type: application/json", "-d", body], capture_output=True, timeout=30).stdout
    head, _, events = out.partition(b"\r\n\r\n")
    assert b" 200 " in head.splitlines()[0] and b"content-type: text/event-stream" in head.lower()
    frames = events.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    chunks = [json.loads(f[len(b"data: "):]) for f in frames[:-2]]
    assert all(f.startswith(b"data: ") and b"\n" not in f for f in frames[:-1])
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_metrics_are_prometheus_text(server, client):
    client.completions.create(model=server.server.served.name, prompt="the", max_tokens=3, temperature=0)
    post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})  # no template: 400
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"phaseloop_requests", "phaseloop_prompt_tokens", "phaseloop_generation_tokens", "phaseloop_queue_length",
            "phaseloop_running_sequences", "phaseloop_request_latency_seconds", "phaseloop_batch_rows"} <= set(fams)
    ok = [s for s in fams["phaseloop_requests"].samples if s.labels == {"route": "completions", "status": "200"}]
    assert ok and ok[0].value >= 1
    # each route its own label (a chat request was counted as "completions", its path's last part)
    assert any(s.labels == {"route": "chat", "status": "400"} for s in fams["phaseloop_requests"].samples)
    assert any(s.name.endswith("_bucket") for s in fams["phaseloop_request_latency_seconds"].samples)
    assert [s.value for s in fams["phaseloop_generation_tokens"].samples if s.name.endswith("_total")][0] >= 3


def test_load_200_requests_16_clients_no_errors_same_outputs(server):
    """Bounded: 200 requests x 8 tokens on loopback; each output is its prompt's output alone."""
    prompts = ["the quick", "brown", "over the lazy dog.", "fox jumps", "t", "lazy dog. the quick brown fox"]
    alone = {p: post(server, "/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0}).json()
             ["choices"][0]["text"] for p in prompts}
    before = server.server.metrics.batch_rows.collect()[0].samples

    def one(i):
        p = prompts[i % len(prompts)]
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        return p, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(200)))
    assert time.monotonic() - t0 < 120
    assert [r for r in results if r[1] != 200] == []
    assert all(text == alone[p] for p, _, text in results)
    after = server.server.metrics.batch_rows.collect()[0].samples
    count = {s.name: s.value for s in after}
    steps = count["phaseloop_batch_rows_count"] - {s.name: s.value for s in before}["phaseloop_batch_rows_count"]
    assert steps < 200 * 7  # decode steps were shared by several rows


def test_non_loopback_warns():
    assert warnings(Config(host="127.0.0.1")) == [] and warnings(Config(host="localhost")) == []
    w = warnings(Config(host="0.0.0.0"))
    assert len(w) == 1 and "reachable from other machines" in w[0] and "without --api-key" in w[0]
    assert "needs the API key" in warnings(Config(host="192.0.2.1", api_key="k"))[0]
