"""The forward FLOPs of the tokens a run trained, for MFU (``dist.mfu``): each step's
tokens at the FLOPs per token of the depth it ran at, so a run training at sampled
depths (``TrainConfig.depth_sample``) is measured against the work it did, not the
trained depth's. The count is counted, not measured (``analysis.params``' meta-device
count, given by the caller as a function of the depth)."""

from __future__ import annotations

import time
from collections.abc import Callable


class FlopCount:
    """``per_token``: forward FLOPs per token, a number or a function of a step's depth
    (None: the trained depth; it may return None where an arch cannot be counted), asked
    once per depth. ``total``: forward FLOPs of every token counted (None once a depth
    had no count); ``uncounted_s``: seconds spent counting, which are not training time
    (the trainer takes them out of its clock and resets them)."""

    def __init__(self, per_token: float | Callable[[int | None], float | None] | None):
        self.per_token = per_token
        self._at: dict = {}
        self.total: float | None = 0.0
        self.uncounted_s = 0.0

    def at(self, depth: int | None) -> float | None:
        """Forward FLOPs per token at ``depth``."""
        if depth not in self._at:
            t0 = time.perf_counter()
            f = self.per_token
            self._at[depth] = f(depth) if callable(f) else f
            self.uncounted_s += time.perf_counter() - t0
        return self._at[depth]

    def add(self, tokens: int, depth: int | None) -> None:
        """``tokens`` more trained at ``depth``."""
        f = self.at(depth)
        self.total = None if self.total is None or f is None else self.total + tokens * f

    def restore(self, total: float | None, tokens: int) -> None:
        """After a resume: the checkpoint's total; one written before it was recorded
        counts its ``tokens`` at the trained depth."""
        f = self.at(None)
        self.total = total if total is not None else (tokens * f if f is not None else None)

    @staticmethod
    def mean(flops: float | None, tokens: int) -> float | None:
        """Forward FLOPs per token of ``tokens`` tokens that took ``flops``."""
        return flops / tokens if flops is not None and tokens > 0 else None
