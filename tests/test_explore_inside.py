"""explore's Inside page (issue 26) on tiny trained runs: every /api/inside endpoint against
phaseloop.analysis.probe (the generation against phaseloop.inference.generate, issue 39) and the
loaded model (bad input -> 400 with the message), and the page in a real headless Chromium (type
a prompt, read the per-token loss, move the sliders, generate with an exit rule)."""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("starlette")

from conftest import tiny_run
from explore_fixtures import external_urls, screenshot
from starlette.testclient import TestClient

from phaseloop.analysis import probe
from phaseloop.decoding import sampling_probs
from phaseloop.early_exit import parse_exit
from phaseloop.engine.checkpoint import load_run
from phaseloop.explore.app import create_app
from phaseloop.explore.context import ServerContext
from phaseloop.inference import Options, generate

PROMPT = "the quick brown fox"
PAGE_PROMPT = "The quick brown fox jumps over the lazy dog."  # the page's default
PHASES = ["--set", "n_phases=2", "--set", "phase_rotation=true", "--set", "phase_norm=true", "--set", "horn=true"]
RUNS = {  # name -> extra train arguments (after TINY's rope-tiny)
    "rope": [],
    "act": ["--preset", "universal-act-tiny"],
    "3pt": ["--preset", "3pt-tiny"],
    "hyper3pt": ["--preset", "hyperloop-tiny", *PHASES],  # Hyperloop with the phase structure
}


EXTRA = ["docs", "act_halts"]  # a run trained with documents; the act run with halting that varies


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The root folder holding one tiny trained run per kind (4 steps each); "docs": rope-tiny
    trained with --doc-mask --doc-positions on short JSONL records (several documents a
    window); "act_halts": the act run with a halting unit whose probabilities differ
    widely between positions (so positions halt at different steps)."""
    import json
    import shutil

    from phaseloop.engine.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("inside")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHASELOOP_CACHE", str(root / "cache"))
        for name, extra in RUNS.items():
            (root / name).mkdir()
            tiny_run(root / name, 4, 2, *extra)
        (root / "docs").mkdir()
        records = root / "docs" / "records.jsonl"
        records.write_text("".join(json.dumps({"text": f"record {i}: " + "the lazy dog " * (i % 4 + 1)}) + "\n"
                                   for i in range(400)))
        tiny_run(root / "docs", 4, 2, "--doc-mask", "--doc-positions", "--data", str(records))
    shutil.copytree(root / "act", root / "act_halts")
    run = root / "act_halts" / "run"
    model, run_cfg = load_run(run)
    with torch.no_grad():
        model.trunk.halting.weight.copy_(torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(0)))
        model.trunk.halting.bias.zero_()
    save_checkpoint(run, model, step=4, config=json.loads((run / "config.json").read_text()))
    return root


@pytest.fixture(scope="module")
def client(served):
    return TestClient(create_app(ServerContext.from_paths([served])))


@pytest.fixture(scope="module")
def q(served):
    root = served.name

    def make(name, **kw):
        return {"root": root, "path": f"{name}/run", "prompt": PROMPT, **kw}
    return make


def test_runs_listed(client, served):
    runs = client.get("/api/inside/runs").json()["runs"]
    assert sorted(r["path"] for r in runs) == sorted(f"{n}/run" for n in [*RUNS, *EXTRA])


@pytest.mark.parametrize("name", list(RUNS))
def test_analyze_is_the_model_s_own_loss(client, served, q, name):
    a = client.get("/api/inside/analyze", params=q(name)).json()
    model, _ = load_run(served / name / "run")
    ids = torch.tensor(list(PROMPT.encode()))
    with torch.no_grad():
        out = model(ids[None, :-1], targets_BT=ids[None, 1:])
    assert a["mean_loss"] == pytest.approx(out.ce_loss.item(), rel=1e-5)
    assert a["tokens"] == list(PROMPT) and len(a["loss"]) == len(PROMPT) - 1
    assert len(a["attention_sites"]) >= 1 and a["heads"] == model.cfg.n_heads
    assert (a["ponder"] is not None) == (name == "act")
    assert ("angles" in a) == ("stripes" in a) == (name in ("3pt", "hyper3pt"))  # 3PT's own (ArchSpec.probe)
    assert (a["mixing"] is not None) == (name == "hyper3pt")
    assert a["dynamic_depth"] == (name in ("act", "hyper3pt"))


def test_ponder_map_is_act_s(client, served, q):
    a = client.get("/api/inside/analyze", params=q("act")).json()
    model, _ = load_run(served / "act" / "run")
    with torch.no_grad():
        out = model(torch.tensor([list(PROMPT.encode())]))
    assert a["ponder"] == pytest.approx(out.stats["ponder_time"][0].tolist())
    assert torch.allclose(torch.tensor(a["halting"]), out.stats["halting_probs"][:, 0])


def test_halted_steps_are_marked_from_the_model_s_own_count(client, served, q):
    """``halted`` [steps, T]: True from the step after a position halted (its weight is 0),
    from the ACT loop's own count of the steps each position used."""
    a = client.get("/api/inside/analyze", params=q("act_halts")).json()
    model, _ = load_run(served / "act_halts" / "run")
    with torch.no_grad():
        used = model(torch.tensor([list(PROMPT.encode())])).stats["exit_passes"][0].tolist()
    assert a["halted"] == [[t >= n for n in used] for t in range(len(a["halting"]))]
    flat = [h for row in a["halted"] for h in row]
    assert any(flat) and not all(flat), used  # positions halt at different steps here
    assert client.get("/api/inside/analyze", params=q("rope")).json()["halted"] is None


