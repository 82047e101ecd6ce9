"""Adaptive Computation Time (ACT) halting, per position.

Reproduces the arithmetic of tensor2tensor's
``universal_transformer_util.adaptive_universal_transformer`` (``act_type="basic"``)
used by Dehghani et al. 2019, "Universal Transformers", §2.2 (dynamic halting), which
adapts Graves 2016, "Adaptive Computation Time for Recurrent Neural Networks".

There is exactly one implementation of the per-step update: :meth:`ACTState.step`.
The model's ACT loop calls it step by step::

    state = ACTState.zeros(positions_shape, dtype=..., device=...)
    prev = torch.zeros_like(h)
    while state.running(threshold, max_steps).any():
        p = torch.sigmoid(halting_linear(h)).squeeze(-1)   # [..positions]
        w = state.step(p, threshold)                        # [..positions]
        h = layer(h)                                        # next step's input
        prev = combine(prev, h, w, mode)                    # stack output

and :func:`halting_schedule` runs the same loop on a precomputed table of halting
probabilities (for analysis and tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from phaseloop.layers import compute_dtype

MODES = ("basic", "accumulated", "t2t_literal")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"invalid ACT mode {mode!r}: expected one of {MODES}")


def _check_threshold(threshold: float) -> None:
    if not (0.0 < float(threshold) <= 1.0):
        raise ValueError(f"invalid ACT threshold {threshold!r}: need 0 < threshold <= 1 "
                         "(usually 1 - 0.01)")


@dataclass
class ACTState:
    """Running ACT accumulators, one entry per position (any shape, e.g. [batch, length]).

    All three start at zero and have the dtype of the halting probabilities
    (``n_updates`` is a float count, as in tensor2tensor, and carries no gradient).
    """

    halting_probability: Tensor
    remainders: Tensor
    n_updates: Tensor

    @classmethod
    def zeros(cls, shape, dtype=torch.float32, device=None) -> ACTState:
        z = torch.zeros(shape, dtype=dtype, device=device)
        return cls(z, z.clone(), z.clone())

    @classmethod
    def like(cls, p: Tensor) -> ACTState:
        """Zero state with the shape/dtype/device of one step's halting probabilities."""
        return cls.zeros(p.shape, dtype=p.dtype, device=p.device)

    def running(self, threshold: float = 0.99, max_steps: int | float = float("inf")) -> Tensor:
        """Bool mask of positions that keep the loop going.

        tensor2tensor's ``should_continue`` is ``running(...).any()``:
        ``halting_probability < threshold`` and ``n_updates < max_steps``.
        """
        return (self.halting_probability < threshold) & (self.n_updates < max_steps)

    def step(self, p: Tensor, threshold: float = 0.99, lines: dict | None = None) -> Tensor:
        """Apply one ACT step with halting probabilities ``p`` (shape of the state).

        Updates the accumulators (by reassignment, so autograd sees the graph) and
        returns this step's update weights: ``p`` while still running, the remainder
        ``R = 1 - sum of earlier p`` at the halting step, 0 once halted. Masks are
        non-differentiable comparisons, so gradients reach ``p`` only through the
        accumulated sums (as in tensor2tensor). ``max_steps`` does not enter the
        update; it only stops the loop (see :meth:`running`).
        """
        if p.shape != self.halting_probability.shape:
            raise ValueError(f"halting probabilities have shape {tuple(p.shape)}, "
                             f"state has {tuple(self.halting_probability.shape)}")
        hp, rem, n = self.halting_probability, self.remainders, self.n_updates
        # Mask for inputs which have not halted yet.
        still_running = (hp < 1.0).to(p.dtype)
        # Mask of inputs which halted at this step.
        new_halted = (hp + p * still_running > threshold).to(p.dtype) * still_running
        # Mask of inputs which haven't halted, and didn't halt this step.
        still_running = (hp + p * still_running <= threshold).to(p.dtype) * still_running
        hp = hp + p * still_running
        rem = rem + new_halted * (1 - hp)
        hp = hp + new_halted * rem
        n = n + still_running + new_halted
        self.halting_probability, self.remainders, self.n_updates = hp, rem, n
        update_weights = p * still_running + new_halted * rem
        if lines is not None:
            lines.update(p=p, new_halted=new_halted, still_running=still_running,
                         halting_probability=hp, remainders=rem, n_updates=n,
                         update_weights=update_weights)
        return update_weights


