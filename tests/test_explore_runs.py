"""explore's Runs pages (issue 26): the incremental metrics reader, downsampling, folder
discovery, a comparison's table read from its own summary.json, every /api/runs endpoint
(bad input -> 400 with the message), and the pages in a real headless Chromium."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")

from conftest import REPO, write_corpus
from explore_fixtures import external_urls, screenshot
from starlette.testclient import TestClient

from phaseloop.compare.report import format_table
from phaseloop.engine import read_metrics
from phaseloop.explore import rundata
from phaseloop.explore.app import create_app
from phaseloop.explore.context import ServerContext
from phaseloop.files import read_json


def _rec(step, loss=None, val=None):
    if val is not None:
        return {"step": step, "val_loss": val, "val_bpb": val / 0.69, "val_ppl": 2.0, "elapsed_s": 0.1 * step}
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tok_per_s": 10.0, "elapsed_s": 0.1 * step}


def _fake_run(path: Path, records, finished=False) -> Path:
    """A run folder as a training run leaves it (config.json, metrics.jsonl)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model": {"arch": "rope"}, "train": {"steps": 100}}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        (path / "summary.json").write_text(json.dumps({"step": 100, "val_loss": 1.0, "val_bpb": 1.5}))
    return path


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """A finished two-seed comparison of the CI recipe, 4 steps a run."""
    from phaseloop.cli import main

    root = tmp_path_factory.mktemp("cmp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHASELOOP_CACHE", str(root / "cache"))
        text = write_corpus(root / "corpus.txt")
        assert main(["compare", str(REPO / "recipes" / "ci.toml"), "--data", str(text), "--out",
                     str(root / "ci"), "--steps", "4", "--quiet"]) == 0
    return root / "ci"


# ---------------------------------------------------------------------------- the reader
def test_metrics_tail_is_incremental_and_takes_a_torn_line_for_pending(tmp_path):
    run = _fake_run(tmp_path / "r", [_rec(1, 3.0), _rec(2, 2.5), _rec(2, val=2.6)])
    tail = rundata.MetricsTail(run / "metrics.jsonl").update()
    assert tail.train["step"] == [1, 2] and tail.eval["val_loss"] == [2.6] and tail.records == 3
    size = (run / "metrics.jsonl").stat().st_size
    assert tail.offset == size
    half = json.dumps(_rec(3, 2.0))
    with open(run / "metrics.jsonl", "a") as f:
        f.write(half[:20])  # a record being written
    tail.update()
    assert tail.torn and tail.records == 3 and tail.offset == size and not tail.damaged
    with open(run / "metrics.jsonl", "a") as f:
        f.write(half[20:] + "\n" + "not json\n")
    tail.update()
    assert tail.train["loss"] == [3.0, 2.5, 2.0] and not tail.torn and tail.damaged == 1
    with open(run / "metrics.jsonl", "a") as f:  # a step of true or 4.0 is no step; a loss of true no loss
        f.write("\n".join(json.dumps(r) for r in ({**_rec(4, 1.0), "step": True}, {**_rec(4, 1.0), "step": 4.0},
                                                   {**_rec(4, 1.0), "loss": True})) + "\n")
    tail.update()
    assert tail.train["step"] == [1, 2, 3, 4] and tail.train["loss"][-1] is None and tail.damaged == 3
    # a resumed run rewrites the file shorter: read again from the start
    (run / "metrics.jsonl").write_text(json.dumps(_rec(1, 9.0)) + "\n")
    assert rundata.MetricsTail(run / "metrics.jsonl").update().train["loss"] == tail.update().train["loss"] == [9.0]
    assert [r for r in read_metrics(run)] == [_rec(1, 9.0)]


def test_downsample_keeps_extremes_and_ends():
    n = 100_000
    cols = {"step": list(range(n)), "loss": [1.0 + (i % 7) * 1e-3 for i in range(n)]}
    cols["loss"][54_321] = 50.0  # a spike
    cols["loss"][77_777] = -1.0
    d = rundata.downsample(cols, "loss", 1000)
    assert d["n"] == n and len(d["step"]) <= 1000
    assert d["step"][0] == 0 and d["step"][-1] == n - 1 and d["step"] == sorted(d["step"])
    assert 50.0 in d["loss"] and -1.0 in d["loss"]
    assert all(cols["loss"][s] == y for s, y in zip(d["step"], d["loss"]))
    small = {"step": [1, 2], "loss": [1.0, 0.5]}
    assert rundata.downsample(small, "loss", 10) == {**small, "n": 2}


