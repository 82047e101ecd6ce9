"""bAbI parser on the real en-1k files, plus the report helpers."""

import os
from pathlib import Path

import pytest
import torch

from phaseloop.tasks import (
    BabiExample,
    TaskDataError,
    failed_tasks,
    format_example,
    load_babi,
    parse_babi,
    parse_babi_file,
    ponder_by_supporting,
    task_error,
)

REPO = Path(__file__).resolve().parents[1]


def _data_dir() -> Path | None:
    for cand in (os.environ.get("PHASELOOP_DATA_DIR"), REPO.parent / "shared" / "data"):
        if cand and (Path(cand) / "babi" / "en-1k").is_dir():
            return Path(cand)
    return None


DATA = _data_dir()
needs_data = pytest.mark.skipif(
    DATA is None, reason="bAbI data not found (set PHASELOOP_DATA_DIR or use ../shared/data)"
)


@pytest.fixture(scope="module")
def en1k() -> Path:
    return DATA / "babi" / "en-1k"


@needs_data
def test_qa1_first_example_and_counts(en1k):
    exs = load_babi(en1k, task=1, split="train")
    assert len(exs) == 1000
    ex = exs[0]
    assert ex.task == 1
    assert ex.story == ["Mary moved to the bathroom.", "John went to the hallway."]
    assert ex.question == "Where is Mary?"
    assert ex.answer == "bathroom"
    assert ex.supporting == [1] and ex.n_supporting == 1
    # second question: story holds statements only (no earlier question), ids kept
    ex2 = exs[1]
    assert ex2.story == ex.story + ["Daniel went back to the hallway.", "Sandra moved to the garden."]
    assert ex2.story_ids == [1, 2, 4, 5]
    assert ex2.supporting == [4] and ex2.supporting_index == [2]
    assert not any(s.endswith("?") for s in ex2.story)
    assert format_example(ex) == (
        "Mary moved to the bathroom. John went to the hallway. Q: Where is Mary? A:",
        "bathroom",
    )
    assert len(load_babi(en1k, task=1, split="test")) == 1000


@needs_data
def test_supporting_fact_counts(en1k):
    qa2 = load_babi(en1k, task=2)
    qa3 = load_babi(en1k, task=3, split="test")
    assert len(qa2) == len(qa3) == 1000
    assert {e.n_supporting for e in qa2} == {2}
    assert {e.n_supporting for e in qa3} == {3}
    for e in qa2[:50] + qa3[:50]:
        assert set(e.supporting) <= set(e.story_ids)
        assert [e.story[i] for i in e.supporting_index]


@needs_data
def test_stories_restart(en1k):
    exs = load_babi(en1k, task=1)
    # qa1 has 5 questions per 15-line story: the 6th question starts a new 2-statement story
    assert len(exs[5].story) == 2 and exs[5].story_ids == [1, 2]


@needs_data
def test_missing_folder_and_task_file(en1k, tmp_path):
    with pytest.raises(FileNotFoundError, match="bAbI folder not found"):
        load_babi(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"qa7_\*_train.txt"):
        load_babi(tmp_path, task=7)
    # pointing at the parent folder gives a hint
    with pytest.raises(FileNotFoundError, match="en-1k"):
        load_babi(en1k.parent, task=1)
    with pytest.raises(ValueError, match="1..20"):
        load_babi(en1k, task=21)
    with pytest.raises(ValueError, match="split"):
        load_babi(en1k, task=1, split="dev")
    bad = tmp_path / "qa1_bad_train.txt"  # a byte that is not UTF-8: one line naming the line
    bad.write_bytes((en1k / "qa1_single-supporting-fact_train.txt").read_bytes()[:300] + b"1 Mary \xff.\n")
    with pytest.raises(TaskDataError, match=r"qa1_bad_train.txt:\d+: not valid UTF-8"):
        parse_babi_file(bad)
    for text in ("", "1 Mary went home.\n2 John is here.\n"):  # no question: refused, not an empty task
        bad.write_text(text)
        with pytest.raises(TaskDataError, match="holds no question"):
            parse_babi_file(bad)


def test_parse_inline_and_malformed():
    text = [
        "1 A went home.\n",
        "2 B went out.\n",
        "3 Where is A? \thome\t1\n",
        "4 A left.\n",
        "5 Where is A? \tout\t4 1\n",
        "1 C sat.\n",
        "2 Where is C?\tchair\t1\n",
    ]
    exs = parse_babi(text, task=9)
    assert [e.answer for e in exs] == ["home", "out", "chair"]
    assert exs[1].story == ["A went home.", "B went out.", "A left."]
    assert exs[1].n_supporting == 2 and exs[1].supporting == [4, 1]
    assert exs[2].story == ["C sat."]
    with pytest.raises(ValueError, match=r"src:2:"):
        parse_babi(["1 ok.\n", "oops\n"], task=1, source="src")
    with pytest.raises(ValueError, match=r"src:2: line id 5 follows 1"):
        parse_babi(["1 ok.\n", "5 bad.\n"], task=1, source="src")


def _ex(task, n_sup, answer="x"):
    return BabiExample(task, [], "q?", answer, list(range(1, n_sup + 1)), n_sup)


def test_task_error_and_failed_tasks():
    exs = [_ex(1, 1, "a"), _ex(1, 1, "b"), _ex(2, 2, "s,e"), _ex(2, 2, "c"), _ex(3, 3, "d")]
    preds = ["a", "x", " S, E ", "c", "D"]
    errs = task_error(preds, exs)
    assert errs == {1: 0.5, 2: 0.0, 3: 0.0}
    assert failed_tasks({1: 0.5, 2: 0.0, 3: 0.05, 4: 0.051}) == [1, 4]
    assert failed_tasks({1: 0.5, 2: 0.2}, threshold=0.3) == [1]
    with pytest.raises(ValueError):
        task_error(["a"], exs)


def test_ponder_by_supporting():
    exs = [_ex(1, 1), _ex(1, 1), _ex(2, 2), _ex(2, 2), _ex(3, 3)]
    out = ponder_by_supporting([2.0, 4.0, 3.0, 3.0, 5.0], exs)
    assert list(out) == [1, 2, 3]
    assert out[1] == (pytest.approx(3.0), pytest.approx(1.0))
    assert out[2] == (pytest.approx(3.0), pytest.approx(0.0))
    assert out[3] == (pytest.approx(5.0), pytest.approx(0.0))
    # tensors: a 1-D tensor of scalars, or per-position rows averaged per example
    assert ponder_by_supporting(torch.tensor([2.0, 4.0, 3.0, 3.0, 5.0]), exs) == out
    rows = [torch.tensor([1.0, 3.0]), [4.0, 4.0], 3.0, 3.0, [5.0]]
    assert ponder_by_supporting(rows, exs) == out
    with pytest.raises(ValueError):
        ponder_by_supporting([1.0], exs)
