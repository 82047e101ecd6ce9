"""phaseloop generate --json / --kv-fill / --kv-share / --speculative and eval --kv-share
(issue 39, inference.py): the figures generate reports, speculation's greedy text is the
plain greedy text, the K = full row of eval --kv-share is the plain eval, ACT's exit rows
are measured against its first row; bad options and stacks are one line, exit 2."""

import pytest
from conftest import assert_one_line, cli_json, run_cli, tiny_runs

from phaseloop.cli import main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tiny_runs(tmp_path_factory.mktemp("inference_cli"), ("looped-tiny", "rope-tiny", "universal-act-tiny"))


def _gen(runs, *extra, run="looped-tiny"):
    return ["generate", runs[run], "--max-new-tokens", "8", "--temperature", "0", "--device", "cpu",
            "--prompt", "the qu", "--depth", "4", *extra]


def test_generate_json(runs, capsys):
    plain = cli_json([*_gen(runs), "--json"], capsys)
    assert len(plain["tokens"]) == 8 and plain["text"] and plain["tokens_per_s"] > 0
    assert plain["mean_passes"] == plain["depth"] == 4 and len(plain["passes"]) == 8
    assert plain["kv_cache_bytes"] > 0 and "acceptance" not in plain
    spec = cli_json([*_gen(runs), "--json", "--speculative", "1", "--draft-tokens", "3"], capsys)
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"]  # greedy: identical
    assert 0 <= spec["acceptance"] <= 1 and spec["rounds"] >= 1 and spec["draft_passes"] == 1
    shared = cli_json([*_gen(runs), "--json", "--kv-share", "1"], capsys)
    assert shared["kv_cache_bytes"] < plain["kv_cache_bytes"]
    # sampled, and tokens exiting after 2 and 3 of 4 passes: later tokens read the deepest keys
    latest = [cli_json([*_gen(runs), "--json", "--exit", "kl-lens:1e-3", "--kv-fill", "latest", "--temperature",
                        "1", "--seed", "3", *extra], capsys) for extra in ([], ["--no-cache"])]
    assert latest[0]["tokens"] == latest[1]["tokens"] and latest[0]["passes"] == latest[1]["passes"]
    assert len(set(latest[0]["passes"])) > 1 and latest[0]["mean_passes"] < 4
    stack = cli_json(["generate", runs["rope-tiny"], "--max-new-tokens", "3", "--device", "cpu", "--json"], capsys)
    assert stack["mean_passes"] is None and stack["depth"] is None and len(stack["tokens"]) == 3  # no passes
    assert main([str(a) for a in _gen(runs, "--speculative", "2")]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("the qu" + plain["text"]) and "accepted" in out.err


def test_eval_kv_share_sweep(runs, capsys):
    common = ["eval", runs["looped-tiny"], "--windows", "2", "--seq-len", "16", "--device", "cpu", "--json"]
    plain = cli_json(common, capsys)
    rows = cli_json([*common, "--kv-share", "1,2,full"], capsys)
    assert [r["kv_share"] for r in rows] == [1, 2, "full"]
    assert rows[2]["val_loss"] == pytest.approx(plain["val_loss"], abs=1e-5)  # token by token = full pass
    assert rows[2]["bytes_ratio"] == 1 and rows[0]["kv_cache_bytes"] <= rows[1]["kv_cache_bytes"]
    assert rows[0]["val_loss"] != rows[2]["val_loss"]
    without = cli_json([*common, "--kv-share", "1,2"], capsys)  # the reference row is always there
    assert [r["kv_share"] for r in without] == [1, 2, "full"] and without[0]["bytes_ratio"] == rows[0]["bytes_ratio"]


def test_eval_kv_share_plot_against_the_slots(runs, capsys, tmp_path, monkeypatch):
    """--plot with --kv-share (no --depth needed): loss against K, 'full' at the passes."""
    pytest.importorskip("matplotlib")
    from phaseloop.analysis import plots

    drawn = {}
    monkeypatch.setattr(plots, "plot_depth_sweep", lambda rows, path, title, xlabel, group, x: drawn.update(
        xs=[r[x] for r in rows], xlabel=xlabel))
    rows = cli_json(["eval", runs["looped-tiny"], "--windows", "2", "--seq-len", "16", "--device", "cpu", "--json",
                     "--kv-share", "1,2,full", "--plot", str(tmp_path / "k.png")], capsys)
    assert drawn["xs"] == [1, 2, rows[2]["depth"]] and "slots" in drawn["xlabel"]


def test_act_exit_rows_against_the_first_row(runs, capsys):
    common = ["eval", runs["universal-act-tiny"], "--windows", "2", "--device", "cpu", "--json"]
    rows = cli_json([*common, "--exit", "act:0.5,0.1"], capsys)
    assert rows[0]["flops_saved"] == 0 and rows[0]["loss_change"] == 0
    for r in rows[1:]:
        assert r["flops_saved"] == pytest.approx(1 - r["flops_per_token"] / rows[0]["flops_per_token"])


@pytest.mark.parametrize("argv,pattern", [
    (["generate", "rope-tiny", "--kv-share", "1"], "stack of distinct layers"),
    (["generate", "rope-tiny", "--speculative", "1"], "stack of distinct layers"),
    (["generate", "looped-tiny", "--speculative", "2"], "the draft runs 1 .. 1 passes"),
    (["generate", "looped-tiny", "--speculative", "1", "--exit", "kl:1"], "drop --exit"),
    (["generate", "looped-tiny", "--kv-fill", "latest"], "add --exit"),
    (["generate", "universal-act-tiny", "--exit", "act:0.5", "--kv-fill", "latest"], "no pass is skipped"),
    (["generate", "looped-tiny", "--kv-share", "0"], "out of range"),
    (["eval", "rope-tiny", "--kv-share", "1"], "stack of distinct layers"),
    (["eval", "looped-tiny", "--kv-share", "1,x"], "e.g. 1,2,full"),
    (["eval", "looped-tiny", "--kv-share", "1", "--exit", "kl:1"], "one at a time"),
    (["eval", "looped-tiny", "--kv-fill", "latest"], "applies with --exit"),
    (["generate", "looped-tiny", "--draft-tokens", "3"], "applies with --speculative"),
    (["generate", "rope-tiny", "--draft-tokens", "3"], "applies with --speculative"),
    (["generate", "looped-tiny", "--kv-share", "1", "--no-cache"], "drop --no-cache"),
    (["generate", "looped-tiny", "--speculative", "1", "--kv-share", "1"], "drop --kv-share"),
])
def test_bad_options_one_line(runs, capsys, argv, pattern):
    code, err = run_cli([argv[0], runs[argv[1]], "--device", "cpu", *argv[2:]], capsys)
    assert_one_line(code, err, pattern)


def test_sizes_that_would_allocate_millions_of_positions_are_refused_or_grown(runs, capsys):
    """--draft-tokens 100000000 and --max-new-tokens 2000000000 asked for 6.4 and 16 GB up front (a
    raw allocator error, rc 1); serve --max-context had no bound. Now: refused in one line, and a
    cache preallocates at most kvcache.PREALLOCATE positions (it grows as it is written)."""
    from phaseloop.kvcache import PREALLOCATE, KVCache

    code, err = run_cli([*_gen(runs), "--speculative", "1", "--draft-tokens", "100000000"], capsys)
    assert_one_line(code, err, "must be an integer from 1 to 64")
    code, err = run_cli([*_gen(runs)[:-2], "--max-new-tokens", "2000000000"], capsys)
    assert code == 2 and "prompt + max_new_tokens = 2,000,000,006 positions: at most 16,777,216" in err
    assert "Traceback" not in err
    code, err = run_cli(["serve", runs["looped-tiny"], "--max-context", "100000000"], capsys)
    assert code == 2 and "must be an integer from 2 to 16,777,216" in err
    assert KVCache(capacity=10**7).capacity == PREALLOCATE and KVCache(capacity=100).capacity == 100
    # speculation's cache: no room for more drafted tokens than the new tokens asked
    few, many = (cli_json([*_gen(runs), "--max-new-tokens", "5", "--json", "--speculative", "1", "--draft-tokens", k],
                          capsys)["kv_cache_bytes"] for k in ("5", "64"))
    assert few == many
