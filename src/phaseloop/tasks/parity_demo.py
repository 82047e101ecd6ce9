"""Prefix parity with a hand-set Hillis-Steele scan: why depth recurrence needs the step
signal (Universal Transformer paper, "Experiments").

Task: input bits ``x_1..x_n``, output ``y_i = x_1 xor ... xor x_i`` at every position.

The hand-set rule is one weight-tied step ``f(state, t)``: at step ``t`` position ``i``
reads position ``i - 2^(t-1)`` (if it exists) and XORs it into its own state. In a
Transformer this is one attention head whose relative offset ``2^(t-1)`` comes from the
step (timestep) signal added at each recurrence. After ``t`` steps position ``i`` holds
the XOR of ``x_max(1, i-2^t+1) .. x_i``, so length ``n <= 2^T`` is solved in exactly
``T = ceil(log2 n)`` steps, and a longer input just needs more steps of the same layer
(extra steps change nothing once solved: their offsets fall before position 1).

Three models are run here, all on plain Python ints (no weights to train):

``run_shared(bits, steps)``
    the shared step with the step signal: offsets 1, 2, 4, ..., one per step, for as
    many steps as asked (default ``ceil(log2 n)``).
``run_fixed_stack(bits, n_layers)``
    a stack of ``N`` distinct layers with the offsets 1, 2, ..., 2^(N-1) baked into
    them (layer ``k`` is its own weights). It computes what ``N`` shared steps compute,
    but its depth is fixed: it solves lengths ``<= 2^N`` and fails at ``2^N + 1``
    (position ``2^N + 1`` never receives ``x_1``), with no way to add layers at test time.
``run_without_step_signal(bits, steps, offset=1)``
    the shared step with the step signal removed. Model: the step still reads exactly one
    other position at a relative offset (the hand-set rule's family), but nothing tells it
    which step it is on, so it must use the *same* offset ``d`` at every step.
    Any ``d > 1`` can never be right at position 2 (it would need ``x_1``, at offset 1).
    With ``d = 1`` information travels one position per step, so after ``t`` steps
    position ``i`` misses ``x_1`` whenever ``i > t + 1``: ``ceil(log2 n)`` steps fail for
    every ``n > ceil(log2 n) + 1`` (``n >= 4``). Worse, repeated XORs cancel: after ``t``
    steps position ``i`` holds ``xor_k C(t, k) x_(i-k)`` (Pascal's triangle mod 2), so
    ``t`` steps are exact at all ``n`` positions only when every ``k < n`` is a bit-subset
    of ``t``; the fewest steps that solve length ``n`` is ``2^ceil(log2 n) - 1``
    (``steps_needed_without_signal``): linear, not logarithmic, in ``n``.
    This is a statement about the one-offset-per-step family, not about every possible
    weight-tied layer.

Each run returns a ``ScanTrace`` with the state after every step and, per step, which
positions are correct: ``correct`` compares values with the true prefix parity on this
input; ``exact`` is the stronger, input-independent check that position ``i`` has XORed
in exactly ``x_1..x_i`` (tracked as GF(2) coefficient masks), i.e. it is right for
*every* input. A position can be ``correct`` by chance without being ``exact`` (e.g. a
missing ``x_1`` that happens to be 0); failures are stated with ``exact``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phaseloop.errors import ConfigError

# --------------------------------------------------------------------------- helpers


def _as_bits(bits) -> list[int]:
    if isinstance(bits, str):
        bad = set(bits) - {"0", "1"}
        if bad:
            raise ConfigError(f"bits must be '0'/'1' characters, got {sorted(bad)[0]!r} in {bits[:20]!r}")
        out = [1 if c == "1" else 0 for c in bits]
    else:
        if hasattr(bits, "tolist"):
            bits = bits.tolist()
        out = [int(b) for b in bits]
        if any(b not in (0, 1) for b in out):
            raise ConfigError("bits must be 0/1 values")
    if not out:
        raise ConfigError("bits must hold at least one bit")
    return out


def prefix_parity_bits(bits) -> list[int]:
    """The true prefix parity ``y_i = x_1 xor ... xor x_i`` as a list of ints."""
    acc, out = 0, []
    for b in _as_bits(bits):
        acc ^= b
        out.append(acc)
    return out


def step_offset(t: int) -> int:
    """The offset read at step ``t >= 1``: ``2^(t-1)``."""
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ConfigError(f"step t must be an integer >= 1, got {t!r}")
    return 1 << (t - 1)


def steps_needed(n: int) -> int:
    """Steps of the shared scan (with step signal) to solve length ``n``: ``ceil(log2 n)``."""
    _check_n(n)
    return (n - 1).bit_length()


def max_length_fixed_stack(n_layers: int) -> int:
    """Longest length a fixed stack of ``n_layers`` Hillis-Steele layers solves: ``2^N``."""
    return 1 << _check_count(n_layers, "n_layers")


def steps_needed_without_signal(n: int) -> int:
    """Fewest steps of the offset-1 step (no step signal) that solve length ``n``:
    ``2^ceil(log2 n) - 1`` (see module doc)."""
    _check_n(n)
    return (1 << (n - 1).bit_length()) - 1


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"length must be an integer >= 1, got {n!r}")


def _check_count(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
    return v


def _shift_xor(values: list[int], d: int) -> list[int]:
    """One read-and-XOR: ``v[i] ^ v[i-d]`` where ``i - d >= 0``, else ``v[i]``."""
    return [v ^ values[i - d] if i >= d else v for i, v in enumerate(values)]


# --------------------------------------------------------------------------- traces


@dataclass
class ScanTrace:
    """A run of a scan. ``states[0]`` is the input, ``states[t]`` the state after step
    (or layer) ``t``; ``offsets[t-1]`` is the offset read at step ``t``.
    ``correct[t][i]``: state value equals the true prefix parity at position ``i+1``.
    ``exact[t][i]``: position ``i+1`` holds exactly ``x_1 xor .. xor x_(i+1)`` for every
    input (its GF(2) coefficient mask ``masks[t][i]`` is the full prefix)."""

    model: str
    bits: list[int]
    target: list[int]
    offsets: list[int]
    states: list[list[int]]
    masks: list[list[int]]
    correct: list[list[bool]]
    exact: list[list[bool]]

    @property
    def steps(self) -> int:
        return len(self.offsets)

    @property
    def final(self) -> list[int]:
        return self.states[-1]

    @property
    def solved(self) -> bool:
        """Final state equals the prefix parity on this input."""
        return all(self.correct[-1])

    @property
    def solved_exactly(self) -> bool:
        """Final state is right for every input of this length."""
        return all(self.exact[-1])

    @property
    def first_exact_step(self) -> int | None:
        """Fewest steps after which every position is exact (``None``: never in this run)."""
        for t, row in enumerate(self.exact):
            if all(row):
                return t
        return None

    @property
    def exact_from(self) -> list[int | None]:
        """Per position, the step from which it stays exact to the end of the run
        (``None``: not exact after the last step). For the shared scan position i
        needs ceil(log2 i) steps: earlier positions finish earlier."""
        out: list[int | None] = []
        for i in range(len(self.bits)):
            t = len(self.exact)
            while t > 0 and self.exact[t - 1][i]:
                t -= 1
            out.append(t if t < len(self.exact) else None)
        return out

    @property
    def first_failure(self) -> int | None:
        """1-based position of the first non-exact position after the last step."""
        for i, ok in enumerate(self.exact[-1]):
            if not ok:
                return i + 1
        return None

    @property
    def first_wrong(self) -> int | None:
        """1-based position of the first wrong value after the last step, on this input."""
        for i, ok in enumerate(self.correct[-1]):
            if not ok:
                return i + 1
        return None

    def row(self, t: int) -> str:
        """Step ``t`` as text: ``'#'`` exact, ``'+'`` right on this input by chance,
        ``'.'`` wrong."""
        return "".join(
            "#" if e else ("+" if c else ".") for e, c in zip(self.exact[t], self.correct[t])
        )


def _run(bits, offsets: list[int], model: str) -> ScanTrace:
    x = _as_bits(bits)
    n = len(x)
    target = prefix_parity_bits(x)
    full = [(1 << (i + 1)) - 1 for i in range(n)]  # mask of x_1..x_(i+1)
    state, mask = list(x), [1 << i for i in range(n)]
    states, masks = [state], [mask]
    for d in offsets:
        state, mask = _shift_xor(state, d), _shift_xor(mask, d)
        states.append(state)
        masks.append(mask)
    correct = [[s == y for s, y in zip(st, target)] for st in states]
    exact = [[m == f for m, f in zip(mk, full)] for mk in masks]
    return ScanTrace(model, x, target, list(offsets), states, masks, correct, exact)


def scan_step(bits, t: int) -> list[int]:
    """One shared step: position ``i`` reads position ``i - 2^(t-1)`` and XORs it in
    (positions before ``2^(t-1) + 1`` are unchanged). ``t >= 1`` is the step signal."""
    return _shift_xor(_as_bits(bits), step_offset(t))


def run_shared(bits, steps: int | None = None) -> ScanTrace:
    """Run the weight-tied step with the step signal for ``steps`` steps (default
    ``ceil(log2 n)``); step ``t`` uses offset ``2^(t-1)``."""
    x = _as_bits(bits)
    steps = steps_needed(len(x)) if steps is None else _check_count(steps, "steps")
    return _run(x, [step_offset(t) for t in range(1, steps + 1)], "shared")


def run_fixed_stack(bits, n_layers: int) -> ScanTrace:
    """A fixed stack of ``n_layers`` distinct layers; layer ``k`` has offset ``2^(k-1)``
    baked in. Solves lengths ``<= 2^N``; fails for longer inputs."""
    n_layers = _check_count(n_layers, "n_layers")
    return _run(bits, [1 << k for k in range(n_layers)], "fixed_stack")


def run_without_step_signal(bits, steps: int, offset: int = 1) -> ScanTrace:
    """The shared step without the step signal: the same ``offset`` (default 1) at every
    step (see module doc for why this is the model and why it fails)."""
    steps = _check_count(steps, "steps")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 1:
        raise ConfigError(f"offset must be an integer >= 1, got {offset!r}")
    return _run(bits, [offset] * steps, "no_step_signal")


# --------------------------------------------------------------------------- report


def random_bits(length: int, seed: int = 0) -> list[int]:
    """``length`` random bits, deterministic in ``seed``."""
    _check_n(length)
    return [int(b) for b in np.random.default_rng(seed).integers(0, 2, size=length)]


def _steps(k: int) -> str:
    return f"{k} step" if k == 1 else f"{k} steps"


def _count(row: list[bool]) -> int:
    return sum(1 for v in row if v)


def render_demo(
    length: int,
    seed: int = 0,
    n_layers: int | None = None,
    steps_without_signal: int | None = None,
) -> str:
    """A text report of the three scans on ``length`` random bits (``seed``).

    ``n_layers`` (fixed stack) defaults to ``ceil(log2 n) - 1`` so the stack is one layer
    short; ``steps_without_signal`` defaults to ``ceil(log2 n)``, the steps the shared
    step with the signal needs."""
    x = random_bits(length, seed)
    n = len(x)
    T = steps_needed(n)
    N = max(T - 1, 0) if n_layers is None else _check_count(n_layers, "n_layers")
    S = T if steps_without_signal is None else _check_count(steps_without_signal, "steps_without_signal")

    shared = run_shared(x)
    stack = run_fixed_stack(x, N)
    nosig = run_without_step_signal(x, S)

    def line(label: str, tr: ScanTrace, t: int) -> str:
        return (
            f"  {label:<20} {tr.row(t)}  {_count(tr.exact[t])}/{n} exact,"
            f" {_count(tr.correct[t])}/{n} right on this input"
        )

    bits_s = "".join(map(str, x))
    out = [
        f"Prefix parity by a hand-set Hillis-Steele scan: length n = {n}, seed {seed}",
        f"  {'input x':<20} {bits_s}",
        f"  {'target y':<20} {''.join(map(str, shared.target))}   (y_i = x_1 xor ... xor x_i)",
        "  legend: '#' right for every input (position i has XORed in exactly x_1..x_i),",
        "          '+' right on this input only by chance, '.' wrong",
        "",
        "1) Shared step WITH the step signal: step t reads position i - 2^(t-1) and XORs it in.",
        line("step 0 (input)", shared, 0),
    ]
    for t in range(1, shared.steps + 1):
        out.append(line(f"step {t} (offset {shared.offsets[t - 1]})", shared, t))
    out.append(
        f"  -> solved in {_steps(shared.first_exact_step)} = ceil(log2 {n}); length <= 2^T needs T steps,"
        " so a longer input just runs the same layer for more steps."
    )

    out += ["", f"2) Fixed stack of N = {N} distinct layers (offsets "
            + (", ".join(str(d) for d in stack.offsets) or "none")
            + "); layer k computes what shared step k does.",
            line(f"after layer {N}", stack, N)]
    cap = max_length_fixed_stack(N)
    if n > cap:
        out.append(
            f"  -> covers lengths <= 2^{N} = {cap} only: fails from position {stack.first_failure}"
            f" = 2^{N} + 1 (it never receives x_1); a fixed stack cannot add layers at test time."
        )
    else:
        out.append(f"  -> length {n} <= 2^{N} = {cap}: no failure at this length; try a longer input.")

    out += [
        "",
        f"3) Shared step WITHOUT the step signal ({_steps(S)}): it cannot tell which step it is on,",
        "   so it reads the same offset (1) every step; any fixed offset > 1 is never right at position 2.",
        line("step 0 (input)", nosig, 0),
    ]
    for t in range(1, nosig.steps + 1):
        out.append(line(f"step {t} (offset {nosig.offsets[t - 1]})", nosig, t))
    need = steps_needed_without_signal(n)
    if nosig.solved_exactly:
        out.append(f"  -> solved at this length in {_steps(S)} (with the step signal: {_steps(T)}).")
    else:
        out.append(
            f"  -> fails from position {nosig.first_failure}: information moves one position per step"
            f" and repeated XORs cancel (Pascal's triangle mod 2). Solving length {n} this way takes"
            f" {need} = 2^{T} - 1 steps, versus {_steps(T)} with the step signal."
        )
    return "\n".join(out)


__all__ = [
    "ScanTrace",
    "scan_step",
    "run_shared",
    "run_fixed_stack",
    "run_without_step_signal",
    "render_demo",
    "random_bits",
    "prefix_parity_bits",
    "step_offset",
    "steps_needed",
    "steps_needed_without_signal",
    "max_length_fixed_stack",
]
