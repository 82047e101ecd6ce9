"""Tests for phaseloop.archs.act: tensor2tensor's "basic" ACT arithmetic on hand-computed cases."""

import math

import pytest
import torch

from phaseloop.archs.act import (
    ACTState,
    HaltingSchedule,
    combine,
    effective_weights,
    halting_schedule,
    ponder_cost,
    ponder_loss,
)

D = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=D)


# Hand-computed 3-step example, threshold 0.9, max_steps = steps = 3.
# Columns = positions A, B, C, E.
#   A: p1=0.95 > 0.9 -> halts at step 1: R = 1 - 0 = 1, w = [1, 0, 0], n = 1, hp = 1.
#   B: 0.3 -> hp .3 (w .3); +.5 -> .8 <= .9 (w .5); +.4 -> 1.2 > .9 halts:
#      R = 1 - .8 = .2, w = [.3, .5, .2], n = 3, hp = 1.
#   C: .2, .3, .1 -> hp .2, .5, .6, never crosses; loop ends at max_steps=3:
#      R = 0, w = [.2, .3, .1] (sum .6), n = 3, hp = .6.
#   E: .5 (hp .5), .45 -> .95 > .9 halts at step 2: R = .5, w = [.5, .5, 0], n = 2, hp = 1.
# Effective ("basic") weights e_k = w_k * prod_{j>k}(1 - w_j):
#   A: [1, 0, 0]
#   B: e3 = .2, e2 = .5*.8 = .4, e1 = .3*.5*.8 = .12         (sum .72 = 1 - .7*.5*.8)
#   C: e3 = .1, e2 = .3*.9 = .27, e1 = .2*.7*.9 = .126       (sum .496 = 1 - .8*.7*.9)
#   E: e3 = 0, e2 = .5, e1 = .5*.5 = .25                      (sum .75 = 1 - .5*.5)
P3 = [[0.95, 0.3, 0.2, 0.5],
      [0.7, 0.5, 0.3, 0.45],
      [0.6, 0.4, 0.1, 0.8]]


def close(a, b, tol=1e-9):
    assert torch.allclose(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=tol, rtol=0), (a, b)


def test_hand_computed_three_steps():
    s = halting_schedule(t(P3), threshold=0.9)
    assert isinstance(s, HaltingSchedule)
    close(s.update_weights, [[1.0, 0.3, 0.2, 0.5],
                             [0.0, 0.5, 0.3, 0.5],
                             [0.0, 0.2, 0.1, 0.0]])
    close(s.n_updates, [1, 3, 3, 2])
    close(s.remainders, [1.0, 0.2, 0.0, 0.5])
    close(s.halting_probability, [1.0, 1.0, 0.6, 1.0])
    close(s.effective_weights, [[1.0, 0.12, 0.126, 0.25],
                                [0.0, 0.4, 0.27, 0.5],
                                [0.0, 0.2, 0.1, 0.0]])
    assert s.steps_run == 3
    close(ponder_cost(s), [2.0, 3.2, 3.0, 2.5])
    close(ponder_loss(s, weight=0.01), 0.01 * (2.0 + 3.2 + 3.0 + 2.5) / 4)
    acc = halting_schedule(t(P3), threshold=0.9, mode="accumulated")
    close(acc.effective_weights, acc.update_weights)
    close(acc.update_weights, s.update_weights)


def test_immediate_halt():
    s = halting_schedule(t([[0.995], [0.5]]), threshold=0.99)
    close(s.update_weights, [[1.0], [0.0]])
    close(s.remainders, [1.0])
    close(s.n_updates, [1.0])
    close(s.halting_probability, [1.0])
    assert s.steps_run == 1


