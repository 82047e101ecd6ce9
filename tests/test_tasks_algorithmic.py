"""Algorithmic task generators, length parsing, offsets, vocab, metrics and JSONL loading."""

import json

import pytest
import torch

from phaseloop.tasks import (
    PAPER_TEST_LENGTHS,
    PAPER_TRAIN_LENGTHS,
    TASKS,
    CharVocab,
    Example,
    TaskSpec,
    char_accuracy,
    load_jsonl,
    make_examples,
    parse_lengths,
    per_length_metrics,
    position_offsets,
    prefix_parity,
    save_jsonl,
    sequence_accuracy,
)
from phaseloop.tasks.algorithmic import LTE_TASKS

# ----------------------------------------------------------------- generators


def test_copy_and_reverse_targets():
    for ex in make_examples("copy", 50, (1, 12), seed=3):
        assert ex.target == ex.input and len(ex.input) == ex.length
    for ex in make_examples("reverse", 50, (1, 12), seed=3, vocab="abc"):
        assert ex.target == ex.input[::-1] and len(ex.input) == ex.length
        assert set(ex.input) <= set("abc")


def test_addition_is_integer_addition():
    exs = make_examples("addition", 200, (1, 30), seed=7)
    for ex in exs:
        a, b = ex.input.split("+")
        assert len(a) == len(b) == ex.length and a.isdigit() and b.isdigit()
        assert len(ex.target) == ex.length + 1
        assert int(ex.target) == int(a) + int(b)
    # some sums carry into the extra digit, some do not
    assert {ex.target[0] for ex in exs} == {"0", "1"}


def test_lte_memorisation_targets():
    """The learning-to-execute memorisation tasks (Zaremba & Sutskever 2014; UT §3.5): the
    input is a number of exactly `length` digits (no leading zero); double is checked with
    Python's int arithmetic and keeps no padding (L or L + 1 digits)."""
    for task in LTE_TASKS:
        exs = make_examples(task, 300, (1, 30), seed=5)
        assert {ex.length for ex in exs} == set(range(1, 31))
        for ex in exs:
            assert len(ex.input) == ex.length and ex.input.isdigit() and ex.input[0] != "0"
            assert ex.target.isdigit()
            if task == "lte-copy":
                assert ex.target == ex.input
            elif task == "lte-reverse":
                assert ex.target == ex.input[::-1]
            else:
                assert int(ex.target) == 2 * int(ex.input) and ex.target[0] != "0"
                assert len(ex.target) == ex.length + (ex.input[0] >= "5")
        if task == "lte-double":  # both target lengths occur
            assert {len(ex.target) - ex.length for ex in exs} == {0, 1}
    assert {e.input[0] for e in make_examples("lte-copy", 200, [1], seed=0)} == set("123456789")
    with pytest.raises(ValueError, match="fixed symbols"):
        make_examples("lte-double", 1, vocab="ab")


def test_lte_task_runs_end_to_end_from_the_cli(tmp_path, capsys):
    from phaseloop.cli import main

    out = tmp_path / "run"
    rc = main(["task", "--task", "lte-double", "--arch", "rope", "--set", "d_model=32",
               "--set", "n_heads=2", "--set", "n_kv_heads=2", "--set", "d_ff=64",
               "--train-len", "2-3", "--test-len", "3,4", "--steps", "2", "--batch-size", "4",
               "--n-test", "3", "--out", str(out), "--quiet"])
    assert rc == 0
    assert "char acc" in capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    assert m["task"] == "lte-double" and set(m["summary"]["per_length"]) == {"3", "4"}
    for ex in m["per_seed"][0]["examples"]:
        assert int(ex["target"]) == 2 * int(ex["input"])


def test_parity_targets_are_prefix_xors():
    assert prefix_parity("0110") == "0100"
    assert prefix_parity("1111") == "1010"
    for ex in make_examples("parity", 50, (1, 16), seed=0):
        acc = 0
        for i, c in enumerate(ex.input):
            acc ^= int(c)
            assert int(ex.target[i]) == acc
        assert len(ex.target) == len(ex.input) == ex.length


def test_lengths_respected_range_and_list():
    for task in TASKS:
        exs = make_examples(task, 300, (3, 6), seed=1)
        assert {ex.length for ex in exs} == {3, 4, 5, 6}
        exs = make_examples(task, 40, [40, 80], seed=1)
        assert {ex.length for ex in exs} == {40, 80}
    bal = make_examples("copy", 7, [5, 2], seed=0, balanced=True)
    assert [ex.length for ex in bal] == [2, 5, 2, 5, 2, 5, 2]
    assert {ex.length for ex in make_examples("copy", 5, parse_lengths("1-20"), 0)} <= set(range(1, 21))


