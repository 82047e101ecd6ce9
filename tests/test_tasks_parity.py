"""The hand-set Hillis-Steele prefix-parity scan demo."""

import pytest

from phaseloop.tasks.parity_demo import (
    prefix_parity_bits,
    random_bits,
    render_demo,
    run_fixed_stack,
    run_shared,
    run_without_step_signal,
    scan_step,
    steps_needed,
    steps_needed_without_signal,
)


def test_scan_step_offsets():
    x = [1, 0, 1, 1, 0, 0, 1, 0]
    assert scan_step(x, 1) == [1, 1, 1, 0, 1, 0, 1, 1]  # reads i-1
    assert scan_step(x, 3) == [1, 0, 1, 1, 1, 0, 0, 1]  # reads i-4
    assert scan_step("10", 2) == [1, 0]  # offset 2 reads nothing at length 2
    with pytest.raises(ValueError):
        scan_step(x, 0)


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 7])
def test_shared_solves_2_pow_T_in_exactly_T_steps(T):
    n = 2**T
    x = random_bits(n, seed=T)
    tr = run_shared(x)
    assert tr.steps == T == steps_needed(n)
    assert tr.solved and tr.solved_exactly
    assert tr.final == prefix_parity_bits(x)
    assert tr.first_exact_step == T  # not before: T-1 steps leave positions uncovered
    assert not all(tr.exact[T - 1])
    # per-step correctness: after t steps exactly the first 2^t positions are exact
    for t in range(T + 1):
        assert tr.exact[t] == [i < 2**t for i in range(n)]
    # more steps of the same layer change nothing once solved
    assert run_shared(x, steps=T + 3).final == tr.final


@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_shared_fails_at_2_pow_T_plus_1_with_T_steps(T):
    n = 2**T + 1
    ones = [1] * n  # x_1 = 1, so the missing x_1 shows in the value
    tr = run_shared(ones, steps=T)
    assert not tr.solved and not tr.solved_exactly
    assert tr.first_failure == n and tr.first_wrong == n
    # and the default step count (ceil(log2 n) = T + 1) solves it
    full = run_shared(ones)
    assert full.steps == T + 1 and full.solved_exactly


@pytest.mark.parametrize("N", [1, 2, 3, 4])
def test_fixed_stack_fails_past_2_pow_N(N):
    ok = run_fixed_stack(random_bits(2**N, seed=N), N)
    assert ok.solved_exactly and ok.offsets == [2**k for k in range(N)]
    bad = run_fixed_stack([1] * (2**N + 1), N)
    assert not bad.solved and bad.first_failure == 2**N + 1
    # a random input of length 2^N + 1 is never right for every input
    assert not run_fixed_stack(random_bits(2**N + 1, seed=0), N).solved_exactly


@pytest.mark.parametrize("n", [4, 5, 8, 16, 100])
def test_without_step_signal_fails_with_log_steps(n):
    T = steps_needed(n)
    assert n > T + 1
    tr = run_without_step_signal([1] * n, T)
    assert tr.offsets == [1] * T
    assert not tr.solved_exactly and not tr.solved
    # reach grows by one position per step: positions past T + 1 never hold x_1
    assert not any(tr.exact[-1][T + 1 :])
    assert tr.first_failure <= T + 2
    # the shared step with the signal solves the same input in the same number of steps
    assert run_shared([1] * n, steps=T).solved


def test_without_step_signal_reach_and_step_count():
    for n in range(1, 34):
        need = steps_needed_without_signal(n)
        assert need >= n - 1
        assert run_without_step_signal(random_bits(n, 1), need).solved_exactly
        first = next(t for t in range(need + 1) if run_without_step_signal([1] * n, t).solved_exactly)
        assert first == need, n
    # any fixed offset > 1 is never right at position 2
    for d in (2, 3):
        tr = run_without_step_signal([1, 0, 0, 0, 0, 0], 20, offset=d)
        assert not tr.exact[-1][1] and not tr.correct[-1][1]


def test_render_demo_report():
    text = render_demo(100, seed=0)
    lines = text.splitlines()
    shared_rows = [ln for ln in lines if ln.strip().startswith("step ")]
    assert "solved in 7 steps" in text
    assert "fails from position 65 = 2^6 + 1" in text
    assert "127 = 2^7 - 1 steps" in text
    last_shared = next(ln for ln in lines if "step 7 (offset 64)" in ln)
    assert "#" * 100 in last_shared and "100/100 exact" in last_shared
    assert any("step 1 (offset 1)" in ln and "2/100 exact" in ln for ln in shared_rows)
    assert render_demo(100, seed=0) == text  # deterministic
    assert render_demo(100, seed=1) != text
    assert "solved in 0 steps" in render_demo(1)


def test_exact_from_each_position_needs_ceil_log2_i_steps():
    from phaseloop.tasks.parity_demo import steps_needed

    for n in (40, 400):
        tr = run_shared(random_bits(n, seed=1))
        assert tr.steps == {40: 6, 400: 9}[n]
        assert tr.exact_from == [steps_needed(i) for i in range(1, n + 1)]
    stack = run_fixed_stack(random_bits(70), 6)  # N = 6 covers 64
    assert stack.exact_from[63] == 6 and stack.exact_from[64:] == [None] * 6