def test_halted_weights_sum_to_one_and_remainder():
    g = torch.Generator().manual_seed(0)
    p = torch.rand(8, 64, generator=g, dtype=torch.float32) * 0.25
    s = halting_schedule(p, threshold=0.99)
    halted = s.halting_probability >= 0.99
    assert halted.any() and (~halted).any()
    sums = s.update_weights.sum(0)
    assert torch.allclose(sums[halted], torch.ones_like(sums[halted]), atol=1e-6)
    # halting step k = n_updates; R = 1 - sum of the p before it; w_k = R
    for i in torch.nonzero(halted).flatten().tolist():
        k = int(s.n_updates[i])
        r = 1 - p[: k - 1, i].sum()
        assert abs(float(s.remainders[i] - r)) < 1e-6
        assert abs(float(s.update_weights[k - 1, i] - r)) < 1e-6
        close(s.update_weights[: k - 1, i], p[: k - 1, i], 1e-7)
        assert (s.update_weights[k:, i] == 0).all()
    # the rest hit max_steps first: no remainder, weights are p and sum to < 1
    assert (s.remainders[~halted] == 0).all()
    assert (s.n_updates[~halted] == 8).all()
    assert (sums[~halted] < 1).all()
    close(s.update_weights[:, ~halted], p[:, ~halted], 1e-7)


def test_max_steps_gives_no_remainder():
    p = t([[0.3], [0.3], [0.3], [0.3]])
    s = halting_schedule(p, threshold=0.99, max_steps=2)
    close(s.update_weights, [[0.3], [0.3], [0.0], [0.0]])
    close(s.remainders, [0.0])
    close(s.n_updates, [2.0])
    assert s.steps_run == 2
    assert float(s.update_weights.sum()) < 1


def test_halted_positions_get_zero_weight_and_loop_stops_early():
    # All halt by step 2; rows 3..5 are NaN and must never be read.
    nan = float("nan")
    p = t([[0.6, 0.995], [0.6, 0.2]] + [[nan, nan]] * 3)
    s = halting_schedule(p, threshold=0.99)
    assert s.steps_run == 2
    close(s.update_weights, [[0.6, 1.0], [0.4, 0.0], [0, 0], [0, 0], [0, 0]])
    close(s.n_updates, [2.0, 1.0])
    assert torch.isfinite(s.effective_weights).all()


def test_effective_weights_match_combine():
    g = torch.Generator().manual_seed(1)
    steps, pos, hid = 6, 10, 3
    p = torch.rand(steps, pos, generator=g, dtype=D) * 0.5
    states = torch.randn(steps, pos, hid, generator=g, dtype=D)
    for mode in ("basic", "accumulated"):
        s = halting_schedule(p, threshold=0.95, mode=mode)
        w, e = s.update_weights, s.effective_weights
        if mode == "basic":
            for k in range(steps):
                close(e[k], w[k] * torch.prod(1 - w[k + 1:], dim=0))
            close(e.sum(0), 1 - torch.prod(1 - w, dim=0))
        else:
            close(e, w)
        out = torch.zeros(pos, hid, dtype=D)
        for k in range(steps):
            out = combine(out, states[k], w[k], mode)
        close(out, (e.unsqueeze(-1) * states).sum(0))
    # accepts weights with a trailing 1, too
    close(combine(torch.zeros(2, 3), torch.ones(2, 3), torch.tensor([[0.5], [1.0]])),
          [[0.5] * 3, [1.0] * 3])


def test_step_by_step_matches_schedule_on_batch_shape():
    g = torch.Generator().manual_seed(2)
    p = torch.rand(5, 2, 3, generator=g) * 0.6  # [steps, batch, length]
    st = ACTState.like(p[0])
    ws = []
    while st.running(0.9, 5).any():
        ws.append(st.step(p[len(ws)], 0.9))
    s = halting_schedule(p.reshape(5, 6), threshold=0.9)
    assert s.steps_run == len(ws)
    close(torch.stack(ws).reshape(len(ws), 6), s.update_weights[: len(ws)])
    close(st.remainders.reshape(6), s.remainders)
    close(st.n_updates.reshape(6), s.n_updates)
    close(ponder_loss(st), ponder_loss(s))


