"""Seeded generators for the algorithmic tasks of the Universal Transformer paper
(§3.4, and the learning-to-execute memorisation tasks of §3.5).

Tasks (``TASKS``), for a length ``L``:

``copy``
    input: ``L`` random symbols from the alphabet (default the digits ``0-9``);
    target: the same string. ``length == L``.
``reverse``
    input as for copy; target: the input reversed. ``length == L``.
``addition``
    integer addition on decimal digits. Input ``"<a>+<b>"`` where ``a`` and ``b`` are
    uniformly random strings of exactly ``L`` decimal digits each (leading zeros are
    allowed, so every digit position is equally hard), most significant digit first.
    Target: ``int(a) + int(b)`` in decimal, zero-padded on the left to exactly
    ``L + 1`` digits (so the target length is fixed by ``L``). Example for ``L = 3``:
    ``"095+917" -> "1012"``, ``"012+003" -> "0015"``. ``length == L`` (digits per
    operand; the input has ``2 L + 1`` characters).
``parity``
    prefix parity. Input: ``L`` random bits ``x1..xL`` as ``'0'``/``'1'``; target: one
    output per position, ``y_i = x1 xor ... xor x_i``. Example: ``"0110" -> "0100"``.
    ``length == L``.
``lte-copy``, ``lte-double``, ``lte-reverse``
    the memorisation tasks of "Learning to Execute" (Zaremba & Sutskever 2014) that the
    UT paper reports in §3.5. Input: a random number of exactly ``L`` decimal digits,
    most significant first and never 0 (LTE draws numbers, not digit strings); target:
    the number (copy), the number times 2 in decimal without padding, so ``L`` or
    ``L + 1`` digits (double: ``"512" -> "1024"``, ``"123" -> "246"``), or its digits
    reversed (reverse: ``"120" -> "021"``). ``length == L``.

Lengths: ``make_examples`` takes an inclusive range as a 2-tuple ``(lo, hi)`` (or a
``range``), or an explicit list of lengths. Defaults are small (train ``1-20``, test
``40,80``); the paper's setting (train 40, test 400) is ``PAPER_TRAIN_LENGTHS`` /
``PAPER_TEST_LENGTHS``. ``parse_lengths`` turns CLI text such as ``"1-20"`` or
``"40,80"`` into these.

Generation is deterministic: the same ``(task, n, lengths, seed, vocab)`` always gives
the same examples, on any machine (numpy ``PCG64`` seeded by ``(seed, task)``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from phaseloop.errors import ConfigError

TASKS: tuple[str, ...] = ("copy", "reverse", "addition", "parity",
                          "lte-copy", "lte-double", "lte-reverse")
LTE_TASKS: tuple[str, ...] = TASKS[4:]
"""The learning-to-execute memorisation tasks (UT §3.5)."""

DIGITS = "0123456789"
BITS = "01"

TRAIN_LENGTHS: tuple[int, int] = (1, 20)
"""Default training lengths: every length 1..20 (inclusive range)."""
TEST_LENGTHS: list[int] = [40, 80]
"""Default test lengths (longer than any training length)."""
PAPER_TRAIN_LENGTHS: list[int] = [40]
"""The paper's training length (Universal Transformer, algorithmic tasks)."""
PAPER_TEST_LENGTHS: list[int] = [400]
"""The paper's test length."""

@dataclass(frozen=True)
class Example:
    """One input/target pair. ``length`` is the task's size parameter (see module doc:
    symbols for copy/reverse/parity, digits per operand for addition, digits of the
    number for the lte- tasks)."""

    input: str
    target: str
    length: int


# --------------------------------------------------------------------------- lengths


MAX_LENGTH = 2**16  # an example's length: its examples are generated, and attended to in full (T x T)


def parse_lengths(text: str) -> range | list[int]:
    """Parse a length spec.

    ``"1-20"`` -> ``range(1, 21)`` (inclusive); ``"40,80"`` -> ``[40, 80]``;
    ``"40"`` -> ``[40]``; items may be mixed: ``"1-3,10"`` -> ``[1, 2, 3, 10]``.
    Lengths must be integers >= 1. Raises ``ValueError`` (``ConfigError``) naming the
    bad text.
    """
    if not isinstance(text, str):
        raise ConfigError(f"length spec must be text like '1-20' or '40,80', got {text!r}")
    raw = text.strip()
    if not raw:
        raise ConfigError(f"empty length spec {text!r}; write e.g. '1-20' or '40,80'")
    items = [p.strip() for p in raw.split(",")]
    out: list[int] = []
    ranges: list[range] = []
    for item in items:
        if not item:
            raise ConfigError(f"bad length spec {text!r}: empty item; write e.g. '1-20' or '40,80'")
        if "-" in item:
            lo_s, _, hi_s = item.partition("-")
            lo, hi = _parse_int(lo_s, item, text), _parse_int(hi_s, item, text)
            if lo > hi:
                raise ConfigError(
                    f"bad length spec {text!r}: range {item!r} runs backwards; write it as '{hi}-{lo}'"
                )
            ranges.append(range(lo, hi + 1))
            out.extend(range(lo, hi + 1))
        else:
            out.append(_parse_int(item, item, text))
    if len(items) == 1 and ranges:
        return ranges[0]
    return list(dict.fromkeys(out))  # dedupe, keep order