def test_determinism_and_seed_sensitivity():
    for task in TASKS:
        a = make_examples(task, 20, (1, 20), seed=11)
        b = make_examples(task, 20, (1, 20), seed=11)
        c = make_examples(task, 20, (1, 20), seed=12)
        assert a == b
        assert a != c


def test_taskspec_paper_setting_and_splits():
    spec = TaskSpec.paper("reverse")
    assert spec.max_length == 400
    train, test = spec.train(4, seed=0), spec.test(4, seed=0)
    assert {e.length for e in train} == set(PAPER_TRAIN_LENGTHS)
    assert {e.length for e in test} == set(PAPER_TEST_LENGTHS)
    small = TaskSpec("copy")
    assert max(e.length for e in small.train(100)) <= 20
    assert min(e.length for e in small.test(4)) >= 40


def test_bad_task_and_vocab_args():
    with pytest.raises(ValueError, match="unknown task 'sort'"):
        make_examples("sort", 1)
    with pytest.raises(ValueError, match="fixed symbols"):
        make_examples("parity", 1, vocab="ab")
    with pytest.raises(ValueError, match="backwards"):
        make_examples("copy", 1, (5, 2))


# ----------------------------------------------------------------- lengths


def test_parse_lengths():
    assert parse_lengths("1-20") == range(1, 21)
    assert list(parse_lengths(" 40 - 400 ")) == list(range(40, 401))
    assert parse_lengths("40,80") == [40, 80]
    assert parse_lengths("40") == [40]
    assert parse_lengths("1-3,10,2") == [1, 2, 3, 10]


@pytest.mark.parametrize("bad", ["", "abc", "1-", "20-1", "0", "4,,5", "1-2-3", "-5", "4.5"])
def test_parse_lengths_errors_name_the_text(bad):
    with pytest.raises(ValueError) as ei:
        parse_lengths(bad)
    assert repr(bad) in str(ei.value)


# ----------------------------------------------------------------- offsets & vocab


def test_position_offsets():
    g = torch.Generator().manual_seed(0)
    off = position_offsets(1000, 360, g)
    assert off.shape == (1000,) and off.dtype == torch.long
    assert int(off.min()) >= 0 and int(off.max()) <= 360 and int(off.max()) > 300
    again = position_offsets(1000, 360, torch.Generator().manual_seed(0))
    assert torch.equal(off, again)
    assert torch.equal(position_offsets(5, 0), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError):
        position_offsets(3, -1)


def test_char_vocab_roundtrip_and_specials():
    v = CharVocab()
    assert (v.pad_id, v.eos_id, v.sep_id) == (0, 1, 2)
    assert len(v) == 3 + 11
    ids = v.encode("12+9", add_eos=True)
    assert ids[-1] == v.EOS and min(ids[:-1]) >= 3
    assert v.decode(ids + [5, 6]) == "12+9"  # stops at EOS
    assert v.decode([v.PAD] + ids[:-1] + [v.PAD]) == "12+9"
    ex = make_examples("addition", 1, [3], seed=0)[0]
    from phaseloop.tasks.task_model import decoder_batch, encode_pairs

    idx, tgt = decoder_batch(encode_pairs([ex], v))  # input + SEP + target + EOS, shifted
    assert idx[0].tolist().count(v.SEP) == 1 and tgt[0, -1] == v.EOS
    assert v.decode(tgt[0][tgt[0] != -100]) == ex.target
    with pytest.raises(ValueError, match="'x'"):
        v.encode("1x")
    v2 = CharVocab.for_examples(make_examples("copy", 5, [4], 0, vocab="xyz"))
    assert set(v2.symbols) <= set("xyz")


# ----------------------------------------------------------------- metrics