class PendingInputs:
    """The UT's KV-cache entry ``("ut_in", t)`` under ACT (lazy step extension, universal.py):
    the step-t inputs x [B, n, D] of the positions start .. start + n - 1, which stopped
    before step t; rolls back with the cache (``truncate``)."""

    def __init__(self, start: int, x_BND: torch.Tensor):
        self.start, self.parts, self.n = start, [x_BND], x_BND.shape[1]

    @property
    def x(self) -> torch.Tensor:
        """[B, n, D], the parts ``extend`` appended joined once, when read (a decode that
        appends a token at a time and reads them later copies each once, not once a token)."""
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts, 1)]
        return self.parts[0]

    def extend(self, start: int, x_BND: torch.Tensor) -> None:
        if start != self.start + self.n:
            raise ValueError(f"pending step inputs from position {start} do not follow those up to "
                             f"{self.start + self.n}")
        self.parts.append(x_BND)
        self.n += x_BND.shape[1]

    def truncate(self, n: int) -> PendingInputs | None:
        """Only the positions < n (None: none left; itself, parts unjoined, when it holds none >= n)."""
        keep = n - self.start
        if keep >= self.n:
            return self
        return None if keep <= 0 else PendingInputs(self.start, self.x[:, :keep])

    def select_rows(self, idx_R: torch.Tensor) -> PendingInputs:
        return PendingInputs(self.start, self.x.index_select(0, idx_R))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def combine(previous_state: Tensor, transformed: Tensor, update_weights: Tensor,
            mode: str = "basic") -> Tensor:
    """Fold one step's transformed state into the ACT output.

    ``basic`` (Dehghani et al. 2019 §2.2, tensor2tensor's comment and documented intent):
    ``transformed * w + previous * (1 - w)``; ``accumulated`` (Graves 2016):
    ``transformed * w + previous``; ``t2t_literal``: tensor2tensor's basic-ACT line as
    written, ``transformed * w + (previous_state * 1 - update_weights)``, which by
    operator precedence is ``transformed * w + previous - w`` (w subtracted from every
    channel). ``update_weights`` has the state's shape without the hidden dim (or with
    a trailing 1) and is broadcast over the hidden dim.
    """
    _check_mode(mode)
    w = update_weights
    if w.dim() == transformed.dim() - 1:
        w = w.unsqueeze(-1)
    if mode == "basic":
        return transformed * w + previous_state * (1 - w)
    if mode == "t2t_literal":
        return transformed * w + previous_state - w
    return transformed * w + previous_state


@dataclass
class HaltingSchedule:
    """Outcome of running the ACT loop on a [steps, positions] table of probabilities.

    ``update_weights``/``effective_weights`` are [steps, positions] (zero for steps not
    run); ``n_updates``, ``remainders``, ``halting_probability`` are [positions];
    ``steps_run`` is how many loop iterations ran.
    """

    update_weights: Tensor
    n_updates: Tensor
    remainders: Tensor
    halting_probability: Tensor
    effective_weights: Tensor
    steps_run: int


def effective_weights(update_weights: Tensor, mode: str = "basic") -> Tensor:
    """Weight each step's transformed state carries in the final output ([steps, ...]).

    ``basic``: ``w_k * prod_{j>k} (1 - w_j)`` (sums to ``1 - prod_j (1 - w_j)``; the
    rest belongs to the zero initial state). ``accumulated``: ``w_k``. ``t2t_literal``:
    ``w_k`` too, but that output also carries the constant ``-sum_k w_k`` on every
    channel (see :func:`combine`), which no weight of a state describes.
    """
    _check_mode(mode)
    if mode != "basic":
        return update_weights
    out = []
    tail = torch.ones_like(update_weights[0])
    for k in range(update_weights.shape[0] - 1, -1, -1):
        out.append(update_weights[k] * tail)
        tail = tail * (1 - update_weights[k])
    return torch.stack(out[::-1])


def halting_schedule(p: Tensor, threshold: float = 0.99, max_steps: int | None = None,
                     mode: str = "basic") -> HaltingSchedule:
    """Run tensor2tensor's ACT loop on given halting probabilities ``p`` [steps, positions].

    Row ``t`` holds the probability each position would emit at step ``t``; the loop
    runs while some position has ``halting_probability < threshold`` and
    ``n_updates < max_steps`` (default ``steps``), using :meth:`ACTState.step`.
    Rows after the last step run are never read. Differentiable w.r.t. ``p``.
    """
    _check_mode(mode)
    _check_threshold(threshold)
    if not isinstance(p, Tensor) or p.dim() != 2:
        shape = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
        raise ValueError(f"p must be a 2-D tensor [steps, positions], got {shape}")
    if not p.is_floating_point():
        raise ValueError(f"p must be a floating-point tensor, got {p.dtype}")
    steps = p.shape[0]
    if steps < 1:
        raise ValueError("p must have at least one step (row)")
    if max_steps is None:
        max_steps = steps
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not 1 <= max_steps <= steps:
        raise ValueError(f"invalid max_steps {max_steps!r}: need an int in [1, {steps}] "
                         "(p has one row per step)")

    state = ACTState.like(p[0])
    weights = []
    # len(weights) < steps is implied (running positions have n_updates == steps run);
    # kept only as a guard against non-finite p.
    while len(weights) < steps and bool(state.running(threshold, max_steps).any()):
        weights.append(state.step(p[len(weights)], threshold))
    steps_run = len(weights)
    weights += [torch.zeros_like(p[0])] * (steps - steps_run)
    update_weights = torch.stack(weights)
    return HaltingSchedule(
        update_weights=update_weights,
        n_updates=state.n_updates,
        remainders=state.remainders,
        halting_probability=state.halting_probability,
        effective_weights=effective_weights(update_weights, mode),
        steps_run=steps_run,
    )


