"""phaseloop eval / generate --exit (issue 25, early_exit.py): the sweep's first row (no
rule) and eps = 0 equal a plain eval exactly; ACT at its trained threshold too; generate
with and without the cache gives the same text; bad rules and stacks are one line, exit 2."""


import pytest
from conftest import assert_one_line, cli_json, run_cli, tiny_runs

from phaseloop.analysis import plots
from phaseloop.cli import main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tiny_runs(tmp_path_factory.mktemp("exit_cli"), ("looped-tiny", "rope-tiny", "universal-act-tiny"))


_json = cli_json


def test_eval_exit_sweep(runs, capsys):
    run = runs["looped-tiny"]
    common = ["eval", run, "--windows", "4", "--device", "cpu"]
    plain = _json([*common, "--json"], capsys)
    rows = _json([*common, "--json", "--exit", "kl:0,1e9", "--exit", "state:0"], capsys)
    assert [r["label"] for r in rows] == ["none", "kl:0", "kl:1e+09", "state:0"]
    none, kl0, kl_all, state0 = rows
    for r in (none, kl0, state0):  # no exit: the plain eval exactly, at the full depth
        assert (r["val_loss"], r["val_bpb"], r["depth"]) == (plain["val_loss"], plain["val_bpb"], 2)
    assert none["flops_saved"] == 0 and state0["flops_per_token"] == none["flops_per_token"]
    assert kl0["flops_per_token"] > none["flops_per_token"]  # the readouts cost, nothing is saved
    assert kl_all["depth"] == 1 and kl_all["flops_saved"] > 0 and kl_all["loss_change"] != 0
    assert main([str(a) for a in [*common, "--exit", "argmax:1", "--depth", "3"]]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "saved" in table[1] and table[2].split()[:2] == ["none", "3.000"]
    assert table[-1].startswith("argmax: ")
    if plots.available():
        png = run / "exit.png"
        assert main([str(a) for a in [*common, "--exit", "kl:1e-2,1", "--plot", png]]) == 0
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_act_threshold_sweep(runs, capsys):
    common = ["eval", runs["universal-act-tiny"], "--windows", "2", "--device", "cpu", "--json"]
    plain = _json(common, capsys)
    rows = _json([*common, "--exit", "act:0.99,0.1"], capsys)  # the tiny preset's 1 - act_epsilon
    assert rows[0]["val_loss"] == rows[1]["val_loss"] == plain["val_loss"]
    assert rows[2]["depth"] <= rows[1]["depth"] and rows[2]["flops_per_token"] <= rows[1]["flops_per_token"]


def test_generate_with_exit(runs, capsys):
    base = ["generate", str(runs["looped-tiny"]), "--max-new-tokens", "6", "--temperature", "0",
            "--device", "cpu", "--prompt", "the quick"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--exit", "kl:0"]) == 0
    assert capsys.readouterr().out == plain
    outs = []
    for extra in ([], ["--no-cache"]):
        assert main([*base, "--exit", "argmax:1", *extra]) == 0
        outs.append(capsys.readouterr())
    assert outs[0].out == outs[1].out  # same exit decisions with and without the cache
    assert "mean depth" in outs[0].err


@pytest.mark.parametrize("cmd,run,extra,pattern", [
    ("eval", "looped-tiny", ["--exit", "foo:1"], "unknown exit rule"),
    ("eval", "looped-tiny", ["--exit", "kl:-1"], "out of range"),
    ("eval", "looped-tiny", ["--exit", "argmax:x"], "not a number"),
    ("eval", "looped-tiny", ["--exit", "kl:1e-3", "--depth", "1,2"], "one --depth"),
    ("eval", "looped-tiny", ["--exit", "act:0.9"], "has no ACT"),
    ("eval", "universal-act-tiny", ["--exit", "kl:1e-3"], "halts by ACT"),
    ("eval", "rope-tiny", ["--exit", "kl:1e-3"], "stack of distinct layers"),
    ("generate", "looped-tiny", ["--exit", "kl:1e-3,1e-2"], "give one value"),
    ("generate", "rope-tiny", ["--exit", "state:0.1"], "stack of distinct layers"),
    ("generate", "looped-tiny", ["--exit", "argmax:99999999999999999999"], "K passes from 1 to 4096"),
    ("eval", "looped-tiny", ["--exit", "argmax:1", "--exit", "argmax:1"], "--exit argmax:1: given twice"),
])
def test_bad_exits_one_line(runs, capsys, cmd, run, extra, pattern):
    code, err = run_cli([cmd, runs[run], "--device", "cpu", *extra], capsys)
    assert_one_line(code, err, pattern)
