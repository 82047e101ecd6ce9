"""A recipe's ``[eval]`` (issue 43): every finished run scored once on the downstream tasks;
summary.json / report.md / explore's comparison page give per-task accuracy mean ± std over
seeds, the average and paired tests against the reference, each recomputed here from the
runs' own downstream.json; [eval] can change on a finished comparison; bad tables are one
line; benchmarks/claim_hyperloop.py's downstream table."""

import json
import math

import pytest

pytest.importorskip("lm_eval")

from conftest import REPO
from test_compare import tiny_recipe
from test_downstream import _data_or_skip

from phaseloop.analysis.stats import paired_t_test
from phaseloop.compare import run_comparison
from phaseloop.compare.options import RecipeError
from phaseloop.files import read_json

pytestmark = pytest.mark.usefixtures("one_thread")
EVAL = {"tasks": ["piqa", "winogrande"], "limit": 4}


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    _data_or_skip()
    root = tmp_path_factory.mktemp("dsc")
    text = root / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHASELOOP_CACHE", str(root / "cache"))
        recipe = tiny_recipe(text, variants=["rope", "looped"], eval=EVAL)
        s = run_comparison(recipe, root / "c", progress=False, log=None)
    return root / "c", s, text


def test_summary_is_the_runs_own_scores(compared):
    out, s, _ = compared
    ref = {seed: read_json(out / "runs" / f"rope-s{seed}" / "downstream.json") for seed in (0, 1)}
    for v in s["variants"]:
        runs = {seed: read_json(out / "runs" / f"{v['slug']}-s{seed}" / "downstream.json") for seed in (0, 1)}
        d = v["downstream"]
        assert d["seeds"] == [0, 1] and set(d["tasks"]) == set(EVAL["tasks"])
        for i, task in enumerate(EVAL["tasks"]):
            x = [runs[seed]["tasks"][i]["value"] for seed in (0, 1)]
            assert runs[0]["tasks"][i]["task"] == task and runs[0]["tasks"][i]["docs"] == 4
            assert d["tasks"][task]["mean"] == pytest.approx(sum(x) / 2, abs=1e-12)
            assert d["tasks"][task]["std"] == pytest.approx(abs(x[0] - x[1]) / math.sqrt(2), abs=1e-12)
        avg = [sum(t["value"] for t in runs[seed]["tasks"]) / 2 for seed in (0, 1)]
        assert d["average"]["mean"] == pytest.approx(sum(avg) / 2, abs=1e-12)
        assert runs[0]["settings"] == {"tasks": EVAL["tasks"], "limit": 4, "shots": 0}
        if v["name"] == "rope":
            assert d["average"]["vs_reference"] is None
            continue
        ref_avg = [sum(t["value"] for t in ref[seed]["tasks"]) / 2 for seed in (0, 1)]
        t = d["average"]["vs_reference"]
        want = paired_t_test([-a for a in ref_avg], [-a for a in avg])  # higher accuracy = better
        assert t["mean_diff"] == pytest.approx(sum(avg) / 2 - sum(ref_avg) / 2, abs=1e-12)
        assert t["p"] == want["p"] and t["verdict"] == want["verdict"]


def test_report_and_explore_show_it(compared):
    from phaseloop.compare.evals import fmt_acc
    from phaseloop.compare.report import format_table

    out, s, _ = compared
    report = (out / "report.md").read_text()
    assert "## Downstream tasks" in report and "| variant | piqa (acc_norm) | winogrande (acc) | average |" in report
    assert "downstream avg" in format_table(read_json(out / "summary.json"))
    for v in s["variants"]:
        d = v["downstream"]
        cells = [fmt_acc(d["tasks"][t]["mean"], d["tasks"][t]["std"]) for t in EVAL["tasks"]]
        assert f"| {v['name']} | {cells[0]} | {cells[1]} | {fmt_acc(d['average']['mean'], d['average']['std'])} |" \
            in report
    pytest.importorskip("starlette")
    from phaseloop.explore import rundata

    page = rundata.comparison(out)["downstream"]
    assert page["tasks"] == EVAL["tasks"] and page["chance"] == 0.5
    for row, v in zip(page["rows"], s["variants"]):
        d = v["downstream"]
        assert row["cells"]["piqa"] == fmt_acc(d["tasks"]["piqa"]["mean"], d["tasks"]["piqa"]["std"])
        assert row["average"] in report and row["vs_reference"] in report