def _parse_int(s: str, item: str, text: str) -> int:
    s = s.strip()
    if not s.isdecimal():
        raise ConfigError(
            f"bad length spec {text!r}: {item!r} is not a length; use positive integers like '1-20' or '40,80'"
        )
    v = int(s)
    if v < 1:
        raise ConfigError(f"bad length spec {text!r}: lengths must be >= 1 (got {item!r})")
    if v > MAX_LENGTH:
        raise ConfigError(f"bad length spec {text!r}: lengths must be at most {MAX_LENGTH:,} (got {item!r}): "
                          "every example of a length is generated and attended to in full")
    return v


def _length_list(lengths) -> list[int]:
    """Normalise ``lengths`` to a sorted list of allowed lengths."""
    if isinstance(lengths, str):
        lengths = parse_lengths(lengths)
    if isinstance(lengths, (int, np.integer)) and not isinstance(lengths, bool):
        vals = [int(lengths)]
    elif isinstance(lengths, tuple):
        if len(lengths) != 2:
            raise ConfigError(
                f"lengths tuple must be an inclusive range (lo, hi), got {lengths!r}; "
                "pass a list for explicit lengths"
            )
        lo, hi = (int(v) for v in lengths)
        if lo > hi:
            raise ConfigError(f"lengths range {lengths!r} runs backwards; write ({hi}, {lo})")
        vals = list(range(lo, hi + 1))
    elif isinstance(lengths, Iterable):
        vals = [int(v) for v in lengths]
    else:
        raise ConfigError(f"lengths must be (lo, hi), a list of ints or a range, got {lengths!r}")
    if not vals:
        raise ConfigError(f"lengths {lengths!r} is empty; give at least one length")
    if min(vals) < 1:
        raise ConfigError(f"lengths must be >= 1, got {min(vals)} in {lengths!r}")
    return sorted(set(vals))


# --------------------------------------------------------------------------- generators


def _check_task(task: str) -> int:
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    return TASKS.index(task)


def _alphabet(task: str, vocab: str | None) -> str:
    if task in ("copy", "reverse"):
        alpha = DIGITS if vocab is None else vocab
        if not isinstance(alpha, str) or len(alpha) < 1:
            raise ConfigError(f"vocab for {task!r} must be a non-empty string of symbols, got {vocab!r}")
        if len(set(alpha)) != len(alpha):
            raise ConfigError(f"vocab {alpha!r} repeats a symbol; list each symbol once")
        return alpha
    fixed = DIGITS if task == "addition" or task in LTE_TASKS else BITS
    if vocab is not None and vocab != fixed:
        raise ConfigError(
            f"task {task!r} uses the fixed symbols {fixed!r}; leave vocab unset (got {vocab!r})"
        )
    return fixed


def _one(task: str, length: int, rng: np.random.Generator, alpha: str) -> Example:
    if task == "addition":
        d = rng.integers(0, 10, size=2 * length)
        a = "".join(DIGITS[i] for i in d[:length])
        b = "".join(DIGITS[i] for i in d[length:])
        return Example(f"{a}+{b}", str(int(a) + int(b)).zfill(length + 1), length)
    if task in LTE_TASKS:
        d = [rng.integers(1, 10), *rng.integers(0, 10, size=length - 1)]  # no leading 0
        s = "".join(DIGITS[i] for i in d)
        target = {"lte-copy": s, "lte-double": str(2 * int(s)), "lte-reverse": s[::-1]}[task]
        return Example(s, target, length)
    idx = rng.integers(0, len(alpha), size=length)
    s = "".join(alpha[i] for i in idx)
    if task == "copy":
        return Example(s, s, length)
    if task == "reverse":
        return Example(s, s[::-1], length)
    return Example(s, prefix_parity(s), length)