def test_find_runs_and_comparisons(tmp_path, comparison):
    _fake_run(tmp_path / "a", [_rec(1, 1.0)])
    (tmp_path / "empty").mkdir()
    os.symlink(comparison, tmp_path / "linked")  # never followed
    assert rundata.find(tmp_path) == [("run", "a")]
    found = rundata.find(comparison)
    assert found[0] == ("comparison", "") and len(found) == 1 + 4  # 2 variants x 2 seeds


def test_comparison_table_is_report_py_s(comparison):
    c = rundata.comparison(comparison)
    summary = read_json(comparison / "summary.json")
    table = format_table(summary)
    assert c["summarized"] and c["seeds"] == [0, 1] and c["reference"] == "rope"
    assert c["plots"] == summary["plots"] and len(c["plots"]) == 3
    for row, v in zip(c["rows"], summary["variants"]):
        line = next(ln for ln in table.splitlines() if ln.startswith(f"| {v['name']} |"))
        for key in ("params", "val_loss", "val_bpb", "val_ppl", "step_speedup", "wallclock_speedup", "vs_reference"):
            assert f" {row[key]} |" in line, (key, row[key], line)
        assert row["seeds"] == v["finished_seeds"] == [0, 1]
        assert row["p"] == (v["vs_reference"] or {}).get("p")
        assert row["final"] == {str(s): f["val_loss"] for s, f in v["final"].items()}
    assert c["rows"][1]["p"] is not None and 0 <= c["rows"][1]["p"] <= 1


# ---------------------------------------------------------------------------- endpoints
def test_runs_endpoints(comparison):
    client = TestClient(create_app(ServerContext.from_paths([comparison])))
    items = client.get("/api/runs/list").json()["items"]
    assert [i["kind"] for i in items] == ["comparison"] + ["run"] * 4
    run = items[1]
    r = client.get("/api/runs/curves", params={"root": "ci", "path": run["path"]}).json()
    records = read_metrics(comparison / run["path"])
    assert r["records"] == len(records) and r["finished"] and r["steps"] == 4
    assert r["eval"]["val_loss"] == [x["val_loss"] for x in records if "val_loss" in x]
    assert r["train"]["loss"] == [x["loss"] for x in records if "lr" in x]
    c = client.get("/api/runs/comparison", params={"root": "ci"}).json()
    assert c == json.loads(json.dumps(rundata.comparison(comparison)))
    png = client.get("/api/runs/plot", params={"root": "ci", "name": c["plots"][0]})
    assert png.status_code == 200 and png.content == (comparison / c["plots"][0]).read_bytes()
    assert png.headers["content-type"] == "image/png"
    for html in ("/runs", "/runs/compare?root=ci"):
        assert client.get(html).status_code == 200


@pytest.mark.parametrize("url,params,message", [
    ("/api/runs/curves", {"root": "nope", "path": "x"}, "unknown folder 'nope'"),
    ("/api/runs/curves", {"path": "x"}, "root is required"),
    ("/api/runs/curves", {"root": "ci", "path": "../ci"}, "without '..'"),
    ("/api/runs/curves", {"root": "ci", "path": "/etc"}, "must be relative"),
    ("/api/runs/curves", {"root": "ci", "path": "runs"}, "is not a run folder"),
    ("/api/runs/curves", {"root": "ci", "path": ""}, "is not a run folder"),
    ("/api/runs/curves", {"root": "ci", "path": "runs/rope-s0", "max_points": "5"}, "max_points must be between"),
    ("/api/runs/comparison", {"root": "ci", "path": "runs/rope-s0"}, "is not a comparison folder"),
    ("/api/runs/plot", {"root": "ci", "name": "report.md"}, "is not a plot of this comparison"),
    ("/api/runs/plot", {"root": "ci", "name": "../ci/summary.json"}, "is not a plot"),
    ("/api/runs/curves", {"root": "ci", "path": "a" * 300}, "cannot be read"),  # a name too long
    ("/api/runs/curves", {"root": "ci", "path": "a/" * 2100}, "cannot be read"),
    ("/api/runs/curves", {"root": "ci", "path": "a\0b"}, "holds a NUL character"),
    ("/api/runs/plot", {"root": "ci", "path": "a\0b", "name": "x.png"}, "holds a NUL character"),  # a 500 before
])
def test_runs_bad_input_is_a_400_with_the_message(comparison, url, params, message):
    client = TestClient(create_app(ServerContext.from_paths([comparison])))
    r = client.get(url, params=params)
    assert r.status_code == 400 and message in r.json()["error"], r.text