def test_char_and_sequence_accuracy_hand_cases():
    assert char_accuracy(["abc"], ["abc"]) == 1.0
    assert char_accuracy(["abd"], ["abc"]) == pytest.approx(2 / 3)
    assert char_accuracy(["ab"], ["abc"]) == pytest.approx(2 / 3)  # missing char is wrong
    assert char_accuracy(["abcd"], ["abc"]) == pytest.approx(3 / 4)  # extra char is wrong
    assert char_accuracy(["", "xy"], ["ab", "xy"]) == pytest.approx(2 / 4)  # micro average
    assert char_accuracy([""], [""]) == 1.0
    assert sequence_accuracy(["abc", "ab", "x"], ["abc", "abc", "x"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        char_accuracy(["a"], ["a", "b"])
    with pytest.raises(ValueError):
        sequence_accuracy([], [])


def test_per_length_metrics_and_mean_std():
    exs = [Example("ab", "ab", 2), Example("cd", "dc", 2), Example("xyz", "zyx", 3)]
    m = per_length_metrics(exs, ["ab", "dd", "zyx"])
    assert list(m) == [2, 3]
    assert m[2] == {"char_acc": pytest.approx(3 / 4), "seq_acc": 0.5, "n": 2}
    assert m[3] == {"char_acc": 1.0, "seq_acc": 1.0, "n": 1}


def test_mean_std_population_for_task_metrics_sample_for_seeds():
    """One mean_std (analysis.stats): the population std task metrics report (ddof=0: one
    value -> 0.0) and the sample std over seeds comparisons report (ddof=1: one value ->
    None); values that are None are left out; no values -> (None, None)."""
    from phaseloop.analysis.stats import mean_std

    assert mean_std([1, 2, 3, 4], ddof=0) == (pytest.approx(2.5), pytest.approx(1.118033988749895))
    assert mean_std([1, 2, 3, 4]) == (pytest.approx(2.5), pytest.approx(1.2909944487358056))
    assert mean_std([7], ddof=0) == (7.0, 0.0) and mean_std([7]) == (7.0, None)
    assert mean_std([1, None, 3]) == (2.0, pytest.approx(2 ** 0.5))
    assert mean_std([]) == mean_std([None]) == (None, None)


# ----------------------------------------------------------------- JSONL


def _write(tmp_path, text, name="data.jsonl"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_jsonl_good_file_with_blank_lines(tmp_path):
    p = _write(
        tmp_path,
        '{"input": "abc", "target": "cba"}\n\n   \n{"input": "1+1", "target": "2", "length": 1, "x": 0}\n',
    )
    exs = load_jsonl(p)
    assert exs == [Example("abc", "cba", 3), Example("1+1", "2", 1)]
    out = tmp_path / "round.jsonl"
    assert save_jsonl(out, exs) == 2
    assert load_jsonl(out) == exs


GOOD = '{"input": "a", "target": "b"}\n'


@pytest.mark.parametrize(
    "bad_line, lineno, words, fix",
    [
        ('{"input": "a", "target": }', 3, "invalid JSON (Expecting value at column 26)",
         '{"input": "abc", "target": "cba"}'),
        ('{"input": "ab"', 3, "invalid JSON (Expecting ',' delimiter at column 15)",  # not "column 1" of
         '{"input": "abc", "target": "cba"}'),                                        # the newline's "line 2"
        ('{"input": "a"}', 3, "missing key 'target'", 'add "target"'),
        ('{"target": "a"}', 3, "missing key 'input'", 'add "input"'),
        ('{"input": 12, "target": "a"}', 3, "'input' must be a string, got number 12", "double quotes"),
        ('{"input": "a", "target": null}', 3, "'target' must be a string, got null", "double quotes"),
        ('["a", "b"]', 3, "expected a JSON object, got array", '{"input": "abc", "target": "cba"}'),
        ('{"input": "a", "target": "b", "length": -1}', 3, "'length'", "remove the key"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, lineno, words, fix):
    # line 1 good, line 2 blank, line 3 bad, line 4 good
    p = _write(tmp_path, GOOD + "\n" + bad_line + "\n" + GOOD)
    with pytest.raises(ValueError) as ei:
        load_jsonl(p)
    msg = str(ei.value)
    assert f"{p}:{lineno}:" in msg
    assert words in msg
    assert "\n" not in msg
    assert fix in msg.split("; ", 1)[1]  # problem; fix


def test_jsonl_bad_line_number_counts_blank_lines(tmp_path):
    p = _write(tmp_path, GOOD * 4 + "\n\n" + "not json\n")
    with pytest.raises(ValueError, match=r":7: invalid JSON"):
        load_jsonl(p)


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_jsonl_empty_file(tmp_path, text):
    p = _write(tmp_path, text)
    with pytest.raises(ValueError) as ei:
        load_jsonl(p)
    assert f"{p}:1:" in str(ei.value) and "no examples" in str(ei.value)


def test_jsonl_bad_utf8_and_missing_file(tmp_path):
    p = tmp_path / "bin.jsonl"
    p.write_bytes(GOOD.encode() + b'{"input": "\xff", "target": "a"}\n')
    with pytest.raises(ValueError, match=r":2: not valid UTF-8"):
        load_jsonl(p)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    assert json.loads(GOOD)  # sanity of the fixture


def test_test_examples_are_drawn_apart_from_the_training_ones():
    """At the same lengths the test set is drawn from its own stream (seed 2s + 1, train 2s):
    of 50 reversed strings of length 12, none of the test ones is a training one."""
    from phaseloop.tasks.algorithmic import TaskSpec

    s = TaskSpec("reverse", train_lengths=[12], test_lengths=[12])
    tr, te = s.train(50, seed=3), s.test(50, seed=3)
    assert not {e.input for e in te} & {e.input for e in tr}
