"""Task commands on awkward input: an empty jsonl: path, a --test-file or --n-test that
does not apply, examples longer than a max_seq_len the user set (refused before
training, naming the example and the fix) or than the preset's (raised, and said so),
the lengths a JSONL run reports, and the label of an ACT model."""

import json

import pytest

from phaseloop.cli import main
from phaseloop.config import ModelConfig
from phaseloop.tasks import Example
from phaseloop.tasks.positions import positions_needed
from phaseloop.tasks.report import format_babi_table, format_table, length_span, model_label, task_title
from phaseloop.tasks.runner import task_model_config

TINY_SET = ["--set", "d_model=32", "--set", "n_heads=2", "--set", "n_kv_heads=2", "--set", "d_ff=64"]


def _write_jsonl(path, inputs, **extra):
    path.write_text("".join(json.dumps({"input": s, "target": s[::-1], **extra}) + "\n" for s in inputs))
    return path


@pytest.fixture
def pairs(tmp_path):
    return _write_jsonl(tmp_path / "pairs.jsonl", ["ab", "abc", "ba", "cab", "abca", "bca", "cc", "bacab"])


def one_line_error(capsys, rc: int) -> str:
    """Exit status 2 and exactly one line on stderr, the phaseloop error (no traceback)."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("phaseloop: error: "), err
    return lines[0]


# ----------------------------------------------------------------------------- bad input
def test_empty_jsonl_path_says_so(tmp_path, capsys):
    for task in ("jsonl:", "jsonl:  "):
        err = one_line_error(capsys, main(["task", "--task", task, "--out", str(tmp_path / "r"), "--quiet"]))
        assert "empty path" in err and "--task jsonl:PATH/TO/FILE.jsonl" in err and "folder" not in err


def test_empty_test_file_path_says_so(pairs, tmp_path, capsys):
    err = one_line_error(capsys, main(["task", "--task", f"jsonl:{pairs}", "--test-file", "", "--steps", "1",
                                       "--out", str(tmp_path / "r"), "--quiet"]))
    assert "--test-file has an empty path" in err and "folder" not in err


@pytest.mark.parametrize("extra, words", [(["--test-file", "PAIRS"], "--test-file applies to jsonl"),
                                          (["--n-test", "0"], "--n-test 0"),
                                          (["--n-test", "-3"], "--n-test -3"),
                                          (["--n-test", "100000000000"], "1 .. 100,000 examples"),
                                          (["--train-len", "\u00b2"], "'\u00b2' is not a length"),
                                          (["--out", ""], "--out '': name a folder")])
def test_options_that_do_not_apply_are_refused(extra, words, pairs, tmp_path, capsys):
    extra = [str(pairs) if a == "PAIRS" else a for a in extra]
    out = [] if "--out" in extra else ["--out", str(tmp_path / "r")]
    err = one_line_error(capsys, main(["task", "--task", "copy", *extra, "--steps", "1", *out, "--quiet"]))
    assert words in err


def test_jsonl_tasks_refuse_n_test(pairs, tmp_path, capsys):
    """A JSONL task tests its whole test file: --n-test (which it ignored) is refused by name."""
    err = one_line_error(capsys, main(["task", "--task", f"jsonl:{pairs}", "--n-test", "1", "--steps", "1",
                                       "--out", str(tmp_path / "r"), "--quiet"]))
    assert err.startswith("phaseloop: error: --n-test: ") and "drop it" in err


def test_text_commands_refuse_a_task_run_in_one_line(tmp_path, capsys):
    """A task run's ids are the task's own symbols: generate, eval and export refuse it by
    name (before: bytes read it, past its 13-symbol embedding, an IndexError traceback)."""
    out = tmp_path / "r"
    assert main(["task", "--task", "copy", "--train-len", "1-3", "--test-len", "3", "--n-test", "5", *TINY_SET,
                 "--steps", "1", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    run = str(out / "seed-0")
    for argv in (["generate", run, "--prompt", "ab"], ["eval", run], ["export", run, "--out", str(tmp_path / "hf")]):
        err = one_line_error(capsys, main(argv))
        assert "is a task run" in err and "task 'copy'" in err and "phaseloop task" in err, argv
    assert not (tmp_path / "hf").exists()


def test_a_finished_seed_resumed_says_it_is_reloaded(tmp_path, capsys):
    argv = ["task", "--task", "copy", "--train-len", "1-2", "--test-len", "2", "--n-test", "3", *TINY_SET,
            "--steps", "1", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    assert "[seed 0] training " in capsys.readouterr().out
    assert main(argv + ["--resume"]) == 0
    out = capsys.readouterr().out
    assert "[seed 0] reloading (finished) " in out and "[seed 0] training" not in out


def test_jsonl_example_longer_than_set_max_seq_len_is_refused_before_training(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "long.jsonl", ["ab", "ba", "abcabcabcabc", "cab"])
    out = tmp_path / "r"
    err = one_line_error(capsys, main(["task", "--task", f"jsonl:{data}", "--test-file", str(data), *TINY_SET,
                                       "--set", "max_seq_len=16", "--steps", "1", "--out", str(out), "--quiet"]))
    # input 12 + SEP + target 12 + EOS = 26 positions
    assert "max_seq_len=16" in err and '"abcabcabcabc"' in err and "needs 26 positions" in err
    assert "--set max_seq_len=26" in err
    assert not (out / "seed-0").exists()  # nothing trained


def test_algorithmic_test_len_beyond_set_max_seq_len_is_refused(tmp_path, capsys):
    out = tmp_path / "r"
    err = one_line_error(capsys, main(["task", "--task", "copy", *TINY_SET, "--set", "max_seq_len=16",
                                       "--train-len", "2", "--test-len", "12", "--n-test", "2", "--steps", "1",
                                       "--out", str(out), "--quiet"]))
    assert "test example 1 of 2" in err and "--set max_seq_len=26" in err and "--test-len" in err
    assert not (out / "seed-0").exists()


def test_offsets_count_toward_a_set_max_seq_len(tmp_path, capsys):
    err = one_line_error(capsys, main(["task", "--task", "copy", *TINY_SET, "--set", "max_seq_len=8",
                                       "--train-len", "2", "--test-len", "2", "--n-test", "2", "--offsets", "4",
                                       "--steps", "1", "--out", str(tmp_path / "r"), "--quiet"]))
    # train: 2 + SEP + 2 + EOS = 6, started up to 4 late -> 10
    assert "train example" in err and "--set max_seq_len=10" in err and "--offsets" in err


def test_babi_story_longer_than_set_max_seq_len_is_refused(data_dir, tmp_path, capsys):
    out = tmp_path / "r"
    # task 1's stories fit in 100 positions, task 3's (whole stories) do not: no model trains
    err = one_line_error(capsys, main(["babi", "--tasks", "1,3", "--data-dir", str(data_dir / "babi" / "en-1k"),
                                       *TINY_SET, "--set", "max_seq_len=100", "--max-sentences", "all",
                                       "--n-test", "2", "--steps", "1", "--out", str(out), "--quiet"]))
    assert "max_seq_len=100" in err and "--set max_seq_len=" in err and "--max-sentences" in err
    assert not any(out.glob("seed-0/*/config.json"))


def test_babi_n_test_below_one_is_refused(tmp_path, capsys):
    err = one_line_error(capsys, main(["babi", "--tasks", "1", "--n-test", "0", "--out", str(tmp_path / "r"),
                                       "--quiet"]))
    assert "--n-test 0" in err


# ----------------------------------------------------------------------------- max_seq_len
def test_preset_max_seq_len_is_raised_to_fit_and_said(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["task", "--task", "copy", *TINY_SET, "--train-len", "2", "--test-len", "32", "--n-test", "2",
                 "--steps", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    # rope-tiny has max_seq_len 64; a test example needs 32 + SEP + 32 + EOS = 66
    assert "max_seq_len 64 -> 66 to fit the longest example: test example 1 of 2" in text
    assert json.loads((out / "metrics.json").read_text())["max_seq_len"] == 66
    assert json.loads((out / "seed-0" / "config.json").read_text())["model"]["max_seq_len"] == 66


def test_only_a_set_max_seq_len_is_a_limit():
    free, _ = task_model_config("rope", None, {"n_layers": 1})
    fixed, _ = task_model_config("rope", None, {"max_seq_len": 16})
    assert not getattr(free, "_task_fixed_max_seq_len", False)
    assert fixed._task_fixed_max_seq_len and fixed.max_seq_len == 16


def test_positions_needed_per_model_family():
    train = [Example("ab", "ba", 2)]
    test = [Example("abcd", "dc", 4)]
    tr, te = [([3, 4], [4, 3, 1])], [([3, 4, 5, 6], [6, 5, 1])]
    assert positions_needed(train, test, tr, te)[0] == 4 + 1 + 2 + 1  # decoder: input SEP target EOS
    assert positions_needed(train, test, tr, te, seq2seq=True)[0] == 4  # source vs BOS target EOS
    n, where = positions_needed(train, test, tr, te, max_offset=9)
    assert n == 2 + 1 + 2 + 1 + 9 and where.startswith("train example 1 of 1")


# ----------------------------------------------------------------------------- reports
def test_jsonl_report_and_metrics_carry_the_lengths_in_the_files(tmp_path, capsys):
    train = _write_jsonl(tmp_path / "train.jsonl", ["ab", "abc", "ba", "abcab", "ca"])
    test = _write_jsonl(tmp_path / "test.jsonl", ["abcabc", "abcabca"])
    out = tmp_path / "r"
    assert main(["task", "--task", f"jsonl:{train}", "--test-file", str(test), *TINY_SET, "--steps", "2",
                 "--out", str(out), "--quiet"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert (m["train_lengths"], m["test_lengths"]) == ("2-5", "6-7")
    run_task = json.loads((out / "seed-0" / "config.json").read_text())["task"]
    assert (run_task["train_lengths"], run_task["test_lengths"]) == ("2-5", "6-7")
    title = format_table(m["summary"], task_title(m)).splitlines()[0]
    assert "| rope |" in title and "train 2-5 | test 6-7 |" in title and "1-20" not in title


def test_jsonl_held_out_part_and_length_key(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "pairs.jsonl", ["ab", "abc", "ba", "cab", "abca", "bca", "cc", "bacab"],
                        length=3)
    out = tmp_path / "r"
    assert main(["task", "--task", f"jsonl:{data}", *TINY_SET, "--steps", "2", "--out", str(out), "--quiet"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert (m["train_lengths"], m["test_lengths"]) == ("3", "3")  # every line says "length": 3
    assert length_span([Example("a", "a", 4), Example("b", "b", 1)]) == "1-4"


def test_act_run_is_labelled_universal_act(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["task", "--task", "copy", "--arch", "universal", "--set", "act=true", *TINY_SET,
                 "--train-len", "2", "--test-len", "3", "--n-test", "2", "--steps", "2", "--out", str(out)]) == 0
    assert "training universal+act on copy" in capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    assert (m["arch"], m["label"]) == ("universal", "universal+act")
    assert "| universal+act |" in task_title(m)


def test_model_label():
    assert model_label(ModelConfig.from_preset("universal-act-tiny")) == "universal+act"
    assert model_label(ModelConfig.from_preset("universal-tiny")) == "universal"
    act = ModelConfig.from_preset("universal-act-tiny")
    assert model_label(act, "universal-seq2seq") == "universal-seq2seq+act"
    assert model_label(ModelConfig.from_preset("rope-tiny")) == "rope"
    res = {"tasks": [1], "label": "universal+act", "arch": "universal", "joint": False, "seeds": [0],
           "summary": {"errors": {1: (0.5, 0.0)}, "ponder": {}, "answer_ponder": {}, "failed": (1.0, 0.0),
                       "mean_error": (0.5, 0.0)},
           "per_seed": [{"supporting_in_window": {1: 1.0}}]}
    assert "| universal+act |" in format_babi_table(res).splitlines()[0]