@pytest.mark.parametrize("file,content", [("recipe.json", [1]), ("summary.json", {}),
                                          ("summary.json", {"variants": [{"name": "x"}]})])
def test_a_damaged_comparison_file_is_a_400_naming_it(comparison, tmp_path, file, content):
    import shutil

    copy = tmp_path / "ci"
    shutil.copytree(comparison, copy, symlinks=True)
    (copy / file).write_text(json.dumps(content))
    client = TestClient(create_app(ServerContext.from_paths([copy])))
    for url, extra in (("/api/runs/comparison", {}), ("/api/runs/plot", {"name": "x.png"})):
        r = client.get(url, params={"root": "ci", **extra})
        assert r.status_code == 400 and "is damaged" in r.json()["error"], r.text


def test_a_summary_of_text_numbers_or_foreign_plots(comparison, tmp_path):
    """A number written as text is damage (it was a bare format error, and a 500 for a plot);
    a plot name outside the folder (absolute, '..') is not listed, so not served."""
    import shutil

    copy = tmp_path / "ci"
    shutil.copytree(comparison, copy, symlinks=True)
    summary = json.loads((copy / "summary.json").read_text())
    plot = summary["plots"][0]
    (tmp_path / "outside.png").write_bytes(b"x")
    bad = {**summary, "plots": summary["plots"] + ["/etc/passwd", "../outside.png", str(tmp_path / "outside.png")]}
    (copy / "summary.json").write_text(json.dumps(bad))
    client = TestClient(create_app(ServerContext.from_paths([copy])))
    assert client.get("/api/runs/comparison", params={"root": "ci"}).json()["plots"] == summary["plots"]
    for name in bad["plots"][-3:]:
        r = client.get("/api/runs/plot", params={"root": "ci", "name": name})
        assert r.status_code == 400 and "is not a plot" in r.json()["error"], r.text
    bad["variants"][0]["step_speedup"] = "fast"
    (copy / "summary.json").write_text(json.dumps(bad))
    for url, extra in (("/api/runs/comparison", {}), ("/api/runs/plot", {"name": plot})):
        r = client.get(url, params={"root": "ci", **extra})
        assert r.status_code == 400 and "summary.json is damaged" in r.json()["error"], r.text


def test_symlinked_run_is_refused(tmp_path):
    real = _fake_run(tmp_path / "real", [_rec(1, 1.0)])
    (tmp_path / "served").mkdir()
    os.symlink(real, tmp_path / "served" / "link")
    client = TestClient(create_app(ServerContext.from_paths([tmp_path / "served"])))
    r = client.get("/api/runs/curves", params={"root": "served", "path": "link"})
    assert r.status_code == 400 and "symbolic link" in r.json()["error"]
    assert client.get("/api/runs/list").json()["items"] == []


# ---------------------------------------------------------------------------- browser
def test_curves_follow_a_training_run_in_a_browser(tmp_path, explore_server, browser):
    run = _fake_run(tmp_path / "live", [_rec(s, 3.0 - s / 100) for s in range(1, 51)] + [_rec(50, val=2.6)])
    base = explore_server([run])
    browser.get(base + "/runs")
    wait = _waiter(browser)
    wait(lambda: browser.execute_script(
        "const d = document.getElementById('curves-loss'); return d.data && d.data.length") == 2)
    assert browser.find_element("css selector", ".records").text == "51"
    assert browser.find_element("css selector", ".last-step").text == "50"
    with open(run / "metrics.jsonl", "a") as f:  # training goes on: 50 more steps, one torn line
        f.write("".join(json.dumps(_rec(s, 2.5 - s / 1000)) + "\n" for s in range(51, 101)))
        f.write(json.dumps(_rec(100, val=2.2)) + "\n" + '{"step": 101, "lo')
    wait(lambda: browser.find_element("css selector", ".last-step").text == "100")
    assert browser.find_element("css selector", ".records").text == "102"  # the torn line waits
    assert browser.find_element("css selector", ".last-val").text == "2.2000"
    n_points = browser.execute_script("return document.getElementById('curves-loss').data[0].x.length")
    assert n_points == 100