def test_a_document_run_s_window_is_read_as_it_trained(client, served, q):
    """A --doc-mask --doc-positions run: a validation window gets the document ids and
    positions its evaluation gets (``lm.train.eval_set``), so the loss is the run's own
    evaluation loss of that window and no attention weight crosses a document."""
    from phaseloop.engine.checkpoint import run_corpus
    from phaseloop.lm.train import eval_set

    run = served / "docs" / "run"
    params = {**q("docs"), "prompt": "", "window": 0}
    a = client.get("/api/inside/analyze", params=params).json()
    model, cfg = load_run(run)
    corpus = run_corpus(run, cfg)
    _, val = corpus.split(cfg["train"]["val_fraction"], 64)
    windows, docs = eval_set(corpus, val, 63, 8, cfg["train"])  # 63: the page's windows hold max_seq_len tokens
    x, y = windows[:1, :-1], windows[:1, 1:]
    with torch.no_grad():
        own = model(x, targets_BT=y, **{k: v[:1] for k, v in docs.items()}).ce_loss.item()
        plain = model(x, targets_BT=y).ce_loss.item()
    assert a["tokens"] == [chr(i) for i in windows[0].tolist()] and len(set(a["doc_ids"])) > 1
    assert a["doc_ids"][:63] == docs["doc_ids_BT"][0].tolist()
    assert a["positions"][:63] == docs["positions_BT"][0].tolist()
    assert a["mean_loss"] == pytest.approx(own, rel=1e-5) and a["mean_loss"] != pytest.approx(plain, rel=1e-3)
    w = torch.tensor(client.get("/api/inside/attention", params={**params, "site": 1}).json()["weights"])
    doc = torch.tensor(a["doc_ids"])
    assert w[doc[:, None] != doc[None, :]].abs().max() == 0


def test_three_phase_internals_on_a_hyperloop(client, served, q):
    """3PT on a Hyperloop trunk: stripes after the begin block, each loop's streams and the end block."""
    a = client.get("/api/inside/analyze", params=q("hyper3pt")).json()
    sites = [r["site"] for r in a["stripes"]]
    assert sites == ["embedding", "begin.0", "hc.0", "hc.1", "end.0"]  # 1 + 2 loops + 1
    assert a["stripes"][0]["dc"] == pytest.approx([1 / (t + 1) for t in range(len(PROMPT))], abs=1e-5)
    assert len(a["angles"]["theta"]) == 4 and len(a["mixing"]) == 2
    assert len(a["mixing"][0]["pre"]) == len(PROMPT) and len(a["mixing"][0]["pre"][0]) == 4


