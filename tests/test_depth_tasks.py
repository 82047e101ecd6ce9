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