def test_ponder_gradient_flows_via_remainders_only():
    # Same P3 case: R_A = 1 (const), R_B = 1 - p1 - p2, R_C = 0, R_E = 1 - p1.
    # loss = w/4 * sum(n + R)  =>  dloss/dp = -w/4 at B rows 1,2 and E row 1, else 0.
    w = 0.01
    p = t(P3).requires_grad_(True)
    loss = ponder_loss(halting_schedule(p, threshold=0.9), weight=w)
    (grad,) = torch.autograd.grad(loss, p)
    expected = torch.zeros(3, 4, dtype=D)
    expected[0, 1] = expected[1, 1] = expected[0, 3] = -w / 4
    close(grad, expected, 1e-12)
    assert grad.abs().sum() > 0
    # finite difference (perturbation small enough not to change any halting decision)
    h = 1e-6
    for i in range(3):
        for j in range(4):
            dp = torch.zeros(3, 4, dtype=D)
            dp[i, j] = h
            lp = ponder_loss(halting_schedule(t(P3) + dp, threshold=0.9), weight=w)
            lm = ponder_loss(halting_schedule(t(P3) - dp, threshold=0.9), weight=w)
            assert abs(float((lp - lm) / (2 * h)) - float(expected[i, j])) < 1e-7
    # n_updates carries no gradient; the halting-step weight R does
    s = halting_schedule(p, threshold=0.9)
    assert not s.n_updates.requires_grad
    (gw,) = torch.autograd.grad(s.update_weights[2, 1], p)  # B's weight at step 3 = 1-p1-p2
    close(gw[:, 1], [-1.0, -1.0, 0.0], 1e-12)


@pytest.mark.parametrize("kwargs", [
    dict(mode="global"),
    dict(threshold=0.0),
    dict(threshold=1.5),
    dict(max_steps=0),
    dict(max_steps=4),
])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        halting_schedule(t(P3), **kwargs)


@pytest.mark.parametrize("p", [torch.rand(3), torch.rand(2, 3, 4), torch.ones(2, 2, dtype=torch.long)])
def test_bad_shape_or_dtype(p):
    with pytest.raises(ValueError):
        halting_schedule(p)


def test_combine_and_effective_weights_reject_bad_mode():
    with pytest.raises(ValueError):
        combine(torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2), mode="nope")
    with pytest.raises(ValueError):
        effective_weights(torch.ones(2, 3), mode="nope")
    assert math.isclose(float(ponder_cost(ACTState.zeros(2)).sum()), 0.0)


def test_t2t_literal_by_hand():
    """tensor2tensor's basic-ACT line as written, ``transformed * w + (previous_state * 1 -
    update_weights)``: by precedence previous - w, not previous * (1 - w)."""
    prev = t([[2.0, -1.0, 0.5]])
    new = t([[10.0, 20.0, 30.0]])
    w = t([0.25])
    close(combine(prev, new, w, "t2t_literal"), [[2.5 + 2 - 0.25, 5 - 1 - 0.25, 7.5 + 0.5 - 0.25]])
    close(combine(prev, new, w, "basic"), [[2.5 + 1.5, 5 - 0.75, 7.5 + 0.375]])
    # over the P3 schedule (threshold 0.9), from the zero initial state: the output is
    # sum_k w_k s_k - sum_k w_k on every channel (w = the hand-computed update weights)
    g = torch.Generator().manual_seed(3)
    states = torch.randn(3, 4, 2, generator=g, dtype=D)
    s = halting_schedule(t(P3), threshold=0.9, mode="t2t_literal")
    w = t([[1.0, 0.3, 0.2, 0.5], [0.0, 0.5, 0.3, 0.5], [0.0, 0.2, 0.1, 0.0]])
    close(s.update_weights, w)  # the halting arithmetic is the same in every mode
    close(s.effective_weights, w)
    out = torch.zeros(4, 2, dtype=D)
    for k in range(3):
        out = combine(out, states[k], w[k], "t2t_literal")
    close(out, (w.unsqueeze(-1) * states).sum(0) - w.sum(0).unsqueeze(-1))
    # position A halts at step 1 with w = 1: basic gives s_1, the literal line s_1 - 1
    close(out[0], states[0, 0] - 1)