def test_attention_next_token_and_depth(client, served, q):
    a = client.get("/api/inside/analyze", params=q("act")).json()
    r = client.get("/api/inside/attention", params=q("act", site=1, head=2)).json()
    assert r["site"] == a["attention_sites"][1] == "block.attn pass 2"
    w = torch.tensor(r["weights"])
    assert torch.allclose(w.sum(-1), torch.ones(len(PROMPT)), atol=1e-5) and w.triu(1).abs().max() == 0
    model, _ = load_run(served / "act" / "run")
    with torch.no_grad():
        logits = model(torch.tensor([list(PROMPT.encode())])).logits[0, 5]
    n = client.get("/api/inside/next", params=q("act", pos=5, temperature=0.7, top_k=3)).json()
    p = sampling_probs(logits[None], 0.7, 3)[0]
    assert [t["id"] for t in n["tokens"][:3]] == torch.topk(p, 3).indices.tolist()
    assert [t["p"] for t in n["tokens"][:3]] == pytest.approx(torch.topk(p, 3).values.tolist(), rel=1e-5)
    assert sum(t["p"] for t in n["tokens"]) == pytest.approx(1.0) and n["actual"] == PROMPT[6]
    d = client.get("/api/inside/depth", params=q("act", max_depth=3)).json()["rows"]
    assert [r["depth"] for r in d] == [1, 2, 3]
    assert d == probe.loss_vs_depth(model, torch.tensor(list(PROMPT.encode())), [1, 2, 3])


def test_validation_window(client, q, monkeypatch):
    from phaseloop.explore import inside

    reads, real = [], inside.run_corpus
    monkeypatch.setattr(inside, "run_corpus", lambda *a, **k: reads.append(a) or real(*a, **k))
    a = client.get("/api/inside/analyze", params={**q("rope"), "prompt": "", "window": 1}).json()
    b = client.get("/api/inside/analyze", params={**q("rope"), "prompt": "", "window": 2}).json()
    assert a["n_tokens"] == b["n_tokens"] == 64  # max_seq_len of rope-tiny
    assert a["tokens"] != b["tokens"] and len(reads) <= 1  # the corpus read once for the run


@pytest.mark.parametrize("name,extra", [
    ("act", {}), ("hyper3pt", {"exit": "state:0.5", "kv_fill": "latest"}),
    ("hyper3pt", {"speculative": 1, "max_new_tokens": 9}), ("act", {"exit": "act:0.5", "kv_share": 1}),
])
def test_generation_is_the_library_s(client, served, q, name, extra):
    g = client.get("/api/inside/generate", params=q(name, **extra)).json()
    model, _ = load_run(served / name / "run")
    opts = {"max_new_tokens": 24, **extra, **({"exit": parse_exit(extra["exit"])[0]} if "exit" in extra else {})}
    want = generate(model, torch.tensor([list(PROMPT.encode())]), Options(**opts))
    assert g["ids"] == want.tokens[0].tolist() and g["passes"] == pytest.approx(want.passes)
    assert g["prompt"] == list(PROMPT) and len(g["tokens"]) == len(g["ids"]) and g["depth"] == model.trunk.passes
    assert g["kv_cache_bytes"] == want.kv_cache_bytes and (g["acceptance"] is None) == ("speculative" not in extra)


