"""The types of the command line's numbers and names, one place for every command: an
integer out of range, a non-finite float or a name that is not a plain name is refused by
argparse as one line (``phaseloop CMD: error: argument --X: ...``, exit 2) before anything
runs. The library functions check the same bounds for their Python callers."""

from __future__ import annotations

import argparse
import math

from phaseloop.config import MAX_DEPTH, MAX_INT, MAX_SEED, MAX_SEQ_LEN
from phaseloop.early_exit import parse_exit
from phaseloop.errors import PhaseloopError
from phaseloop.files import check_name


def int_in(lo: int | None = None, hi: int = MAX_INT, what: str = "") -> callable:
    """An argparse type: an integer in [lo, hi] (lo None: no lower bound)."""
    def parse(text: str) -> int:
        v = int(text)  # not a number: argparse's own "invalid int value: 'x'"
        if (lo is not None and v < lo) or v > hi:
            low = f"from {lo} to {hi:,}" if lo is not None else f"at most {hi:,}"
            raise argparse.ArgumentTypeError(f"{v} is out of range: must be an integer {low}{what}")
        return v
    parse.__name__ = "int"
    return parse


positive_int = int_in(1)
seq_len_int = int_in(1, MAX_SEQ_LEN, " (positions: the T x T attention scores of more overflow)")
nonneg_int = int_in(0)
seed_int = int_in(0, MAX_SEED)
depth_int = int_in(1, MAX_DEPTH, " (UT steps or loop passes; config.MAX_DEPTH)")
any_int = int_in(None)  # bounded above only: TrainConfig checks its own lower bounds


def seed_list(text: str) -> str:
    """Comma-separated seeds (``0,1``): an integer item out of [0, MAX_SEED] is refused
    here; the text is returned as given, for the command's own check of its form."""
    for item in text.split(","):
        try:
            v = int(item)
        except ValueError:
            continue  # not a number: the command names it
        if not 0 <= v <= MAX_SEED:
            raise argparse.ArgumentTypeError(f"seed {v} is out of range: seeds are integers from 0 to "
                                             f"{MAX_SEED:,} (2^63 - 1)")
    return text


def finite_float(text: str) -> float:
    """A finite float (the lower bound is the option's own check)."""
    v = float(text)  # not a number: argparse's own "invalid float value: 'x'"
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number; give a finite value")
    return v


finite_float.__name__ = "float"


def positive_float(text: str) -> float:
    v = finite_float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return v


positive_float.__name__ = "float"


def safe_name(text: str) -> str:
    """A name that becomes one folder of a registry (``files.check_name``)."""
    try:
        return check_name(text, "name")
    except PhaseloopError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _comma_list(text: str, item, what: str, example: str, noun: str) -> list:
    """``text`` split at commas, each part through ``item``, no repeats (one-line errors; an
    ``item``'s own ArgumentTypeError, such as a depth out of range, is its line)."""
    try:
        out = [item(part.strip()) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give {what} separated by commas, e.g. {example}") from None
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"{text!r}: a {noun} is repeated")
    return out


def depth_list(text: str) -> list[int]:
    """Comma-separated depths (``2,4,6``), each a depth_int, no repeats."""
    return _comma_list(text, depth_int, "positive integers", "2,4,6", "depth")


depth_list.__name__ = "depth list"


def exit_rules(text: str) -> list:
    """``RULE:V[,V...]`` (``early_exit.parse_exit``): an ExitRule per value."""

    try:
        return parse_exit(text)
    except PhaseloopError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


exit_rules.__name__ = "exit rule"


def share_list(text: str) -> list:
    """``1,2,full``: KV slots per looped layer (``--kv-share``), ``full`` = one per pass (None)."""
    def item(part: str):
        try:
            return None if part.lower() == "full" else positive_int(part)
        except argparse.ArgumentTypeError as e:  # 0 or below: the list's own line
            raise ValueError(part) from e

    return _comma_list(text, item, "positive integers or full,", "1,2,full", "value")


share_list.__name__ = "KV share list"