def listing(p: Tensor, threshold: float = 0.99, max_steps: int | None = None,
             mode: str = "basic") -> dict:
    """The ACT loop of :func:`halting_schedule` line by line (paper appendix C, Listing
    2), for the explore executor: per step run, every line's value per position (the
    ``still_running`` mask before the step, then ``new_halted``, the updated
    ``still_running``, ``halting_probability``, ``remainders``, ``n_updates`` and
    ``update_weights``), and the final schedule, ponder cost and ``state_weights``: the
    output of :func:`combine` in ``mode`` when step k's transformed state is the unit
    vector e_k, i.e. how much of each step's state the output holds (``t2t_literal``
    also subtracts sum_k w_k from every channel)."""
    sched = halting_schedule(p, threshold, max_steps, mode)
    state, steps = ACTState.like(p[0]), []
    for k in range(sched.steps_run):  # the same steps again, now keeping every line
        before = (state.halting_probability < 1.0).to(p.dtype)
        lines: dict = {}
        state.step(p[k], threshold, lines)
        steps.append({"still_running_before": before, **lines})
    S = p.shape[0]
    out = torch.zeros(p.shape[1], S, dtype=p.dtype)  # [positions, steps]: one channel per step
    for k in range(S):
        out = combine(out, torch.eye(S, dtype=p.dtype)[k].expand_as(out),
                      sched.update_weights[k], mode)
    return {"steps": steps, "schedule": sched, "ponder_cost": ponder_cost(sched),
            "state_weights": out.T, "mode": mode, "threshold": threshold}


def ponder_cost(schedule_or_state: HaltingSchedule | ACTState) -> Tensor:
    """Per-position ponder time ``n_updates + remainders`` (Graves 2016 §2.2)."""
    return schedule_or_state.n_updates + schedule_or_state.remainders


def ponder_loss(schedule_or_state: HaltingSchedule | ACTState, weight: float = 0.01) -> Tensor:
    """``weight * mean(n_updates + remainders)``; gradient flows via the remainders only."""
    return weight * ponder_cost(schedule_or_state).mean()


def ponder_diagnostics(model, stats: dict) -> dict[str, float]:
    """ACT (UT §2.2): mean, standard deviation and maximum over the positions of the
    ponder time N + R (``ponder_cost``) of the last training micro-batch (``stats``: each
    process's tensors); a task run's encoder-decoder has an encoder_ and a decoder_ one."""
    out = {}
    for k, parts in stats.items():
        if k.endswith("ponder_time"):
            p, side = torch.cat([t.detach().double().flatten() for t in parts]), k[:-len("ponder_time")]
            if p.numel():
                out.update({f"act/{side}ponder_mean": p.mean().item(),
                            f"act/{side}ponder_std": p.std(correction=0).item(),
                            f"act/{side}ponder_max": p.max().item()})
    return out


class HaltingUnit(nn.Module):
    """p = sigmoid(w . h + b) per position (UT §2.2), b initialised to act_halting_bias_init.

    Not an ``nn.Linear``, so the shared init leaves the bias alone. Computed in float64
    for a float64 model (its cached decoding then equals the full pass to float64
    rounding) and in fp32 otherwise (bf16/half weights, autocast), because the ACT
    accumulators compare sums to 1 - eps; the ACT state takes the dtype of p."""

    def __init__(self, cfg):  # a ModelConfig
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cfg.d_model) * cfg.init_std)
        self.bias = nn.Parameter(torch.full((1,), float(cfg.act_halting_bias_init)))  # 1-D: FSDP2 shards no scalars

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(torch.promote_types(h_BTD.dtype, self.weight.dtype))
        return torch.sigmoid((h_BTD.to(dtype) * self.weight.to(dtype)).sum(-1) + self.bias.to(dtype))