@pytest.mark.parametrize("url,over,message", [
    ("/api/inside/analyze", dict(root="nope"), "unknown folder 'nope'"),
    ("/api/inside/analyze", dict(path="../rope/run"), "without '..'"),
    ("/api/inside/analyze", dict(path="rope"), "is not a run folder"),
    ("/api/inside/analyze", dict(prompt="x" * 65), "longer than this model's max_seq_len 64"),
    ("/api/inside/analyze", dict(prompt=""), "the prompt is empty"),
    ("/api/inside/analyze", dict(window=8), "window must be between 0 and 7"),
    ("/api/inside/next", dict(temperature=0), "temperature must be between"),
    ("/api/inside/next", dict(temperature=-1), "temperature must be between"),
    ("/api/inside/next", dict(temperature="nan"), "temperature must be a number"),
    ("/api/inside/next", dict(top_k=0), "top_k must be between 1 and 256"),
    ("/api/inside/next", dict(top_k=257), "top_k must be between 1 and 256"),
    ("/api/inside/next", dict(pos=len(PROMPT)), "pos must be between"),
    ("/api/inside/attention", dict(head=99), "head must be between"),
    ("/api/inside/attention", dict(site=-1), "site must be between"),
    ("/api/inside/depth", dict(), "fixed depth"),
    ("/api/inside/generate", dict(path="act/run", exit="foo:1"), "unknown exit rule"),
    ("/api/inside/generate", dict(exit="kl:1"), "stack of distinct layers"),
    ("/api/inside/generate", dict(path="act/run", exit="act:0.5,0.6"), "give one value"),
    ("/api/inside/generate", dict(kv_fill="bogus"), "kv_fill 'bogus': choose recompute or latest"),
    ("/api/inside/generate", dict(path="act/run", kv_fill="latest"), "kv_fill latest applies to the pass rules"),
    ("/api/inside/generate", dict(path="act/run", max_new_tokens=65), "max_new_tokens must be between 1 and 64"),
    ("/api/inside/generate", dict(path="hyper3pt/run", speculative=9), "the draft runs 1 .. 1 passes"),
    ("/api/inside/depth", dict(path="act/run", max_depth=17), "max_depth must be between 1 and 16"),
])
def test_inside_bad_input_is_a_400_with_the_message(client, q, url, over, message):
    r = client.get(url, params={**q("rope"), **over})
    assert r.status_code == 400 and message in r.json()["error"], r.text
    assert "--" not in r.json()["error"]  # the query's field names, not the CLI's flags


def test_model_cache_is_bounded(served):
    ctx = ServerContext.from_paths([served])
    client = TestClient(create_app(ctx))
    for name in RUNS:
        assert client.get("/api/inside/analyze", params={"root": served.name, "path": f"{name}/run",
                                                          "prompt": PROMPT}).status_code == 200
    assert len(ctx._models) == ctx.model_cache_size == 2


# ---------------------------------------------------------------------------- browser
def _wait(driver, cond, timeout=60):
    deadline = time.time() + timeout
    while True:
        try:
            if cond():
                return
        except Exception:  # not drawn yet
            pass
        if time.time() > deadline:
            raise AssertionError(f"timed out; page error: {driver.find_element('id', 'error').text!r}")
        time.sleep(0.2)


