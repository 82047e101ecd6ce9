"""Progress where stderr is not a terminal (issue 38, item 10: CI, nohup, Slurm logs): no
bar frames at all, one line at each evaluation step, for ``train`` and a sequential
``compare``; on a terminal the bar is as before (and no such lines)."""

import io
import re
import sys

import pytest
from conftest import TINY, write_corpus

from phaseloop.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = [a for a in TINY if a != "--quiet"]  # progress on
LINE = re.compile(r"^run: step (\d+)/20, loss \d+\.\d{4}, val_loss \d+\.\d{4}, val_bpb \d+\.\d{4}, \d+ tok/s$")


def _train(tmp_path):
    return main(["train", *TRAIN, "--steps", "20", "--eval-every", "5", "--log-every", "1", "--compile", "off",
                 "--data", str(write_corpus(tmp_path / "c.txt")), "--out", str(tmp_path / "run")])


def test_train_with_stderr_to_a_file_writes_a_line_per_evaluation(tmp_path, monkeypatch):
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        monkeypatch.setattr(sys, "stderr", f)
        assert _train(tmp_path) == 0
    text = log.read_text()
    assert "\r" not in text, text[:500]  # no bar frames
    lines = [x for x in text.splitlines() if not x.startswith("note: ")]
    assert [int(LINE.match(x).group(1)) for x in lines] == [5, 10, 15, 20], text


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_the_bar_stays(tmp_path, monkeypatch):
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert _train(tmp_path) == 0
    text = tty.getvalue()
    assert text.count("\r") >= 5 and "20/20" in text and not any(LINE.match(x) for x in text.splitlines())


def test_a_comparison_logged_to_a_file_writes_a_line_per_evaluation(tmp_path, monkeypatch):
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "t"\ndata = "{write_corpus(tmp_path / "c.txt")}"\nscale = "tiny"\nseeds = [0]\n'
                      'variants = ["rope", "three_phase N=3"]\n[train]\nsteps = 6\nbatch_size = 2\nseq_len = 16\n'
                      "eval_every = 3\neval_windows = 2\nwarmup_steps = 1\nlog_every = 1\ncompile = \"off\"\n")
    log = tmp_path / "compare.log"
    with open(log, "w") as f:
        monkeypatch.setattr(sys, "stderr", f)
        assert main(["compare", str(recipe), "--out", str(tmp_path / "cmp")]) == 0
    text = log.read_text()
    assert "\r" not in text, text[:500]
    steps = re.findall(r"^(rope-s0|three_phase-N3-s0): step (\d)/6, loss [\d.]+, val_loss [\d.]+", text, re.M)
    assert steps == [("rope-s0", "3"), ("rope-s0", "6"), ("three_phase-N3-s0", "3"), ("three_phase-N3-s0", "6")]
