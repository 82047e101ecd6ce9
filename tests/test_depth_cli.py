"""phaseloop eval / generate --depth (issue 25): the sweep's trained-depth row is a plain
eval exactly; bad depths and stacks are one line, exit 2."""

import json

import pytest

from conftest import TINY, assert_one_line, run_cli, write_corpus
from phaseloop.cli import main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("depth_cli")
    text = write_corpus(root / "corpus.txt")
    out = {"text": text}
    for preset in ("hyperloop-tiny", "rope-tiny"):
        run = root / preset
        flags = [a if a != "rope-tiny" else preset for a in TINY]
        assert main(["train", *flags, "--steps", "2", "--eval-every", "2", "--ckpt-every", "2",
                     "--data", str(text), "--out", str(run), "--device", "cpu"]) == 0
        out[preset] = run
    return out


def _json(argv, capsys):
    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_sweep_trained_depth_equals_plain_eval(runs, capsys):
    run = runs["hyperloop-tiny"]
    common = ["eval", run, "--windows", "4", "--device", "cpu", "--json"]
    plain = _json(common, capsys)
    rows = _json([*common, "--depth", "1,2,3", "--extend-loops", "last"], capsys)
    assert [r["depth"] for r in rows] == [1, 2, 3]
    trained = rows[1]  # hyperloop-tiny trains 2 loops
    for k in ("val_loss", "val_bpb", "val_ppl", "val_tokens"):
        assert trained[k] == plain[k], k
    assert rows[0]["flops_per_token"] < trained["flops_per_token"] < rows[2]["flops_per_token"]
    assert all(r["tok_per_s"] > 0 for r in rows)
    assert main(["eval", str(run), "--windows", "2", "--device", "cpu", "--depth", "2,3",
                 "--extend-loops", "last"]) == 0
    table = capsys.readouterr().out
    assert "MFLOP/tok" in table and len(table.strip().splitlines()) == 4


def test_generate_at_a_depth(runs, capsys):
    run = runs["hyperloop-tiny"]
    base = ["generate", str(run), "--max-new-tokens", "5", "--temperature", "0", "--device", "cpu"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--depth", "2"]) == 0
    assert capsys.readouterr().out == plain
    assert main([*base, "--depth", "1"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("cmd,extra,pattern", [
    ("eval", ["--depth", "0"], "out of range"),
    ("eval", ["--depth", "-2"], "out of range"),
    ("eval", ["--depth", "2,x"], "positive integers separated by commas"),
    ("eval", ["--depth", "2,2"], "repeated"),
    ("generate", ["--depth", "2,3"], "invalid int value"),
    ("generate", ["--depth", "0"], "out of range"),
    ("eval", ["--depth", "3"], "extend='last'"),
    ("generate", ["--depth", "5"], "extend='last'"),
    ("eval", ["--extend-loops", "last"], "applies with --depth"),
    ("generate", ["--extend-loops", "last"], "applies with --depth"),
    ("eval", ["--depth", "2", "--extend-loops", "first"], "invalid choice"),
])
def test_bad_depths_one_line(runs, capsys, cmd, extra, pattern):
    code, err = run_cli([cmd, runs["hyperloop-tiny"], "--device", "cpu", *extra], capsys)
    assert_one_line(code, err, pattern)


@pytest.mark.parametrize("cmd", ["eval", "generate"])
def test_stack_has_no_depth(runs, capsys, cmd):
    code, err = run_cli([cmd, runs["rope-tiny"], "--device", "cpu", "--depth", "2"], capsys)
    assert_one_line(code, err, "no depth to change")
