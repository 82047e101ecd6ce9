"""`phaseloop serve` with issue 39's adaptive depth and issue 40's packed weights per
request / at start: `kv_share` K served greedy = `phaseloop generate --kv-share K`, alone
and inside a batch with other settings; `speculative` D (+ `draft_tokens`) served greedy =
full-depth greedy = `generate --speculative D`, its acceptance in `usage` equal to
`generate --json`'s, streamed too, timed out and cancelled as any request; stacks and
impossible combinations refused with a 400 naming the option; `--quantized FILE` served
packed = `generate --quantized FILE`, its `weight_bytes` on /v1/models, a damaged or
foreign file refused in one line."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from conftest import run_cli  # noqa: E402
from serve_fixtures import fake_run  # noqa: E402

from phaseloop.cli import main  # noqa: E402
from phaseloop.serve.loading import load  # noqa: E402
from phaseloop.serve.runner import Background, Config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TIED = ["looped-tiny", "universal-tiny", "hyperloop-tiny", "universal-act-tiny"]
PROMPTS = ["the quick", "over the lazy dog. the", "j"]
LONG = 3000
# another depth each weight-tied preset takes (as test_serve_models.OPTIONS); trained passes: looped and
# hyperloop 2, universal 4, universal-act 6
DEPTH = {"looped-tiny": {"depth": 3}, "universal-tiny": {"depth": 2},
         "hyperloop-tiny": {"depth": 3, "extend_loops": "last"}, "universal-act-tiny": {"depth": 4}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    return {p: fake_run(root, p) for p in [*TIED, "rope-tiny", "3pt-tiny", "mhc-tiny"]}


def generate_json(capsys, run, prompt, *flags, n=12) -> dict:
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", str(n),
                 "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def complete(bg, prompt, options=None, max_tokens=12, **body) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body,
            **({"phaseloop": options} if options else {})}
    r = httpx.post(f"{bg.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("preset", TIED)
def test_kv_share_equals_generate_alone_and_in_a_batch(runs, preset, capsys):
    run = runs[preset]
    want = {(p, k): generate_json(capsys, run, p, *(["--kv-share", str(k)] if k else []))["text"]
            for p in PROMPTS for k in (None, 1, 2)}
    assert any(want[p, 1] != want[p, None] for p in PROMPTS), "K=1 must change some output to test anything"
    with Background(load(run), Config(port=0, max_batch=16)) as bg:
        alone = {(p, k): complete(bg, p, {"kv_share": k} if k else None)["choices"][0]["text"] for p, k in want}
        assert alone == want
        jobs = [*want] * 2 + [(p, "depth") for p in PROMPTS]  # with plain rows and another setting in flight
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda j: complete(bg, j[0], {"kv_share": j[1]} if isinstance(j[1], int) else
                                                   DEPTH[preset] if j[1] else None)["choices"][0]["text"], jobs))
        assert got[:2 * len(want)] == [want[j] for j in jobs[:2 * len(want)]]


@pytest.mark.parametrize("preset", TIED)
def test_speculative_equals_full_depth_greedy_with_its_acceptance(runs, preset, capsys):
    run = runs[preset]
    served = load(run)
    drafts = [(1, 4), (served.model.trunk.passes - 1, 3)]  # (D, draft_tokens); looped, hyperloop: D 1 twice
    with Background(served, Config(port=0, max_batch=8)) as bg:
        client = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="x", max_retries=0, timeout=60)
        jobs = [(p, d, k) for p in PROMPTS for d, k in drafts]
        want = {p: generate_json(capsys, run, p)["text"] for p in PROMPTS}
        spec = {j: generate_json(capsys, run, j[0], "--speculative", str(j[1]), "--draft-tokens", str(j[2]))
                for j in jobs}

        def served(job):
            p, d, k = job
            return client.completions.create(model=run.name, prompt=p, max_tokens=12, temperature=0,
                                             extra_body={"phaseloop": {"speculative": d, "draft_tokens": k}})

        with ThreadPoolExecutor(len(jobs) + len(PROMPTS)) as pool:  # among plain rows in flight
            plain = pool.map(lambda p: complete(bg, p)["choices"][0]["text"], PROMPTS)
            got = list(pool.map(served, jobs))
        assert list(plain) == [want[p] for p in PROMPTS]
        for job, out in zip(jobs, got):
            assert out.choices[0].text == want[job[0]] == spec[job]["text"], job
            st = out.usage.model_extra["phaseloop"]["speculative"]
            assert st["acceptance"] == pytest.approx(spec[job]["acceptance"]) and st["rounds"] == spec[job]["rounds"]
            assert (st["draft_passes"], st["draft_tokens"]) == job[1:] and 0 <= st["accepted"] <= st["drafted"]
        parts = list(client.completions.create(model=run.name, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"phaseloop": {"speculative": 1}}))
        assert "".join(c.choices[0].text for c in parts if c.choices) == want[PROMPTS[0]]
        assert parts[-1].usage.model_extra["phaseloop"]["speculative"]["rounds"] > 0
        lp = complete(bg, PROMPTS[1], {"speculative": 1}, logprobs=2, echo=True)["choices"][0]["logprobs"]
        ref = complete(bg, PROMPTS[1], None, logprobs=2, echo=True)["choices"][0]["logprobs"]
        assert lp["tokens"] == ref["tokens"]
        assert lp["token_logprobs"][1:] == pytest.approx(ref["token_logprobs"][1:], abs=1e-5)
        # at a request's depth: verified at that depth, drafted at D of its passes
        for p in PROMPTS:
            assert complete(bg, p, {**DEPTH[preset], "speculative": 1})["choices"][0]["text"] == complete(
                bg, p, DEPTH[preset])["choices"][0]["text"]


def test_speculative_sampled_choice_0_equals_generate_seed(runs, capsys):
    run = runs["looped-tiny"]
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "the", "--temperature", "0.8", "--top-k", "40", "--seed", "3",
                 "--max-new-tokens", "12", "--speculative", "1", "--json"]) == 0
    want = json.loads(capsys.readouterr().out)["text"]
    with Background(load(run), Config(port=0)) as bg:
        got = complete(bg, "the", {"speculative": 1}, temperature=0.8, top_k=40, seed=3, n=2)["choices"]
        assert got[0]["text"] == want
        assert complete(bg, "the", {"speculative": 1}, temperature=0.8, top_k=40, seed=3)["choices"][0]["text"] == want


REFUSED = [("rope-tiny", {"kv_share": 1}, "phaseloop.kv_share", "cannot share its KV cache"),
           ("3pt-tiny", {"kv_share": 2}, "phaseloop.kv_share", "cannot share its KV cache"),
           ("mhc-tiny", {"kv_share": 1}, "phaseloop.kv_share", "cannot share its KV cache"),
           ("rope-tiny", {"speculative": 1}, "phaseloop.speculative", "cannot draft itself"),
           ("3pt-tiny", {"speculative": 1}, "phaseloop.speculative", "cannot draft itself"),
           ("mhc-tiny", {"speculative": 1}, "phaseloop.speculative", "cannot draft itself"),
           ("looped-tiny", {"speculative": 2}, "phaseloop.speculative", "the draft runs 1 .. 1 passes"),
           ("universal-tiny", {"depth": 2, "speculative": 2}, "phaseloop.speculative", "the draft runs 1 .. 1"),
           ("looped-tiny", {"speculative": 1, "exit": "kl:1e-2"}, "phaseloop.speculative", "drop exit"),
           ("looped-tiny", {"draft_tokens": 3}, "phaseloop.draft_tokens", "applies with speculative"),
           ("looped-tiny", {"speculative": 1, "draft_tokens": 0}, "phaseloop.draft_tokens", "1 .. 64"),
           ("looped-tiny", {"kv_share": 0}, "phaseloop.kv_share", "1 .. "),
           ("looped-tiny", {"kv_share": True}, "phaseloop.kv_share", "1 .. ")]


@pytest.mark.parametrize("preset,options,param,pattern", REFUSED, ids=[f"{r[0]}-{r[2]}" for r in REFUSED])
def test_refusals_are_400s_naming_the_option(runs, preset, options, param, pattern):
    with Background(load(runs[preset]), Config(port=0)) as bg:
        client = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=pattern) as e:
            client.completions.create(model=runs[preset].name, prompt="x", max_tokens=2,
                                      extra_body={"phaseloop": options})
        err = e.value.body
        assert err["param"] == param and err["type"] == "invalid_request_error" and "\n" not in err["message"]
        assert "--" not in err["message"], err  # the body field's names, not the CLI's flags


def test_speculative_times_out_and_cancels_like_any_request(runs):
    run = runs["looped-tiny"]
    options = {"phaseloop": {"speculative": 1}}
    with Background(load(run), Config(port=0, timeout=0.4, max_context=LONG + 16)) as bg:
        r = httpx.post(f"{bg.url}/v1/completions", json={"prompt": "the", "max_tokens": LONG, **options}, timeout=30)
        assert r.status_code == 408 and r.json()["error"]["code"] == "timeout"
    with Background(load(run), Config(port=0, max_context=LONG + 16)) as bg:
        with httpx.stream("POST", f"{bg.url}/v1/completions", json={"prompt": "the", "max_tokens": LONG,
                                                                      "stream": True, **options}, timeout=30) as r:
            assert next(r.iter_lines()).startswith("data: ")
        deadline = time.monotonic() + 10
        while httpx.get(f"{bg.url}/health").json()["running"]:
            assert time.monotonic() < deadline, "the speculative sequence kept running after its client left"
            time.sleep(0.02)
        assert bg.server.metrics.generated_tokens._value.get() < LONG


def test_quantized_serves_packed_equal_to_generate_quantized(runs, text_file, capsys, tmp_path):
    for preset in ("rope-tiny", "looped-tiny"):
        run = runs[preset]
        assert main(["quantize", str(run), "--bits", "4", "--group-size", "32", "--windows", "2", "--data",
                     str(text_file)]) == 0
        qfile = run / "quant-w4-g32-rtn.safetensors"
        want = [generate_json(capsys, run, p, "--quantized", str(qfile)) for p in PROMPTS]
        with Background(load(run, quantized=str(qfile)), Config(port=0, max_batch=8)) as bg:
            card = httpx.get(f"{bg.url}/v1/models").json()["data"][0]["phaseloop"]
            assert card["quantized"]["file"] == qfile.name and card["quantized"]["packed"]
            assert card["weight_bytes"] == want[0]["weight_bytes"] < card["weight_bytes_fp32"] / 2
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                got = list(pool.map(lambda p: complete(bg, p)["choices"][0]["text"], PROMPTS))
            assert got == [w["text"] for w in want]
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(qfile.read_bytes()[:100])
    for argv, pattern in (([runs["looped-tiny"], "--quantized", runs["rope-tiny"] / qfile.name], "another model"),
                          ([runs["looped-tiny"], "--quantized", damaged], "is damaged"),
                          ([runs["looped-tiny"], "--quantized", qfile, "--dtype", "bfloat16"], "drop --dtype")):
        code, err = run_cli(["serve", *map(str, argv)], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and pattern in err, (argv, err)
