"""Precision across dtypes (issue 15, item 9): the 3PT rotation and horn are exact in
float64, every architecture runs after ``.to(bfloat16)`` / ``.to(float16)`` /
``.to(float64)``, and float64 cached decoding equals the full pass with rtol=0."""

import math

import pytest
import torch

from phaseloop import ModelConfig, build_model
from phaseloop.archs.three_phase import HornInjection, PhaseRotation, phase_offsets
from phaseloop.layers import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")

F64_ATOL = 1e-10  # the documented float64 tolerance (docs/universal.md), with rtol=0

# ---------------------------------------------------------------------------- architectures
# d_model 48: 6 heads of 8, 3 kv heads, N = 3 phases of 16 channels.
_BASE = dict(vocab_size=64, d_model=48, n_heads=6, n_kv_heads=3, d_ff=96, max_seq_len=32)
_3PT = dict(n_phases=3, phase_rotation=True, phase_norm=True, horn=True)
_LOOP = dict(n_layers=3, n_begin=1, n_end=1, n_loops=2)
_UT = dict(arch="universal", n_layers=1, n_steps=3, embed_scale=True, embed_init_std=48 ** -0.5)
_ACT = dict(_UT, act=True, act_max_steps=5)

ARCHS = {
    "rope": dict(arch="rope", n_layers=2),
    "rope-no-rope": dict(arch="rope", n_layers=2, use_rope=False),
    "three_phase": dict(arch="three_phase", n_layers=2),
    "three_phase-ablations": dict(arch="three_phase", n_layers=2, learnable_offsets=True,
                                  residual_rotation=True, learnable_horn=True),
    "rope+3pt": dict(arch="rope", n_layers=2, **_3PT),
    "universal": dict(_UT),
    "universal-learned": dict(_UT, step_signal="learned"),
    "universal-act": dict(_ACT),
    "universal-act-accumulated": dict(_ACT, act_type="accumulated"),
    "universal+3pt": dict(_UT, **_3PT),
    "universal-act+3pt": dict(_ACT, **_3PT),
    "looped": dict(arch="looped", **_LOOP),
    "looped+3pt": dict(arch="looped", **_LOOP, **_3PT),
    "hyperloop-diagonal": dict(arch="hyperloop", **_LOOP),
    "hyperloop-sinkhorn": dict(arch="hyperloop", **_LOOP, hc_res="sinkhorn"),
    "hyperloop-identity": dict(arch="hyperloop", **_LOOP, hc_res="identity"),
    "hyperloop-per-layer": dict(arch="hyperloop", **_LOOP, hc_per_layer=True),
    "hyperloop-pooled-mlp": dict(arch="hyperloop", **_LOOP, hc_transition="pooled_mlp"),
    "hyperloop+3pt": dict(arch="hyperloop", **_LOOP, **_3PT),
    "mhc-sinkhorn": dict(arch="mhc", n_layers=2),
    "mhc-diagonal": dict(arch="mhc", n_layers=2, hc_res="diagonal"),
    "mhc-identity": dict(arch="mhc", n_layers=2, hc_res="identity"),
    "mhc+3pt": dict(arch="mhc", n_layers=2, **_3PT),
}


def build(name, seed=0):
    """Float32 model of ``name`` in eval mode; non-default parameters where a default
    would hide something (ACT halting at different steps, active hyper-connections)."""
    torch.manual_seed(seed)
    m = build_model(ModelConfig(**_BASE, **ARCHS[name])).eval()
    with torch.no_grad():
        if m.cfg.act:  # positions halt at different steps (init halts all at step 2)
            h = m.trunk.halting
            h.weight.zero_()
            h.weight[:4] = torch.randn(4)
            h.bias.fill_(-0.5)
        for hc in getattr(m.trunk, "hc", []):
            if hasattr(hc, "alpha"):  # make the token-dependent coefficients matter
                hc.alpha.fill_(1.0)
        for mod in m.modules():  # angles away from the init grid
            if isinstance(mod, PhaseRotation):
                mod.theta.add_(0.3 * torch.randn_like(mod.theta))
    return m


def idx_BT(B=2, T=16, seed=1):
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(seed))


def pieces(m, idx, cuts=(6, 7, 8, 9, 12)):
    """Prefill, token by token, then a chunk after a cached prefix."""
    cache = KVCache()
    bounds = [0, *cuts, idx.shape[1]]
    out = [m(idx[:, a:b], cache=cache).logits for a, b in zip(bounds, bounds[1:])]
    assert cache.pos == idx.shape[1]
    return torch.cat(out, 1)


# ---------------------------------------------------------------------------- (a) 3PT in float64
def givens_float64(x, theta, N):
    """Independent rotation (test_three_phase's per-pair loop, cos/sin from ``math`` in
    float64, each pair by a hand-written 2x2 Givens matrix in x's dtype)."""
    from test_three_phase import givens_reference

    return givens_reference(x, theta, N)


def rotation64(N, residual=False):
    cfg = ModelConfig(arch="three_phase", vocab_size=64, d_model=48, n_layers=3, n_heads=6,
                      n_kv_heads=6, d_ff=96, n_phases=N, phase_aligned_gqa=False,
                      residual_rotation=residual)
    pr = PhaseRotation(cfg, layer_idx=1, n_layers=3).to(torch.float64)
    with torch.no_grad():
        pr.theta.copy_(torch.randn(pr.theta.shape, dtype=torch.float64,
                                   generator=torch.Generator().manual_seed(N)))
    return pr


