"""phaseloop task --test-depth (issue 25): accuracy per (test length x depth); the trained
depth's numbers are the plain test's; a bad depth is refused before anything trains."""

import json

import pytest
from conftest import assert_one_line, run_cli

from phaseloop.cli import main

SMALL = ["--task", "copy", "--train-len", "2-3", "--test-len", "3,5", "--steps", "4", "--batch-size", "4",
         "--n-test", "4", "--seeds", "0,1", "--quiet"]


@pytest.mark.parametrize("arch,trained,depths", [("universal", 4, "2,4,6"), ("universal-seq2seq", None, "1,3"),
                                                 ("hyperloop", 2, "1,2,3")])
def test_task_test_depth_table(tmp_path, capsys, arch, trained, depths):
    out = tmp_path / "r"
    extra = ["--extend-loops", "last"] if arch == "hyperloop" else []
    assert main(["task", "--arch", arch, *SMALL, "--test-depth", depths, *extra, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sequence accuracy by test length x depth" in text
    m = json.loads((out / "metrics.json").read_text())
    per_depth = m["summary"]["per_depth"]
    assert list(per_depth) == depths.split(",")
    assert all(set(per_depth[d]["per_length"]) == {"3", "5"} for d in per_depth)
    if trained is not None:  # the trained depth decodes exactly as the plain test does
        for r in m["per_seed"]:
            assert r["per_depth"][str(trained)]["per_length"] == r["per_length"]


@pytest.mark.parametrize("arch,extra,pattern", [
    ("rope", ["--test-depth", "2"], "no depth to change"),
    ("hyperloop", ["--test-depth", "3"], "extend='last'"),
    ("universal", ["--test-depth", "0"], "out of range"),
    ("universal", ["--extend-loops", "last"], "applies with --test-depth"),
])
def test_task_bad_depth_refused_before_training(tmp_path, capsys, arch, extra, pattern):
    out = tmp_path / "r"
    code, err = run_cli(["task", "--arch", arch, *SMALL, *extra, "--out", out], capsys)
    assert_one_line(code, err, pattern)
    assert not out.exists()


def test_task_depth_sample_is_recorded_and_trains_past_hyperloop_loops(tmp_path, capsys):
    """--depth-sample reaches the task runs' engine (each seed's config.json); past a
    Hyperloop's trained loops it needs --extend-loops last, refused before training."""
    out = tmp_path / "r"
    code, err = run_cli(["task", "--arch", "hyperloop", *SMALL, "--depth-sample", "1:3", "--out", out], capsys)
    assert_one_line(code, err, "extend='last'")
    assert not (out / "seed-0" / "config.json").exists()
    assert main(["task", "--arch", "hyperloop", *SMALL, "--depth-sample", "1:3", "--extend-loops", "last",
                 "--test-depth", "2", "--out", str(out)]) == 0
    for s in (0, 1):
        train = json.loads((out / f"seed-{s}" / "config.json").read_text())["train"]
        assert (train["depth_sample"], train["extend_loops"]) == ("1:3", "last")
    m = json.loads((out / "metrics.json").read_text())
    for r in m["per_seed"]:  # evaluated at the trained depth (2 loops) after training
        assert r["per_depth"]["2"]["per_length"] == r["per_length"]


BABI = ["babi", "--tasks", "1,2", "--steps", "3", "--batch-size", "4", "--n-test", "8", "--max-sentences", "4",
        "--seeds", "0,1", "--quiet"]


def test_babi_test_depth_table(tmp_path, capsys, data_dir):
    """bAbI --test-depth: error per task x depth, mean and std over seeds; the trained
    depth's errors are the plain test's."""
    out = tmp_path / "b"
    assert main([*BABI, "--arch", "universal", "--test-depth", "2,4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bAbI error by task x depth" in text
    m = json.loads((out / "metrics.json").read_text())
    per_depth = m["summary"]["per_depth"]
    assert list(per_depth) == ["2", "4"]
    assert all(set(per_depth[d]["errors"]) == {"1", "2"} for d in per_depth)
    for r in m["per_seed"]:  # universal-tiny trains 4 steps
        assert r["per_depth"]["4"]["errors"] == r["errors"]
        assert set(r["per_depth"]["2"]) == {"errors", "failed", "mean_error"}
    assert per_depth["4"]["mean_error"] == m["summary"]["mean_error"]


@pytest.mark.parametrize("arch,extra,pattern", [
    ("rope", ["--test-depth", "2"], "no depth to change"),
    ("hyperloop", ["--test-depth", "3"], "extend='last'"),
    ("universal", ["--extend-loops", "last"], "applies with --test-depth"),
    ("rope", ["--depth-sample", "2:3"], "no depth to change"),
])
def test_babi_bad_depth_refused_before_training(tmp_path, capsys, data_dir, arch, extra, pattern):
    out = tmp_path / "b"
    code, err = run_cli([*BABI, "--arch", arch, *extra, "--out", out], capsys)
    assert_one_line(code, err, pattern)
    assert not any(out.rglob("config.json"))