def test_comparison_pages_in_a_browser(comparison, explore_server, browser):
    base = explore_server([comparison])
    wait = _waiter(browser)
    browser.get(base + "/runs")
    wait(lambda: browser.execute_script(
        "const d = document.getElementById('curves-bpb'); return d.data && d.data.length") == 4)
    screenshot(browser, "runs_index")
    assert external_urls(browser) == []  # the rendered DOM: plotly's mode bar has no logo link
    browser.get(base + "/runs/compare?root=ci")
    wait(lambda: len(browser.find_elements("css selector", "#compare-table tbody tr")) == 2)
    c = rundata.comparison(comparison)
    cells = [td.text for td in browser.find_elements("css selector", "#compare-table tbody tr:nth-child(2) td")]
    assert cells[0] == "three_phase N=3" and cells[1] == "0, 1" and cells[5] == c["rows"][1]["val_loss"]
    assert cells[11] == f"{c['rows'][1]['p']:.3f}"
    assert float(browser.find_element("id", "target").text) == pytest.approx(c["target_val_loss"], abs=1e-4)
    wait(lambda: browser.execute_script(
        "return [...document.querySelectorAll('#plots img')].every(i => i.complete && i.naturalWidth > 0)"))
    assert len(browser.find_elements("css selector", "#plots img")) == 3
    wait(lambda: browser.execute_script(
        "const d = document.getElementById('curves-loss'); return d.data && d.data.length") == 8)
    assert browser.find_elements("css selector", "#curves-loss .modebar") and external_urls(browser) == []
    screenshot(browser, "runs_compare")


def _waiter(driver, timeout=30):
    def wait(cond):
        deadline = time.time() + timeout
        while True:
            try:
                if cond():
                    return
            except Exception:  # the element may not be there yet
                pass
            if time.time() > deadline:
                raise AssertionError(f"timed out; page error: {driver.find_element('id', 'error').text!r}")
            time.sleep(0.2)
    return wait


def test_bench_explore_smoke(capsys):
    """benchmarks/bench_explore.py runs (smallest setting); its figures are measured by running it."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_explore

    assert bench_explore.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "open a run of 1,000 metric records" in out and "ponder map of 16 tokens" in out


def test_comparison_control_column_is_report_py_s(comparison, tmp_path):
    """A variant t-tested against a control (issue 27) shows report.py's "vs control" cell."""
    import shutil

    copy = tmp_path / "c"
    shutil.copytree(comparison, copy, symlinks=True)
    summary = read_json(copy / "summary.json")
    summary["variants"][1]["vs_control"] = {"control": "rope", "p": 0.25, "verdict": "indistinguishable",
                                            "t": 1.0, "df": 1, "n": 2, "mean_diff": 0.01, "note": ""}
    (copy / "summary.json").write_text(json.dumps(summary))
    row = rundata.comparison(copy)["rows"][1]
    line = next(ln for ln in format_table(summary).splitlines()
                if ln.startswith(f"| {summary['variants'][1]['name']} |"))
    assert row["vs_control"] == "indistinguishable (p=0.250) vs rope" and f" {row['vs_control']} |" in line
    assert rundata.comparison(copy)["rows"][0]["vs_control"] == ""