def test_listing_line_by_line_on_the_explainer_examples():
    """The explore executor's trace (paper appendix C, Listing 2): right after init p =
    sigmoid(1) halts every position at step 2 (R 0.2689, ponder 2.269, effective weights
    0.5344 + 0.2689 = 0.8034); p > 0.99 halts at step 1 (R 1, ponder 2); p = 0.05 runs all
    12 steps (sum 0.60, R 0, ponder 12, weights summing to 1 - 0.95^12)."""
    from phaseloop.archs.act import listing

    p = torch.full((12, 2), 1 / (1 + math.exp(-1)), dtype=torch.float64)
    p[0, 1] = 0.995
    out = listing(p)
    s = out["schedule"]
    assert s.steps_run == 2 and s.n_updates.tolist() == [2.0, 1.0]
    close(s.remainders, [1 - 0.7310585786300049, 1.0])
    close(out["ponder_cost"], [2.2689414213699951, 2.0])
    close(s.effective_weights[:2, 0], [0.7310585786 * (1 - 0.2689414214), 0.2689414214], 1e-9)
    assert round(s.effective_weights[:, 0].sum().item(), 4) == 0.8034
    first, second = out["steps"]
    assert first["still_running_before"].tolist() == [1.0, 1.0]
    assert first["new_halted"].tolist() == [0.0, 1.0] and first["still_running"].tolist() == [1.0, 0.0]
    close(first["update_weights"], [0.7310585786300049, 1.0])
    assert second["still_running_before"].tolist() == [1.0, 0.0]
    assert second["new_halted"].tolist() == [1.0, 0.0]
    close(second["halting_probability"], [1.0, 1.0])
    close(out["state_weights"], s.effective_weights)  # combine() on unit states = the weights
    hes = listing(torch.full((12, 1), 0.05, dtype=torch.float64))
    assert hes["schedule"].steps_run == 12 and hes["schedule"].remainders.item() == 0
    close(hes["steps"][-1]["halting_probability"], [0.6])
    close(hes["ponder_cost"], [12.0])
    close(hes["schedule"].effective_weights.sum(), 1 - 0.95 ** 12)
    lit = listing(p[:, :1], mode="t2t_literal")  # previous - w on every channel
    w = lit["schedule"].update_weights[:, 0]
    close(lit["state_weights"][:, 0], w - w.sum())


def test_pending_inputs_join_their_parts_once_when_read():
    from phaseloop.archs.act import PendingInputs
    parts = [torch.randn(2, n, 4) for n in (3, 1, 1, 2)]
    p = PendingInputs(5, parts[0])
    for i, x in enumerate(parts[1:]):
        p.extend(5 + sum(q.shape[1] for q in parts[:i + 1]), x)
    assert len(p.parts) == 4 and p.n == 7  # appended, not copied a token at a time
    assert p.truncate(12) is p and p.truncate(20) is p and len(p.parts) == 4  # nothing to cut: not joined
    assert p.nbytes == sum(q.nbytes for q in parts)
    joined = p.x
    assert torch.equal(joined, torch.cat(parts, 1)) and len(p.parts) == 1 and p.x is joined
    assert torch.equal(p.truncate(9).x, joined[:, :4]) and p.truncate(5) is None
    assert torch.equal(p.select_rows(torch.tensor([1])).x, joined[1:])
    with pytest.raises(ValueError, match="do not follow those up to 12"):
        p.extend(13, parts[1])


def test_a_decode_appends_pending_step_inputs_without_joining_them():
    from phaseloop import ModelConfig, build_model
    from phaseloop.layers import KVCache
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("universal-act-tiny", act_halting_bias_init=6.0)  # p > 0.99: all halt at step 1
    model = build_model(cfg).eval()
    cache = KVCache()
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 4)), cache=cache)
        for _ in range(5):
            model(torch.randint(0, 256, (1, 1)), cache=cache)
    pending = cache.entries[("ut_in", 1)]
    assert (pending.start, pending.n, len(pending.parts)) == (0, 9, 6)
