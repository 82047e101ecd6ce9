"""bAbI question answering (the 20 English tasks, Weston et al. 2015).

File format (``qa{N}_{name}_{split}.txt``): every line is ``"<id> <text>"``. A line
with TABs is a question: ``"<id> <question>\\t<answer>\\t<supporting ids>"``; other
lines are statements. Ids count the lines of a story (questions included); an id of 1
starts a new story. Answers may hold commas (task 8 lists, task 19 directions
``"s,e"``) and are kept as written.

Each question becomes one ``BabiExample``. Its ``story`` is the statements of the
current story before the question (earlier questions are left out); ``story_ids`` are
their line ids in the file; ``supporting`` holds the ids as written in the file (they
refer to statement lines, so they are all in ``story_ids``; ``supporting_index`` gives
0-based positions in ``story``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from phaseloop.analysis.stats import mean_std
from phaseloop.data.tokenizer import EOS, PAD, SEP
from phaseloop.errors import ConfigError
from phaseloop.tasks._errors import TaskDataError, TaskDataNotFound

N_TASKS = 20
SPLITS = ("train", "test")
_FILE_RE = re.compile(r"^qa(\d+)_(.+)_(train|test|valid)\.txt$")


@dataclass
class BabiExample:
    task: int
    story: list[str]
    question: str
    answer: str
    supporting: list[int]
    n_supporting: int
    story_ids: list[int] = field(default_factory=list)

    @property
    def supporting_index(self) -> list[int]:
        """0-based positions of the supporting facts in ``story``."""
        pos = {sid: i for i, sid in enumerate(self.story_ids)}
        return [pos[s] for s in self.supporting if s in pos]


# --------------------------------------------------------------------------- parsing


def parse_babi(lines: Iterable[str], task: int, source: str = "<bAbI text>") -> list[BabiExample]:
    """Parse bAbI lines (an open file, a list of lines) into examples of ``task``.
    A malformed line raises ``ValueError`` naming ``source`` and the 1-based line."""
    examples: list[BabiExample] = []
    story: list[str] = []
    story_ids: list[int] = []
    prev_id = 0
    for lineno, line in enumerate(lines, start=1):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        head, sep, rest = line.lstrip().partition(" ")
        if not sep or not head.isdigit():
            raise TaskDataError(
                f"{where}: expected '<id> <text>' (a line number, a space, the text), got {line[:40]!r}; "
                "is this a bAbI qa*.txt file?"
            )
        lid = int(head)
        if lid == 1:
            story, story_ids = [], []
        elif lid != prev_id + 1:
            raise TaskDataError(
                f"{where}: line id {lid} follows {prev_id}; ids must count up by 1 and restart at 1 for a new story"
            )
        prev_id = lid
        if "\t" in rest:
            parts = rest.split("\t")
            if len(parts) < 2 or not parts[1].strip():
                raise TaskDataError(
                    f"{where}: question line needs '<question>\\t<answer>\\t<supporting ids>'; add the answer"
                )
            sup_text = parts[2] if len(parts) > 2 else ""
            try:
                supporting = [int(s) for s in sup_text.split()]
            except ValueError:
                raise TaskDataError(
                    f"{where}: supporting ids {sup_text!r} are not integers; write them space-separated, e.g. '3 6'"
                ) from None
            examples.append(
                BabiExample(
                    task=task,
                    story=list(story),
                    question=parts[0].strip(),
                    answer=parts[1].strip(),
                    supporting=supporting,
                    n_supporting=len(supporting),
                    story_ids=list(story_ids),
                )
            )
        else:
            story.append(rest.strip())
            story_ids.append(lid)
    return examples


def _task_of(path: Path) -> int | None:
    m = _FILE_RE.match(path.name)
    return int(m.group(1)) if m else None


def parse_babi_file(path: str | os.PathLike, task: int | None = None) -> list[BabiExample]:
    """Parse one bAbI file; ``task`` defaults to the N in ``qa{N}_...``."""
    p = Path(path)
    if not p.is_file():
        raise TaskDataNotFound(f"bAbI file not found: {p}")
    if task is None:
        task = _task_of(p)
        if task is None:
            raise ConfigError(f"cannot tell the bAbI task from the file name {p.name!r}; pass task=N")
    lines = []
    for i, raw in enumerate(p.read_bytes().splitlines(keepends=True), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise TaskDataError(f"{p}:{i}: not valid UTF-8 text; save the file as UTF-8 (the bAbI "
                                "release is)") from None
    examples = parse_babi(lines, task, source=str(p))
    if not examples:  # statements alone, or nothing: no question to train on or score
        raise TaskDataError(f"{p}: holds no question (a line 'N question?<TAB>answer<TAB>facts'); "
                            "restore the file from the bAbI release")
    return examples


def babi_files(folder: str | os.PathLike, split: str = "train") -> dict[int, Path]:
    """``{task: path}`` for the ``qa{N}_*_{split}.txt`` files in ``folder``."""
    folder = _check_folder(folder)
    split = _check_split(split)
    found: dict[int, Path] = {}
    for p in sorted(folder.glob(f"qa*_*_{split}.txt")):
        t = _task_of(p)
        if t is None:
            continue
        if t in found:
            raise TaskDataError(
                f"{folder}: two files for task {t} ({found[t].name}, {p.name}); keep one per task and split"
            )
        found[t] = p
    return dict(sorted(found.items()))


def _check_folder(folder: str | os.PathLike) -> Path:
    f = Path(folder)
    if not f.is_dir():
        raise TaskDataNotFound(
            f"bAbI folder not found: {f}; pass the folder holding qa1_*_train.txt ... qa20_*_test.txt "
            "(e.g. <data>/babi/en-1k)"
        )
    return f


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ConfigError(f"unknown bAbI split {split!r}; choose 'train' or 'test'")
    return split


def _hint(folder: Path, split: str) -> str:
    subs = [d.name for d in sorted(folder.iterdir()) if d.is_dir() and any(d.glob(f"qa*_{split}.txt"))]
    return f" (did you mean the subfolder {folder / subs[0]}?)" if subs else ""


def load_babi(
    folder: str | os.PathLike, task: int | None = None, split: str = "train"
) -> list[BabiExample]:
    """Load the examples of one task (``task=N``, 1..20) or of every task file in the
    folder (``task=None``, in task order) for ``split`` ("train" or "test").
    Raises ``FileNotFoundError`` when the folder or the task file is missing."""
    folder = _check_folder(folder)
    split = _check_split(split)
    if task is not None:
        if isinstance(task, bool) or not isinstance(task, int) or not 1 <= task <= N_TASKS:
            raise ConfigError(f"bAbI task must be an integer 1..{N_TASKS}, got {task!r}")
        files = {t: p for t, p in babi_files(folder, split).items() if t == task}
        if not files:
            raise TaskDataNotFound(
                f"no bAbI file qa{task}_*_{split}.txt in {folder}{_hint(folder, split)}; pass --data-dir "
                f"with the folder holding both qa{task}_*_train.txt and qa{task}_*_test.txt "
                "(e.g. <data>/babi/en-1k)"
            )
    else:
        files = babi_files(folder, split)
        if not files:
            raise TaskDataNotFound(
                f"no bAbI files qa*_*_{split}.txt in {folder}{_hint(folder, split)}; pass --data-dir with "
                "the folder holding qa1_*_train.txt ... qa20_*_test.txt (e.g. <data>/babi/en-1k)"
            )
    out: list[BabiExample] = []
    for t, p in files.items():
        out.extend(parse_babi_file(p, t))
    return out


# --------------------------------------------------------------------------- formatting


def format_example(
    ex: BabiExample, max_sentences: int | None = None, sentence_sep: str = " "
) -> tuple[str, str]:
    """A flat text prompt and its answer, e.g.::

        ("Mary moved to the bathroom. John went to the hallway. Q: Where is Mary? A:",
         "bathroom")

    For a decoder-only model train on ``prompt + " " + answer``; for seq2seq use the
    prompt as source. ``max_sentences`` keeps only the last k statements (may drop
    supporting facts; ``None`` keeps the whole story)."""
    if max_sentences is None:
        story = ex.story
    elif isinstance(max_sentences, int) and max_sentences >= 0:
        story = ex.story[len(ex.story) - max_sentences :] if max_sentences else []
    else:
        raise ConfigError(f"max_sentences must be None or an integer >= 0, got {max_sentences!r}")
    parts = list(story) + [f"Q: {ex.question} A:"]
    return sentence_sep.join(parts), ex.answer


# --------------------------------------------------------------------------- reports


def normalize_answer(text: str) -> str:
    """Answer comparison form: surrounding whitespace stripped, lower case, spaces
    around commas removed (``"S, E"`` == ``"s,e"``)."""
    return ",".join(p.strip() for p in text.strip().lower().split(","))


def task_error(preds: Sequence[str], examples: Sequence[BabiExample]) -> dict[int, float]:
    """``{task: error rate}`` (fraction of questions whose predicted answer differs
    from the gold answer after ``normalize_answer``), sorted by task."""
    if len(preds) != len(examples):
        raise ValueError(
            f"got {len(preds)} predictions for {len(examples)} examples; pass one prediction per example"
        )
    wrong: dict[int, int] = {}
    count: dict[int, int] = {}
    for p, ex in zip(preds, examples):
        count[ex.task] = count.get(ex.task, 0) + 1
        wrong[ex.task] = wrong.get(ex.task, 0) + (normalize_answer(p) != normalize_answer(ex.answer))
    return {t: wrong[t] / count[t] for t in sorted(count)}


def failed_tasks(errors: dict[int, float], threshold: float = 0.05) -> list[int]:
    """Tasks whose error is above ``threshold`` (the bAbI convention: a task fails
    with more than 5% error), sorted."""
    return sorted(t for t, e in errors.items() if e > threshold)


def _as_scalar(v) -> float:
    if hasattr(v, "detach"):  # torch tensor
        v = v.detach().float().cpu().mean().item()
    elif isinstance(v, (list, tuple)) or hasattr(v, "__array__"):
        import numpy as np

        v = float(np.mean(np.asarray(v, dtype=float)))
    return float(v)


def ponder_by_supporting(
    ponder_times: Sequence, examples: Sequence[BabiExample]
) -> dict[int, tuple[float, float]]:
    """``{n_supporting: (mean, std)}`` of ponder time, sorted by ``n_supporting``.

    ``ponder_times`` has one entry per example: a number, or a per-position array or
    tensor (averaged to one number per example). Std is the population std
    (``mean_std``)."""
    if hasattr(ponder_times, "detach") and ponder_times.dim() == 1:
        ponder_times = ponder_times.detach().cpu().tolist()
    if len(ponder_times) != len(examples):
        raise ValueError(
            f"got {len(ponder_times)} ponder times for {len(examples)} examples; pass one per example"
        )
    groups: dict[int, list[float]] = {}
    for v, ex in zip(ponder_times, examples):
        groups.setdefault(ex.n_supporting, []).append(_as_scalar(v))
    return {k: mean_std(vs, ddof=0) for k, vs in sorted(groups.items())}


class WordVocab:
    """Word-level vocabulary for bAbI (and any whitespace-tokenised text): words and
    punctuation marks are tokens; the special ids match ``CharVocab`` (PAD 0, EOS 1,
    SEP 2). ``decode`` joins tokens with spaces."""

    PAD, EOS, SEP = PAD, EOS, SEP  # phaseloop.data.tokenizer: one convention everywhere
    SPECIALS = ("<pad>", "<eos>", "<sep>")
    _TOKEN = re.compile(r"\w+|[^\w\s]")

    def __init__(self, words: Sequence[str]):
        self.words = list(dict.fromkeys(words))
        self._to_id = {w: i + len(self.SPECIALS) for i, w in enumerate(self.words)}

    @classmethod
    def tokenize(cls, text: str) -> list[str]:
        return cls._TOKEN.findall(text.lower())

    @classmethod
    def for_texts(cls, texts) -> WordVocab:
        return cls(sorted({w for t in texts for w in cls.tokenize(t)}))

    def __len__(self) -> int:
        return len(self.SPECIALS) + len(self.words)

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        try:
            ids = [self._to_id[w] for w in self.tokenize(text)]
        except KeyError as e:
            raise ConfigError(f"word {e.args[0]!r} is not in the vocabulary; build it from all texts") from None
        return ids + [self.EOS] if add_eos else ids

    def decode(self, ids) -> str:
        out = []
        for i in (ids.tolist() if hasattr(ids, "tolist") else ids):
            if i == self.EOS:
                break
            if i >= len(self.SPECIALS):
                out.append(self.words[i - len(self.SPECIALS)])
        return " ".join(out)


__all__ = [
    "N_TASKS",
    "BabiExample",
    "parse_babi",
    "parse_babi_file",
    "babi_files",
    "load_babi",
    "format_example",
    "normalize_answer",
    "task_error",
    "failed_tasks",
    "ponder_by_supporting",
    "WordVocab",
]
