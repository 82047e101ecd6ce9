"""Accuracy metrics over predicted strings.

Character accuracy (the paper's "char accuracy") is micro-averaged over characters::

    char_accuracy = sum_i matches_i / sum_i max(len(pred_i), len(target_i))

where ``matches_i`` counts positions ``j`` with ``pred_i[j] == target_i[j]`` (aligned
from the start, no shifting). A missing character (prediction too short) and an extra
character (prediction too long) each count as one wrong position. When every
prediction and target is empty the accuracy is 1.0.

Sequence accuracy is the fraction of predictions exactly equal to their targets.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check(preds: Sequence[str], targets: Sequence[str]) -> None:
    if len(preds) != len(targets):
        raise ValueError(
            f"got {len(preds)} predictions for {len(targets)} targets; pass one prediction per target"
        )
    if len(targets) == 0:
        raise ValueError("no examples to score; pass at least one prediction/target pair")


def _char_counts(pred: str, target: str) -> tuple[int, int]:
    matches = sum(1 for a, b in zip(pred, target) if a == b)
    return matches, max(len(pred), len(target))


def char_accuracy(preds: Sequence[str], targets: Sequence[str]) -> float:
    """Fraction of character positions right (see module doc: missing and extra
    characters count as wrong; micro-averaged over all characters)."""
    _check(preds, targets)
    right = total = 0
    for p, t in zip(preds, targets):
        m, n = _char_counts(p, t)
        right += m
        total += n
    return 1.0 if total == 0 else right / total


def sequence_accuracy(preds: Sequence[str], targets: Sequence[str]) -> float:
    """Fraction of predictions exactly equal to their target."""
    _check(preds, targets)
    return sum(p == t for p, t in zip(preds, targets)) / len(targets)


def per_length_metrics(examples: Sequence, preds: Sequence[str]) -> dict[int, dict[str, float]]:
    """Group by ``example.length``: ``{length: {"char_acc", "seq_acc", "n"}}``, sorted
    by length. ``examples`` need ``.length`` and ``.target`` (e.g. ``Example``)."""
    if len(examples) != len(preds):
        raise ValueError(
            f"got {len(preds)} predictions for {len(examples)} examples; pass one prediction per example"
        )
    groups: dict[int, tuple[list[str], list[str]]] = {}
    for ex, p in zip(examples, preds):
        ps, ts = groups.setdefault(int(ex.length), ([], []))
        ps.append(p)
        ts.append(ex.target)
    return {
        L: {
            "char_acc": char_accuracy(ps, ts),
            "seq_acc": sequence_accuracy(ps, ts),
            "n": len(ts),
        }
        for L, (ps, ts) in sorted(groups.items())
    }


__all__ = ["char_accuracy", "sequence_accuracy", "per_length_metrics"]