def test_eval_can_change_on_a_finished_comparison(compared, tmp_path):
    """A new [eval] scores the finished runs again (nothing retrained) and recipe.json
    records it; the same [eval] reads the scores back."""
    import shutil

    out, _, text = compared
    copy = tmp_path / "c"
    shutil.copytree(out, copy)
    before = {p: p.stat().st_mtime_ns for p in copy.glob("runs/*/checkpoint/*")}
    recipe = tiny_recipe(text, variants=["rope", "looped"], eval={"tasks": ["piqa"], "limit": 3})
    s = run_comparison(recipe, copy, progress=False, log=None)
    assert read_json(copy / "recipe.json")["recipe"]["eval"]["limit"] == 3
    assert {p: p.stat().st_mtime_ns for p in copy.glob("runs/*/checkpoint/*")} == before
    assert all(list(v["downstream"]["tasks"]) == ["piqa"] for v in s["variants"])
    assert read_json(copy / "runs" / "rope-s0" / "downstream.json")["tasks"][0]["docs"] == 3
    stamp = (copy / "runs" / "rope-s0" / "downstream.json").stat().st_mtime_ns
    run_comparison(recipe, copy, progress=False, log=None)
    assert (copy / "runs" / "rope-s0" / "downstream.json").stat().st_mtime_ns == stamp


@pytest.mark.parametrize("table, msg", [
    ({"tasks": []}, "non-empty list"),
    ({"tasks": "piqa"}, "non-empty list"),
    ({"tasks": ["piqaa"]}, "did you mean 'piqa'"),
    ({"tasks": ["piqa"], "limit": 0}, "limit = 0"),
    ({"tasks": ["piqa"], "shots": 2}, "would come from the evaluation split"),
    ({"tasks": ["piqa"], "shot": 2}, "unknown key 'shot'"),
    ("piqa", "eval must be a table"),
])
def test_bad_eval_tables_are_one_line(tmp_path, table, msg):
    with pytest.raises(RecipeError, match=None) as e:
        tiny_recipe(tmp_path / "x.txt", eval=table)
    assert msg in str(e.value) and len(str(e.value).splitlines()) == 1


def test_hyperloop_recipes_score_the_nine_tasks():
    from phaseloop.compare.recipe import load_recipe
    from phaseloop.hf.downstream import TASKS

    for name in ("hyperloop.toml", "hyperloop_tuned.toml"):
        e = load_recipe(REPO / "recipes" / name).eval
        assert e["tasks"] == list(TASKS) and e["limit"] == 200 and e["shots"] == 0


def test_claim_hyperloop_downstream_table(tmp_path):
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import claim_hyperloop

    for seed in range(3):
        for i, arch in enumerate(claim_hyperloop.ARCHS):
            d = tmp_path / f"{arch}-s{seed}"
            d.mkdir()
            acc = {"piqa": 0.5 + 0.01 * i + 0.003 * seed, "boolq": 0.6 - 0.002 * i * seed}
            (d / "claim.json").write_text(json.dumps({
                "arch": arch, "seed": seed, "params": 1000, "bpb_eval": 3.0, "bpb_rtn4": 3.0, "bpb_gptq4": 3.0,
                "tok_per_s": 1.0, "bytes_fp32": 4e6, "bytes_gptq4": 1e6,
                "downstream": {**acc, "average": (acc["piqa"] + acc["boolq"]) / 2},
                "downstream_meta": {"metrics": {"piqa": "acc_norm", "boolq": "acc"}, "limit": 200, "chance": 0.5,
                                    "seconds": {"piqa": 10.0, "boolq": 20.0}}}))
    out = claim_hyperloop.table(tmp_path)
    assert "the first 200 documents of each task" in out and "seconds per task and run (mean): piqa 10, boolq 20" in out
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("downstream accuracy"))
    line = next(ln for ln in lines[start:] if ln.startswith("hyperloop "))
    assert "0.5330±0.003" in line  # piqa 0.53 + 0.003 * seed, mean over seeds 0-2
    assert "piqa +0.030 (p=n/a)" in out  # transformer -> hyperloop: +0.03 at every seed: no noise estimate