def prefix_parity(bits: str) -> str:
    """``"0110" -> "0100"``: position i holds x1 xor ... xor x_i."""
    acc = 0
    out = []
    for ch in bits:
        if ch not in "01":
            raise ValueError(f"prefix_parity expects '0'/'1' characters, got {ch!r}")
        acc ^= ch == "1"
        out.append("1" if acc else "0")
    return "".join(out)


def make_examples(
    task: str,
    n: int,
    lengths=TRAIN_LENGTHS,
    seed: int = 0,
    vocab: str | None = None,
    *,
    balanced: bool = False,
) -> list[Example]:
    """Generate ``n`` examples of ``task``.

    ``lengths``: ``(lo, hi)`` inclusive range, a ``range``, a list of lengths, an int,
    or spec text (``"1-20"``). Each example's length is drawn uniformly from the
    allowed lengths; with ``balanced=True`` lengths are instead cycled in increasing
    order (each allowed length gets ``n // k`` or ``n // k + 1`` examples; good for
    per-length test sets). ``vocab``: the alphabet for copy/reverse (default
    ``"0123456789"``); addition, parity and the lte- tasks use fixed symbols and reject
    another vocab.
    Deterministic in ``seed``.
    """
    tid = _check_task(task)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ConfigError(f"n (number of examples) must be an integer >= 0, got {n!r}")
    lens = _length_list(lengths)
    alpha = _alphabet(task, vocab)
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, tid])
    if balanced:
        chosen = [lens[i % len(lens)] for i in range(n)]
    else:
        chosen = [lens[i] for i in rng.integers(0, len(lens), size=n)]
    return [_one(task, L, rng, alpha) for L in chosen]


@dataclass(frozen=True)
class TaskSpec:
    """A task with its train/test length settings.

    ``TaskSpec("reverse")`` uses the small defaults; ``TaskSpec.paper("reverse")`` the
    paper's 40 / 400. ``train(n, seed)`` and ``test(n, seed)`` use different random
    streams for the same seed (test examples are balanced across test lengths).
    """

    task: str
    train_lengths: object = field(default_factory=lambda: TRAIN_LENGTHS)
    test_lengths: object = field(default_factory=lambda: list(TEST_LENGTHS))
    vocab: str | None = None

    def __post_init__(self) -> None:
        _check_task(self.task)
        _length_list(self.train_lengths)
        _length_list(self.test_lengths)
        _alphabet(self.task, self.vocab)

    @classmethod
    def paper(cls, task: str, vocab: str | None = None) -> TaskSpec:
        return cls(task, list(PAPER_TRAIN_LENGTHS), list(PAPER_TEST_LENGTHS), vocab)

    def train(self, n: int, seed: int = 0) -> list[Example]:
        return make_examples(self.task, n, self.train_lengths, 2 * int(seed), self.vocab)

    def test(self, n: int, seed: int = 0) -> list[Example]:
        return make_examples(
            self.task, n, self.test_lengths, 2 * int(seed) + 1, self.vocab, balanced=True
        )

    @property
    def max_length(self) -> int:
        """Largest length over train and test."""
        return max(_length_list(self.train_lengths) + _length_list(self.test_lengths))


# --------------------------------------------------------------------------- offsets


def position_offsets(
    batch: int, max_offset: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Per-example random position offsets, uniform in ``[0, max_offset]``.

    Returns a ``torch.long`` tensor of shape ``(batch,)``. A model adds
    ``offsets[:, None]`` to its position indices ``arange(T)`` during training, so that
    when it trains on length 40 with ``max_offset >= 360`` it has already seen every
    position index up to 400 used at test time (the paper's random offsets). Use
    ``max_offset = 0`` at test time. Deterministic given a seeded ``generator``.
    """
    if isinstance(batch, bool) or int(batch) != batch or batch < 0:
        raise ConfigError(f"batch must be an integer >= 0, got {batch!r}")
    if isinstance(max_offset, bool) or int(max_offset) != max_offset or max_offset < 0:
        raise ConfigError(f"max_offset must be an integer >= 0, got {max_offset!r}")
    return torch.randint(0, int(max_offset) + 1, (int(batch),), generator=generator, dtype=torch.long)


__all__ = [
    "TASKS",
    "LTE_TASKS",
    "DIGITS",
    "BITS",
    "TRAIN_LENGTHS",
    "TEST_LENGTHS",
    "PAPER_TRAIN_LENGTHS",
    "PAPER_TEST_LENGTHS",
    "Example",
    "TaskSpec",
    "make_examples",
    "parse_lengths",
    "position_offsets",
    "prefix_parity",
]
