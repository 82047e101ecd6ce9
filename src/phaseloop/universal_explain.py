"""The Universal Transformer explainer's quantities, for ``phaseloop explore``'s Learn
pages (Dehghani et al., ICLR 2019): the coordinate signal in both conventions (UT §2.1)
and the four schedules of Figure 1. The model itself is ``universal.py``."""

from __future__ import annotations

import torch

from .errors import ConfigError
from .layers import paper_timing_signal, timing_signal


SIGNALS = {"t2t": timing_signal, "paper": paper_timing_signal}  # phaseloop's; eq. 6-7 as written


def coordinate_signal(positions, t: int, d: int, part: str = "sum",
                      convention: str = "t2t") -> torch.Tensor:
    """P^t(i) over ``positions`` for step ``t`` (0-based, as the model counts), [len, d]:
    ``part`` = position (sinusoid of i), step (of t, the same row at every i) or sum;
    ``convention`` = t2t (``timing_signal``, what ``CoordinateSignal`` adds) or paper."""
    if convention not in SIGNALS:
        raise ConfigError(f"unknown convention {convention!r}; choose {' or '.join(SIGNALS)}")
    if part not in ("position", "step", "sum"):
        raise ConfigError(f"unknown part {part!r}; choose position, step or sum")
    fn = SIGNALS[convention]
    pos = torch.as_tensor(positions)
    out = torch.zeros(len(pos), d, dtype=torch.float64)
    if part != "step":
        out = out + fn(pos, d).double()
    if part != "position":
        out = out + fn(torch.tensor([t]), d).double()
    return out


def schedule_grids(positions: int, depth: int, p: torch.Tensor | None = None,
                   threshold: float = 0.99) -> dict:
    """Which weight set computes each (tick, position) cell in the four schedules of UT
    §2 / Figure 1: RNN (one tick per position, one weight set), Transformer (``depth``
    ticks, one weight set per layer), UT (``depth`` ticks, one shared set) and UT+ACT
    (``act.halting_schedule`` on ``p`` [steps, positions]: a position computes until it
    halts, then its state is copied forward). Cells: weight-set index, -1 not computed
    at this tick, -2 halted (copied)."""
    from .act import halting_schedule

    m, T = positions, depth
    rnn = [[0 if i == k else -1 for i in range(m)] for k in range(m)]
    out = {"rnn": rnn, "transformer": [[k] * m for k in range(T)], "ut": [[0] * m for _ in range(T)]}
    if p is not None:
        s = halting_schedule(p, threshold)
        n = s.n_updates.tolist()
        out["ut_act"] = [[0 if k < n[i] else -2 for i in range(p.shape[1])] for k in range(s.steps_run)]
        out["ut_act_n_updates"] = n
    return out