@pytest.mark.parametrize("N", [1, 2, 3, 6])
def test_float64_rotation_equals_independent_float64_givens(N):
    pr = rotation64(N)
    x = torch.randn(2, 5, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = pr(x)
    assert y.dtype == torch.float64
    want = givens_float64(x, pr.theta.tolist(), N)
    torch.testing.assert_close(y, want, atol=1e-14, rtol=0)
    angles = torch.tensor([[t + 2 * math.pi * i / N for t in pr.theta.tolist()] for i in range(N)],
                          dtype=torch.float64)
    torch.testing.assert_close(pr.angles(), angles, atol=1e-15, rtol=0)
    res = rotation64(N, residual=True)
    torch.testing.assert_close(res(x), x + givens_float64(x, res.theta.tolist(), N), atol=1e-14, rtol=0)


def test_float32_offsets_miss_the_float64_tolerance():
    """The check above tells float32 offsets apart: widened float32 values of 2*pi*i/3
    (what a float32 buffer gives after .double()) are off by ~1e-7 rad."""
    pr = rotation64(3)
    x = torch.randn(2, 5, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = givens_float64(x, pr.theta.tolist(), 3)
    off32 = phase_offsets(3, torch.float32).double()
    assert (off32 - phase_offsets(3, torch.float64)).abs().max() > 1e-8
    a_P = (pr.theta[None, :] + off32[:, None]).flatten()
    z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
    y32off = torch.view_as_real(z * torch.polar(torch.ones_like(a_P), a_P)).flatten(-2)
    assert (y32off - want).abs().max() > 1e-9  # far outside atol=1e-14


def test_float64_rotation_in_a_model_is_exact():
    """Inside a float64 3PT model every rotation equals the float64 reference."""
    m = build("three_phase").to(torch.float64)
    seen = []
    for layer in m.trunk.layers:
        layer.between.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0], out)))
    m(idx_BT())
    assert len(seen) == 2
    for mod, x, y in seen:
        assert x.dtype == y.dtype == torch.float64
        torch.testing.assert_close(y, givens_float64(x, mod.theta.tolist(), 3), atol=1e-14, rtol=0)


@pytest.mark.parametrize("start", [0, 5])
def test_float64_horn_is_exact(start):
    horn = HornInjection(ModelConfig(arch="three_phase", vocab_size=64, d_model=48, n_layers=1,
                                     n_heads=6, n_kv_heads=3)).to(torch.float64)
    x = torch.randn(2, 7, 48, dtype=torch.float64)
    y = horn(x, start_pos=start)
    want = torch.tensor([1 / (t + 1) for t in range(start, start + 7)], dtype=torch.float64)
    torch.testing.assert_close(y.mean(-1), want.expand(2, 7), atol=1e-15, rtol=0)


def test_float32_path_of_the_rotation_is_unchanged():
    """fp32: the rotation is still the complex product with the fp32 offsets buffer."""
    pr = rotation64(3).float()
    x = torch.randn(2, 5, 48)
    a_P = (pr.theta[None, :] + pr.offsets[:, None]).flatten()
    z = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
    want = torch.view_as_real(z * torch.polar(torch.ones_like(a_P), a_P)).flatten(-2)
    assert pr.offsets.dtype == torch.float32 and torch.equal(pr(x), want)


# ---------------------------------------------------------------------------- (b) dtypes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ARCHS)
def test_low_precision_forward_and_cached_generation(name, dtype):
    """After .to(bf16/half): finite logits in that dtype, close to the fp32 model; a
    cached greedy step runs. ACT halting and the 3PT rotation compute in fp32."""
    m = build(name)
    idx = idx_BT()
    want = m(idx).logits
    m.to(dtype)
    out = m(idx)
    assert out.logits.dtype == dtype and torch.isfinite(out.logits).all()
    err = (out.logits.float() - want).abs().max().item()
    assert err < 0.1 * want.abs().max().item() + 0.05, err
    if m.cfg.act:
        assert out.stats["halting_probs"].dtype == torch.float32
    cache = KVCache()
    first = m(idx[:, :8], cache=cache).logits
    step = m(first[:, -1:].float().argmax(-1), cache=cache).logits
    assert step.dtype == dtype and step.shape == (2, 1, 64) and torch.isfinite(step).all()
    assert m.generate(idx[:, :4], 3, temperature=0.0).shape == (2, 7)


@pytest.mark.parametrize("name", ARCHS)
def test_float64_forward_matches_float32(name):
    m = build(name)
    idx = idx_BT()
    want = m(idx).logits
    out = m.to(torch.float64)(idx)
    assert out.logits.dtype == torch.float64
    torch.testing.assert_close(out.logits.float(), want, atol=1e-4, rtol=0)
    if m.cfg.act:  # float64 model: float64 halting and ACT accumulators
        assert out.stats["halting_probs"].dtype == torch.float64
        assert out.stats["ponder_time"].dtype == torch.float64


# ---------------------------------------------------------------------------- (c) float64 cache
@pytest.mark.parametrize("name", ARCHS)
def test_float64_cached_decoding_equals_full_pass(name):
    m = build(name).to(torch.float64)
    idx = idx_BT()
    full = m(idx)
    if m.cfg.act:  # positions do halt at different steps
        assert len(set(full.stats["ponder_time"].floor().flatten().tolist())) > 1
    torch.testing.assert_close(pieces(m, idx), full.logits, atol=F64_ATOL, rtol=0)
    a = m.generate(idx[:, :5], 6, temperature=0.0, use_cache=True)
    assert torch.equal(a, m.generate(idx[:, :5], 6, temperature=0.0, use_cache=False))
