"""The Universal Transformer explainer's quantities, for ``phaseloop explore``'s Learn
pages (Dehghani et al., ICLR 2019): the coordinate signal in both conventions (UT §2.1)
and the four schedules of Figure 1. The model itself is ``universal.py``."""

from __future__ import annotations

import torch

from phaseloop.archs.act import halting_schedule
from phaseloop.errors import ConfigError
from phaseloop.layers import timing_signal


def paper_timing_signal(positions: torch.Tensor, d: int) -> torch.Tensor:
    """[len(positions), d] sinusoid as Dehghani et al. 2019 eq. 6-7 (and Vaswani et al.
    §3.5) write it: channel 2j = sin(p / 10000^(2j/d)), channel 2j+1 = cos(same),
    *interleaved*, in float64. phaseloop's models use ``layers.timing_signal`` (tensor2tensor's
    concatenated halves, frequencies log-spaced to exactly 1e4); this one is for
    comparison (explore's coordinate-signal page: 24.715 vs 24.834 at i - t = 997)."""
    n = (d + 1) // 2
    inv_K = 10000.0 ** (-2 * torch.arange(n, dtype=torch.float64, device=positions.device) / d)
    angles_TK = positions.double()[:, None] * inv_K[None, :]
    return torch.stack([angles_TK.sin(), angles_TK.cos()], dim=-1).flatten(-2)[:, :d]


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

    m, T = positions, depth
    rnn = [[0 if i == k else -1 for i in range(m)] for k in range(m)]
    out = {"rnn": rnn, "transformer": [[k] * m for k in range(T)], "ut": [[0] * m for _ in range(T)]}
    if p is not None:
        s = halting_schedule(p, threshold)
        n = s.n_updates.tolist()
        out["ut_act"] = [[0 if k < n[i] else -2 for i in range(p.shape[1])] for k in range(s.steps_run)]
        out["ut_act_n_updates"] = n
    return out