def test_comparison_downstream_table_in_a_browser(comparison, tmp_path, explore_server, browser):
    """A comparison with [eval] results (issue 43): the page's Downstream table shows
    rundata's cells (report.md's), the average and its verdict, and the chance row."""
    import shutil

    copy = tmp_path / "ci"
    shutil.copytree(comparison, copy, symlinks=True)
    summary = read_json(copy / "summary.json")
    for i, v in enumerate(summary["variants"]):
        test = None if i == 0 else {"p": 0.3, "verdict": "indistinguishable", "mean_diff": 0.02, "t": 1.2,
                                    "df": 1, "n": 2, "note": ""}
        stat = {"mean": 0.5 + 0.01 * i, "std": 0.004, "per_seed": {"0": 0.5, "1": 0.51}, "vs_reference": test}
        v["downstream"] = {"seeds": [0, 1], "chance": 0.375, "average": stat,
                           "tasks": {"piqa": {"metric": "acc_norm", **stat}, "boolq": {"metric": "acc", **stat}}}
    (copy / "summary.json").write_text(json.dumps(summary))
    c = rundata.comparison(copy)["downstream"]
    assert c["tasks"] == ["piqa", "boolq"] and c["rows"][1]["vs_reference"] == "+0.020, indistinguishable (p=0.300)"
    base = explore_server([copy])
    browser.get(base + "/runs/compare?root=ci")
    wait = _waiter(browser)
    wait(lambda: len(browser.find_elements("css selector", "#downstream-table tbody tr")) == 3)
    cells = [td.text for td in browser.find_elements("css selector", "#downstream-table tbody tr:nth-child(2) td")]
    assert cells == [c["rows"][1]["name"], "0, 1", "0.510 ± 0.004", "0.510 ± 0.004", "0.510 ± 0.004",
                     "+0.020, indistinguishable (p=0.300)"]
    heads = [th.text for th in browser.find_elements("css selector", "#downstream-table thead th")]
    assert heads[2:4] == ["piqa (acc_norm)", "boolq (acc)"]
    assert browser.find_element("css selector", "#downstream-table tbody tr:nth-child(3)").text.split()[-1] == "0.375"


def test_text_from_a_comparison_is_shown_never_run(comparison, tmp_path, explore_server, browser):
    """A recipe's description and a variant's name are text on the page: markup in them is
    shown as written (no element made, nothing fetched from outside)."""
    import shutil

    copy = tmp_path / "ci"
    shutil.copytree(comparison, copy, symlinks=True)
    desc = "RoPE <img id='injected' src='http://example.com/t.png'> vs looped"
    stored = read_json(copy / "recipe.json")
    stored["recipe"]["description"] = desc
    (copy / "recipe.json").write_text(json.dumps(stored))
    summary = read_json(copy / "summary.json")
    name = summary["variants"][1]["name"] = "looped <b id='bold'>x</b>"
    (copy / "summary.json").write_text(json.dumps(summary))
    base = explore_server([copy])
    browser.get(base + "/runs/compare?root=ci")
    wait = _waiter(browser)
    wait(lambda: len(browser.find_elements("css selector", "#compare-table tbody tr")) == 2)
    assert desc in browser.find_element("id", "cmp-head").text
    assert not browser.find_elements("id", "injected") and not browser.find_elements("id", "bold")
    assert browser.find_element("css selector", "#compare-table tbody tr:nth-child(2) td").text == name
    assert external_urls(browser) == []


@pytest.mark.parametrize("file,content", [("summary.json", [1]), ("config.json", [1]),
                                          ("config.json", {"model": 3, "train": []})])
def test_a_run_with_a_damaged_json_is_listed_with_its_error(comparison, tmp_path, file, content):
    """A run's config.json or summary.json of another shape is a row naming the damage, not
    Python's own words ('list' object has no attribute 'get'), and the list goes on."""
    import shutil

    copy = tmp_path / "ci"
    shutil.copytree(comparison, copy, symlinks=True)
    run = next(p for p in sorted((copy / "runs").iterdir()) if (p / "summary.json").is_file())
    (run / file).write_text(json.dumps(content))
    items = TestClient(create_app(ServerContext.from_paths([copy]))).get("/api/runs/list").json()["items"]
    row = next(i for i in items if i["path"].endswith(run.name))
    if isinstance(content, list):
        assert f"{file} holds a JSON list, not an object: the file is damaged" in row["error"], row
    else:
        assert "error" not in row and row["arch"] is None, row
    assert len(items) == 5
