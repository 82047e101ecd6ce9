"""phaseloop eval / generate --depth (issue 25): the sweep's trained-depth row is a plain
eval exactly; bad depths and stacks are one line, exit 2."""

import json

import pytest
from conftest import assert_one_line, cli_json, run_cli, tiny_runs

from phaseloop.analysis import plots
from phaseloop.cli import main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tiny_runs(tmp_path_factory.mktemp("depth_cli"), ("hyperloop-tiny", "rope-tiny", "universal-act-tiny"))


_json = cli_json


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
    if plots.available():
        png = run / "sweep.png"
        assert main(["eval", str(run), "--windows", "2", "--device", "cpu", "--depth", "1,2",
                     "--plot", str(png)]) == 0
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_universal_act_sweep(runs, capsys):
    common = ["eval", runs["universal-act-tiny"], "--windows", "2", "--device", "cpu", "--json"]
    plain = _json(common, capsys)
    rows = _json([*common, "--depth", "2,4,6"], capsys)  # universal-act-tiny: 4 steps
    assert rows[1]["val_loss"] == plain["val_loss"] and rows[1]["val_bpb"] == plain["val_bpb"]
    # ACT on the meta device runs to the step limit: the FLOPs are an upper bound per depth
    assert rows[0]["flops_per_token"] < rows[1]["flops_per_token"] < rows[2]["flops_per_token"]


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
    ("eval", ["--extend-loops", "last"], "apply with --depth"),
    ("eval", ["--plot", "x.png"], "apply with --depth"),
    ("eval", ["--depth", "1,2", "--plot", "/"], "--plot / is a folder; name the PNG file"),
    ("eval", ["--depth", "1,2", "--plot", "/proc/version/x.png"], "--plot /proc/version is a file, not a folder"),
    ("generate", ["--exit", "kl:0.1", "--exit", "argmax:2"], "--exit: given twice"),
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


def test_export_at_a_depth_equals_the_native_model_there(runs, tmp_path, capsys):
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from phaseloop.depth import set_model_depth
    from phaseloop.engine.checkpoint import load_run

    run = runs["hyperloop-tiny"]
    out = tmp_path / "hf3"
    assert main(["export", str(run), "--out", str(out), "--depth", "3", "--extend-loops", "last"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["phaseloop_depth"], cfg["phaseloop_extend_loops"]) == (3, "last")
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.model.trunk.loops == 3
    native, _ = load_run(run, "cpu")
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = native(idx).logits
        set_model_depth(native, 3, "last")
        want = native(idx).logits
        got = hf(idx).logits
    assert torch.equal(got, want) and not torch.equal(got, plain)
    capsys.readouterr()  # HF's cached generate = phaseloop generate at that depth
    assert main(["generate", str(run), "--prompt", "the quick", "--temperature", "0", "--device", "cpu",
                 "--max-new-tokens", "12", "--depth", "3", "--extend-loops", "last"]) == 0
    want_text = capsys.readouterr().out.rstrip("\n")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("the quick", return_tensors="pt").input_ids
    assert tok.decode(hf.generate(ids, max_new_tokens=12, do_sample=False)[0]) == want_text
    plain_out = tmp_path / "hf"
    assert main(["export", str(run), "--out", str(plain_out)]) == 0
    assert "phaseloop_depth" not in json.loads((plain_out / "config.json").read_text())
    capsys.readouterr()
    for extra, pattern in ((["--depth", "3"], "extend='last'"), (["--extend-loops", "last"], "applies with --depth")):
        code, err = run_cli(["export", run, "--out", tmp_path / "bad", *extra], capsys)
        assert_one_line(code, err, pattern)
        assert not (tmp_path / "bad").exists()
    code, err = run_cli(["export", runs["rope-tiny"], "--out", tmp_path / "bad", "--depth", "2"], capsys)
    assert_one_line(code, err, "no depth to change")


def test_lm_eval_depth_refusals(runs, capsys, data_dir):  # tasks resolve first, then the model
    pytest.importorskip("lm_eval")
    base = ["lm-eval", "--tasks", "wikitext2_local", "--device", "cpu"]
    code, err = run_cli([base[0], runs["rope-tiny"], *base[1:], "--depth", "2"], capsys)
    assert_one_line(code, err, "no depth to change")
    code, err = run_cli([base[0], runs["hyperloop-tiny"], *base[1:], "--depth", "4"], capsys)
    assert_one_line(code, err, "extend='last'")
    code, err = run_cli([base[0], runs["hyperloop-tiny"], *base[1:], "--depth", "0"], capsys)
    assert_one_line(code, err, "out of range")
