"""explore's Learn pages (issue 26): every endpoint against the library's functions, bad
input answered with a message (never a 500), and the pages in a real headless Chromium."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("starlette")

import torch
from explore_fixtures import external_urls, screenshot
from starlette.testclient import TestClient

from phaseloop.analysis import accounting
from phaseloop.archs import act
from phaseloop.explore.app import create_app
from phaseloop.explore.context import ServerContext
from phaseloop.explore.learn import PAGES, endpoints
from phaseloop.tasks import parity_demo as pd


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app())


def get(client, path, **params):
    r = client.get(path, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_calculator_counts_equal_accounting_and_the_built_models(client):
    want = {"transformer-base": 63_084_544, "transformer-big": 214_249_472,
            "ut-small": 26_302_464, "ut-base": 67_284_992}
    for name, total in want.items():
        b = get(client, "/api/learn/accounting", preset=name)
        assert b["model"] == accounting.count(accounting.PRESETS[name])
        assert b["model"]["total"] == b["built"]["built_total"] == total
        assert b["presets"][name]["total"] == total
    assert b["match"]["d"] == 979 and round(b["match"]["d_exact"], 1) == 978.9
    ut = get(client, "/api/learn/accounting", preset="ut-base")
    assert ut["ratio"]["layer_matmul_flops"] == 4.0 and round(ut["ratio"]["flops"], 2) == 3.30
    assert round(ut["model"]["layer_matmul_flops_per_token"] / 1e9, 4) == 0.3523
    # free inputs: d_ff, heads, layers, vocabulary, sequence length
    b = get(client, "/api/learn/accounting", preset="transformer-base", d=256, d_ff=1000, heads=4,
            layers=3, vocab=1000, seq_len=64)
    spec = accounting.EncDecSpec("custom", 256, 4, 3, 3, steps=3, vocab_size=1000, ffn_dim=1000)
    assert b["model"] == accounting.count(spec, 64)
    assert b["built"]["built_total"] == b["model"]["total"]
    # an odd head dim: the published models take sinusoids, not RoPE, so it builds and counts
    odd = get(client, "/api/learn/accounting", preset="transformer-base", d=510, heads=170)
    assert odd["built"]["built_total"] == odd["model"]["total"] == accounting.count(
        accounting.EncDecSpec("custom", 510, 170, 6, 6, steps=6, ffn_dim=2040))["total"]
    shared = get(client, "/api/learn/accounting", preset="transformer-base", shared="true", layers=8)
    assert shared["model"]["total"] == 26_302_464 and shared["model"]["steps"] == 8


def test_calculator_equals_phaseloop_params(client, capsys):
    from phaseloop.cli import main

    for name in accounting.PRESETS:
        assert main(["params", "--preset", name, "--json"]) == 0
        assert get(client, "/api/learn/accounting", preset=name)["model"] == json.loads(capsys.readouterr().out)
    assert main(["params", "--match", "transformer-base", "--shared", "--json"]) == 0
    assert get(client, "/api/learn/accounting")["match"]["d"] == json.loads(capsys.readouterr().out)["d"]


@pytest.mark.parametrize("path,params,match", [
    ("/api/learn/accounting", {"d": "-1"}, "d must be between"),
    ("/api/learn/accounting", {"d": str(10**12)}, "d must be between"),
    ("/api/learn/accounting", {"d": "510"}, "heads must divide d"),
    ("/api/learn/accounting", {"preset": "gpt"}, "preset must be one of"),
    ("/api/learn/coordinates", {"d": "x"}, "d must be an integer"),
    ("/api/learn/parity", {"bits": "0120"}, "bits must be"),
    ("/api/learn/parity", {"bits": " "}, "bits must be 1 to 1024 characters"),  # said "length" before
    ("/api/learn/coordinates", {"t": "5000"}, r"t must be below span \(2048"),  # its "peak" was not the peak
    ("/api/learn/parity", {"length": "0"}, "length must be between"),
    ("/api/learn/act", {"p": "0.5, 2"}, r"\[0, 1\]"),
    ("/api/learn/act", {"p": "0.5, 0.2; 0.3"}, "same number of positions"),
    ("/api/learn/act", {"threshold": "nan"}, "threshold must be a number"),
    ("/api/learn/3pt/wheel", {"n": "100"}, "n must be between"),
    ("/api/learn/hyperloop/mixing", {"form": "full"}, "form must be one of"),
])
def test_bad_input_is_a_message_never_a_500(client, path, params, match):
    import re

    r = client.get(path, params=params)
    assert r.status_code == 400 and re.search(match, r.json()["error"]), r.text


def test_act_presets_match_the_explainer_and_phaseloop_act(client):
    b = get(client, "/api/learn/act", preset="init")
    assert b["steps_run"] == 2 and b["n_updates"] == [2.0] * 4
    assert round(b["p"][0][0], 4) == 0.7311 and round(b["remainders"][0], 4) == 0.2689
    assert round(b["ponder_cost"][0], 3) == 2.269
    assert [round(b["effective_weights"][k][0], 4) for k in range(2)] == [0.5344, 0.2689]
    assert round(b["effective_sum"][0], 4) == 0.8034
    s = act.halting_schedule(torch.tensor(b["p"], dtype=torch.float64))  # the same function
    assert b["update_weights"] == s.update_weights[:2].tolist()
    step1 = b["steps"][0]
    assert step1["still_running_before"] == [1.0] * 4 and step1["new_halted"] == [0.0] * 4
    assert b["steps"][1]["new_halted"] == [1.0] * 4
    c = get(client, "/api/learn/act", preset="certain")
    assert (c["n_updates"][0], c["remainders"][0], c["ponder_cost"][0]) == (1.0, 1.0, 2.0)
    h = get(client, "/api/learn/act", preset="hesitating")
    assert h["steps_run"] == 12 and h["remainders"] == [0.0] * 3 and h["ponder_cost"] == [12.0] * 3
    assert round(h["halting_probability"][0], 2) == 0.60
    assert math.isclose(h["effective_sum"][0], 1 - 0.95 ** 12, abs_tol=1e-12)
    typed = get(client, "/api/learn/act", p="0.3, 0.995\n0.5, 0.1\n0.4, 0.1", threshold="0.9")
    assert typed["n_updates"] == [3.0, 1.0] and round(typed["remainders"][0], 6) == 0.2
    lit = get(client, "/api/learn/act", preset="init", mode="t2t_literal")
    w = lit["update_weights"]
    assert math.isclose(lit["state_weights"][0][0], w[0][0] - w[0][0] - w[1][0], abs_tol=1e-12)


def test_parity_scan_is_parity_demo(client):
    for n, steps in ((40, 6), (400, 9)):
        b = get(client, "/api/learn/parity", length=n, seed=3)
        tr = pd.run_shared(pd.random_bits(n, 3))
        assert b["steps_needed"] == steps == tr.steps
        assert b["shared"]["states"] == tr.states and b["shared"]["exact_from"] == tr.exact_from
        assert b["shared"]["solved_exactly"]
    b = get(client, "/api/learn/parity", length=70, layers=6)
    assert b["max_length_fixed_stack"] == 64 and b["fixed_stack"]["first_failure"] == 65
    assert not b["no_step_signal"]["solved_exactly"]
    assert b["steps_needed_without_signal"] == pd.steps_needed_without_signal(70) == 127
    assert get(client, "/api/learn/parity", bits="1101")["target"] == [1, 0, 0, 1]


def test_coordinate_signal_numbers(client):
    b = get(client, "/api/learn/coordinates", d=512, t=10, span=400)
    assert round(b["one_norm"], 4) == 16.0 == b["one_norm_formula"]
    assert b["peak"]["t2t"]["i"] == 10 and round(b["peak"]["t2t"]["norm"], 3) == 32.0 == b["peak_formula"]
    assert round(b["far"]["paper"], 3) == 24.715 and round(b["far"]["t2t"], 3) == 24.834
    step = get(client, "/api/learn/coordinates", d=64, t=5, part="step", positions=3)["heatmap"]
    assert step[0] == step[2]
    from phaseloop.layers import timing_signal
    pos = get(client, "/api/learn/coordinates", d=8, t=0, part="position", positions=3)["heatmap"]
    assert torch.allclose(torch.tensor(pos, dtype=torch.float32), timing_signal(torch.arange(3), 8), atol=1e-4)


def test_schedules(client):
    b = get(client, "/api/learn/schedules", preset="mixed", depth=3)
    assert len(b["rnn"]) == b["positions"] == 6 and len(b["transformer"]) == 3
    assert b["ut_act_n_updates"] == [1, 2, 3, 4, 5, 9]
    assert b["ut_act"][1][0] == -2 and b["ut_act"][8][5] == 0


def test_three_phase_and_hyperloop(client):
    h = get(client, "/api/learn/3pt/horn", n=3, T=1024)
    assert round(h["zero_sum"], 4) == 0.0220 and math.isclose(h["zero_sum"], h["closed_form"], rel_tol=1e-12)
    assert math.isclose(h["r"][3], 0.25, rel_tol=1e-12)
    w = get(client, "/api/learn/3pt/wheel", n=3, theta=0.5)
    assert [round(a, 6) for a in w["offsets"]] == [0.0, round(2 * math.pi / 3, 6), round(4 * math.pi / 3, 6)]
    for a, (y0, y1) in zip(w["angles"], w["output"]):  # the pair (1, 0) rotated by theta + offset
        assert math.isclose(y0, math.cos(a), abs_tol=1e-12) and math.isclose(y1, math.sin(a), abs_tol=1e-12)
    c = get(client, "/api/learn/3pt/costs", preset="3pt-5.5m")
    extra = {r["modification"][:1]: r["extra"] for r in c["rows"]}
    assert extra["1"] == 0 and extra["3"] == 0 and extra["2"] == 4 * 192 // 3 // 2  # theta: d_phase/2 a layer
    lay = get(client, "/api/learn/hyperloop/layout", preset="hyperloop-135m")
    assert (lay["begin"], lay["middle"], lay["end"], lay["loops"], lay["depth"]) == (2, 4, 2, 3, 16)
    assert 135e6 <= lay["models"]["hyperloop-135m"]["without_input_embedding"] < 136e6
    m = get(client, "/api/learn/hyperloop/mixing", n=4, form="sinkhorn", alpha=0.01)
    res = torch.tensor(m["H_res"])
    assert torch.allclose(res.sum(-2), torch.ones(3, 4), atol=1e-6)  # Sinkhorn: columns sum to 1
    assert len(m["H_pre"][0]) == 4 and all(0 < v < 1 for v in m["H_pre"][0])


def test_results_read_from_claim_files(tmp_path):
    empty = TestClient(create_app()).get("/api/learn/results").json()
    assert not empty["measured"]["found"] and "benchmarks/claim_act.py" in empty["measured"]["command"]
    out = tmp_path / "claim-act"
    out.mkdir()
    for seed, acc in ((0, 0.5), (1, 0.7)):
        rec = {"name": "act_w0.01_b1.0", "seed": seed, "final_loss": 0.1 * (seed + 1), "params": 1,
               "seconds": 1, "per_length": {"4": {"acc": acc, "ponder": 2.0 + seed, "halt1": 0.5}},
               "spearman": 0.25}
        (out / f"act_w0.01_b1.0-s{seed}.json").write_text(json.dumps(rec))
    (out / "broken-s9.json").write_text("{")  # not a result: skipped
    (out / "act_w0.01_b1.0-s7.json").write_text(json.dumps(  # a record of another shape: skipped too
        {"name": "act_w0.01_b1.0", "seed": 7, "per_length": {"4": {"acc": "high"}}}))
    for seed, per in ((5, {"4": {"acc": 0.5, "ponder": "x"}}), (6, {"\u00b2": {"acc": 0.5}})):  # a 500 before
        (out / f"act_w0.01_b1.0-s{seed}.json").write_text(json.dumps(
            {"name": "act_w0.01_b1.0", "seed": seed, "final_loss": 1.0, "per_length": per}))
    b = TestClient(create_app(ServerContext.from_paths([tmp_path]))).get("/api/learn/results").json()
    v = b["measured"]["variants"][0]
    assert b["measured"]["found"] and v["seeds"] == [0, 1]
    assert v["rows"] == [{"length": 4, "seeds": 2, "acc": 0.6, "ponder": 2.5, "halt1": 0.5}]
    assert b["paper"]["lambada"]["rows"][-1] == ["UT + ACT", 142]


def test_the_explainers_section_3_8_and_9_numbers_are_served():
    """explainer.md §3 (BLEU), §8 (agreement, learning to execute, bAbI at 1k) and §9-§11
    (lineage) reach the pages through /api/learn/results, quoted once in learn_results."""
    client = TestClient(create_app())
    b = client.get("/api/learn/results").json()
    assert client.get("/api/learn/paper").json() == {"paper": b["paper"], "lineage": b["lineage"]}
    p = b["paper"]
    assert dict(p["translation"]["rows"]) == {"Transformer base": "28.0", "Transformer big": "28.4",
                                              "UT small (base's compute)": "26.8",
                                              "UT base (base's parameters + 6.7 %)": "28.9"}
    assert p["agreement"]["rows"] == [[1, "−0.008"], [3, "+0.009"], [4, "+0.016"], [5, "+0.027"]]
    assert p["learning_to_execute"]["rows"] == [["UT", "1.0", "1.0", "1.0"]]
    assert "1k" in p["babi_error"]["reading"]
    text = " ".join(x["text"] for x in b["lineage"])
    assert "~108M → ALBERT-base ~12M" in text and "Mixture-of-Depths" in text and "Looped" in b["lineage"][2]["name"]


def test_results_read_from_task_runs(tmp_path):
    """A ``phaseloop task`` metrics.json (its summary made by tasks.report.summarize_seeds)
    and a bAbI one, one level below the served folder, are shown as written."""
    from phaseloop.tasks.report import summarize_seeds

    per_seed = [{"per_length": {8: {"n": 5, "char_acc": a, "seq_acc": a / 2}}, "char_acc": a,
                 "seq_acc": a / 2, "final_loss": 0.1} for a in (0.8, 1.0)]
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "metrics.json").write_text(json.dumps(
        {"task": "copy", "label": "UT", "seeds": [0, 1], "summary": summarize_seeds(per_seed)}))
    (tmp_path / "babi").mkdir()
    (tmp_path / "babi" / "metrics.json").write_text(json.dumps(
        {"tasks": [1], "label": "UT+ACT", "seeds": [0], "summary": {
            "errors": {"1": [0.1, 0.0]}, "mean_error": [0.1, 0.0], "ponder": {"1": {"1": [[2.3, 0.0], [0.8, 0.0]]}}}}))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.json").write_text("{")  # damaged / not a task run: skipped
    for name, rec in (("list", {"task": "copy", "summary": [1, 2]}),  # other shapes: skipped (a 500 before)
                      ("per", {"task": "copy", "summary": {"per_length": [1]}}),
                      ("err", {"tasks": [1], "summary": {"errors": {"1": "x"}}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps(rec))
    t = TestClient(create_app(ServerContext.from_paths([tmp_path]))).get("/api/learn/results").json()["tasks"]
    assert t["found"] and [r["kind"] for r in t["runs"]] == ["babi", "algorithmic"]
    babi, copy = t["runs"]
    assert copy["per_length"] == [{"length": "8", "char_acc": 0.9, "seq_acc": 0.45, "ponder_mean": None}]
    assert copy["char_acc"] == 0.9 and copy["file"].endswith("copy/metrics.json")
    assert babi["ponder"]["1"]["1"][0][0] == 2.3 and babi["mean_error"] == [0.1, 0.0]
    assert not TestClient(create_app()).get("/api/learn/results").json()["tasks"]["found"]


def test_self_check_answers_come_from_the_endpoints(client):
    qs = get(client, "/api/learn/selfcheck")["questions"]
    assert {q["endpoint"] for q in qs} <= set(endpoints())
    answers = []
    for q in qs:
        body = get(client, q["endpoint"], **q["params"])
        for k in q["field"].split("."):
            body = body[int(k)] if isinstance(body, list) else body[k]
        answers.append(body)
    assert answers[:4] == [26_302_464, 979, 9, 64] and answers[5] == 12
    assert round(answers[4], 3) == 2.269 and round(answers[6], 3) == 24.834 and round(answers[7], 4) == 0.0220


def test_every_learn_page_renders(client):
    assert len(PAGES) == 10
    for p in PAGES:
        r = client.get(p["url"])
        assert r.status_code == 200 and "learn.js" in r.text, p["url"]


# --------------------------------------------------------------------------- browser
def wait_text(driver, css, pred=lambda t: bool(t.strip()), timeout=20):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(lambda d: pred(d.find_element(By.CSS_SELECTOR, css).text))
    return driver.find_element(By.CSS_SELECTOR, css).text


LAST_SUMMARY_SPAN = '[data-api="/api/learn/act?preset=init"][data-field="ponder_cost.0"]'


def test_learn_pages_in_a_real_browser(explore_server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    base = explore_server([])
    by_url = {p["url"]: p for p in PAGES}
    # every page loads, draws its first numbers and shows no error
    checks = {"/learn/ut/schedules": "#sch-n", "/learn/ut/calculator": "#calc-total",
              "/learn/ut/coordinates": "#co-far", "/learn/ut/parity": "#pa-need",
              "/learn/ut/act": "#act-run", "/learn/ut/results": "#res-none",
              "/learn/ut/summary": LAST_SUMMARY_SPAN, "/learn/3pt": "#tp-zs",
              "/learn/hyperloop": "#hl-parts td", "/learn/ut/equations": "h3"}
    for url in by_url:
        browser.get(base + url)
        wait_text(browser, checks[url])
        assert browser.find_element(By.ID, "error").get_attribute("hidden") is not None, url
        assert external_urls(browser) == [], url
        screenshot(browser, url.strip("/").replace("/", "-"))

    # calculator: the preset's count, then a changed input's new count
    browser.get(base + "/learn/ut/calculator")
    assert wait_text(browser, "#calc-total") == "63,084,544"
    assert wait_text(browser, "#calc-built").startswith("63,084,544")
    assert wait_text(browser, "#calc-match").startswith("978.9 → 979")
    d = browser.find_element(By.ID, "calc-layers")
    d.clear()
    d.send_keys("3")
    want = f"{accounting.count(accounting.EncDecSpec('x', 512, 8, 3, 3, steps=3))['total']:,}"
    assert wait_text(browser, "#calc-total", lambda t: t == want) == want
    bleu = wait_text(browser, "#calc-bleu", lambda t: "28.9" in t)
    assert "UT small (base's compute) 26.8" in bleu and "equal compute" in wait_text(browser, "#calc-bleu-reading")
    d = browser.find_element(By.ID, "calc-d")
    d.clear()
    d.send_keys("-1")
    assert "d must be between" in wait_text(browser, "#error")

    # ACT executor: step through the init example
    browser.get(base + "/learn/ut/act")
    wait_text(browser, "#act-run", lambda t: t == "2")
    browser.find_element(By.ID, "act-step").click()
    rows = browser.find_elements(By.CSS_SELECTOR, "#act-listing tr")
    assert rows[3].text.split()[-4:] == ["0.0000"] * 4  # new_halted at step 1
    browser.find_element(By.ID, "act-step").click()
    assert wait_text(browser, "#act-k") == "2"
    final = wait_text(browser, "#act-final", lambda t: "ponder" in t)
    assert "2.2689" in final and "0.8034" in final
    screenshot(browser, "learn-ut-act-stepped")

    # parity: step the scan at length 40 (6 steps)
    browser.get(base + "/learn/ut/parity")
    assert wait_text(browser, "#pa-need") == "6"
    for _ in range(3):
        browser.find_element(By.ID, "pa-next").click()
    assert wait_text(browser, "#pa-step") == "3"
    assert browser.find_elements(By.CSS_SELECTOR, "#pa-grid svg") and \
        len(browser.find_elements(By.CSS_SELECTOR, "#pa-grid rect[data-r]")) == 4 * 40
    browser.find_element(By.ID, "pa-end").click()
    assert wait_text(browser, "#pa-exact") == "40 / 40"

    # coordinates: move the t slider, the curve's peak follows
    browser.get(base + "/learn/ut/coordinates")
    wait_text(browser, "#co-peak", lambda t: t.startswith("10:"))
    slider = browser.find_element(By.ID, "co-t")
    slider.send_keys(Keys.RIGHT, Keys.RIGHT)
    assert wait_text(browser, "#co-peak", lambda t: t.startswith("12:")).startswith("12: 32.0000")
    screenshot(browser, "learn-ut-coordinates-t12")

    # self-check: a right and a wrong answer, checked by the endpoints
    browser.get(base + "/learn/ut/summary")
    wait_text(browser, "#quiz li")
    assert "ALBERT-base ~12M" in wait_text(browser, "#lineage")
    assert wait_text(browser, LAST_SUMMARY_SPAN) == "2.269"  # every number of the page filled (one by one)
    browser.get(base + "/learn/ut/results")
    assert "5 +0.027" in wait_text(browser, "#res-agreement", lambda t: "+0.027" in t)
    browser.get(base + "/learn/ut/summary")
    wait_text(browser, "#quiz li")
    screenshot(browser, "learn-ut-summary-lineage")
    browser.find_element(By.ID, "q2").send_keys("9")
    browser.find_element(By.ID, "qb2").click()
    assert wait_text(browser, "#qa2") == "✓ 9"
    browser.find_element(By.ID, "q1").send_keys("1024")
    browser.find_element(By.ID, "qb1").click()
    assert wait_text(browser, "#qa1") == "✗ answer: 979"