def test_inside_page_in_a_browser(served, client, q, explore_server, browser):
    from selenium.webdriver.common.keys import Keys

    base = explore_server([served])
    browser.get(f"{base}/inside?root={served.name}&path=act/run")
    _wait(browser, lambda: browser.find_element("id", "model-info").get_attribute("data-done") == PAGE_PROMPT)
    box = browser.find_element("id", "prompt")
    box.clear()
    box.send_keys("hello world, hello")
    browser.find_element("id", "go").click()
    want = client.get("/api/inside/analyze", params=q("act", prompt="hello world, hello")).json()
    _wait(browser, lambda: browser.find_element("id", "model-info").get_attribute("data-done") == "hello world, hello")
    assert browser.find_element("id", "n-tokens").text == str(len(want["tokens"]))
    assert float(browser.find_element("id", "mean-loss").text) == pytest.approx(want["mean_loss"], abs=1e-4)
    spans = browser.find_elements("css selector", "#tokens .tok")
    assert [float(s.get_attribute("data-value")) for s in spans[1:]] == pytest.approx(want["loss"], abs=1e-5)
    assert browser.find_element("id", "ponder-section").is_displayed()
    assert "p per step" in browser.find_elements("css selector", "#ponder .tok")[3].get_attribute("title")
    assert browser.execute_script("return document.getElementById('depth-chart').data.length") == 1
    assert browser.find_elements("css selector", ".modebar") and external_urls(browser) == []

    def top_p():
        return float(browser.find_element("css selector", "#next-table tbody tr td.p").text)

    before = top_p()
    want_1 = client.get("/api/inside/next", params=q("act", prompt="hello world, hello")).json()
    assert before == pytest.approx(want_1["tokens"][0]["p"], abs=1e-4)
    slider = browser.find_element("id", "temp")
    for _ in range(12):  # temperature 1.0 -> 0.4 (step 0.05): a sharper distribution
        slider.send_keys(Keys.ARROW_LEFT)
    _wait(browser, lambda: browser.find_element("id", "temp-val").text == "0.4")
    want_p = client.get("/api/inside/next", params=q("act", prompt="hello world, hello", temperature=0.4)).json()
    _wait(browser, lambda: top_p() == pytest.approx(want_p["tokens"][0]["p"], abs=1e-4))
    assert top_p() > before
    browser.execute_script("window.scrollTo(0, 0)")
    screenshot(browser, "inside_act")
    browser.execute_script("document.getElementById('attn-chart').scrollIntoView()")
    screenshot(browser, "inside_attention_next_token")
    browser.get(f"{base}/inside?root={served.name}&path=act_halts/run")  # grey (gaps) where halted
    _wait(browser, lambda: browser.find_element("id", "model-info").get_attribute("data-done") == PAGE_PROMPT)
    api_a = client.get("/api/inside/analyze", params={**q("act_halts"), "prompt": PAGE_PROMPT}).json()
    z = browser.execute_script("return document.getElementById('halting-chart').data[0].z")
    assert z == [[None if h else pytest.approx(p) for p, h in zip(row, hrow)]
                 for row, hrow in zip(api_a["halting"], api_a["halted"])]
    assert any(v is None for row in z for v in row)
    for name, section in (("3pt", "phase-section"), ("hyper3pt", "mix-section")):
        browser.get(f"{base}/inside?root={served.name}&path={name}/run")
        _wait(browser, lambda: browser.find_element("id", "model-info").get_attribute("data-done") == PAGE_PROMPT)
        assert browser.execute_script("return document.getElementById('dc-chart').data.length") == 1
        assert browser.find_element("id", section).is_displayed()
        assert external_urls(browser) == []
        browser.execute_script(f"document.getElementById('{section}').scrollIntoView()")
        screenshot(browser, f"inside_{name}")


def test_generation_in_a_browser(served, client, q, explore_server, browser):
    """Each generated token's passes, as the endpoint computed them, drawn on the page."""
    base = explore_server([served])
    browser.get(f"{base}/inside?root={served.name}&path=act/run")
    _wait(browser, lambda: browser.find_element("id", "model-info").get_attribute("data-done") == PAGE_PROMPT)
    assert browser.find_element("id", "gen-section").is_displayed()
    browser.find_element("id", "gen-exit").send_keys("act:0.8")
    temp = browser.find_element("id", "gen-temp")
    temp.clear()
    temp.send_keys("1")
    browser.find_element("id", "gen-go").click()
    want = client.get("/api/inside/generate", params={"root": served.name, "path": "act/run", "temperature": 1,
                                                       "prompt": PAGE_PROMPT, "exit": "act:0.8"}).json()
    assert len(set(want["passes"])) > 1  # tokens that halted after different steps
    figures = browser.find_element("id", "gen-figures")
    _wait(browser, lambda: figures.get_attribute("data-done") == "".join(want["tokens"]))
    spans = browser.find_elements("css selector", "#gen-tokens .tok")
    assert [float(s.get_attribute("data-value")) for s in spans] == pytest.approx(want["passes"])
    assert f"mean {want['mean_passes']:.2f} of {want['depth']} passes" in browser.find_element("id", "gen-figures").text
    assert browser.execute_script("return document.getElementById('gen-chart').data[0].y.length") == len(want["passes"])
    browser.execute_script("document.getElementById('gen-section').scrollIntoView()")
    screenshot(browser, "inside_generation")


def test_a_newer_checkpoint_is_loaded_again(served):
    """Models are cached by their checkpoint's files: a run still training shows its latest."""
    import os

    ctx = ServerContext.from_paths([served])
    client = TestClient(create_app(ctx))
    params = {"root": served.name, "path": "rope/run", "prompt": PROMPT}
    first = client.get("/api/inside/analyze", params=params).json()
    weights = served / "rope" / "run" / "checkpoint" / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        assert client.get("/api/inside/analyze", params=params).json() == first
        assert len(ctx._models) == 2 and len({k[:2] for k in ctx._models}) == 1
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
