"""Learn endpoints for the Three-Phase Transformer (Abu Ayyash 2026, arXiv 2604.14430) and
Hyperloop (Zeitoun et al. 2026, arXiv 2604.21254): every number from ``three_phase``,
``hyperconn``, ``hyperloop``'s presets and ``params``.
"""

from __future__ import annotations

import functools
import threading

import torch

from phaseloop.analysis.params import breakdown
from phaseloop.archs.hyperconn import HyperConnection, copy_streams
from phaseloop.archs.three_phase import HornInjection, PhaseRotation, horn_zero_sum, phase_offsets, zero_sum_diagnostic
from phaseloop.config import ModelConfig
from phaseloop.explore.context import choice, number

# --------------------------------------------------------------------------- 3PT


def _tiny_3pt(n: int, **kw) -> ModelConfig:
    """The smallest 3PT config with N stripes: one channel pair per stripe."""
    return ModelConfig(**{**dict(arch="three_phase", vocab_size=16, d_model=2 * n, n_layers=1,
                                 n_heads=n, n_kv_heads=n, d_ff=8, max_seq_len=8, n_phases=n), **kw})


def wheel(ctx, params) -> dict:
    """The phase offsets 2πi/N and a PhaseRotation (3PT §2.2) acting on each stripe's
    one channel pair, with the shared angle θ set from the slider; input (x0, x1)."""
    n = number(params, "n", default=3, lo=1, hi=12)
    theta = number(params, "theta", float, default=0.0, lo=-10.0, hi=10.0)
    x0 = number(params, "x0", float, default=1.0, lo=-10.0, hi=10.0)
    x1 = number(params, "x1", float, default=0.0, lo=-10.0, hi=10.0)
    rot = PhaseRotation(_tiny_3pt(n), 0, 1).double()
    with torch.no_grad():
        rot.theta.fill_(theta)
        y = rot(torch.tensor([x0, x1] * n, dtype=torch.float64)[None, None])[0, 0]
    return {"n": n, "theta": theta, "offsets": phase_offsets(n, torch.float64),
            "angles": rot.angles(torch.float64)[:, 0], "input": [x0, x1],
            "output": y.view(n, 2), "init_angles": [PhaseRotation.init_angle(layer_idx, 12) for layer_idx in range(12)]}


def horn(ctx, params) -> dict:
    """r(t) = 1/(t+1) from HornInjection on a random stream, and the zero-sum diagnostic
    right after it beside its closed form N·H_T/T (3PT §2.5)."""
    n = number(params, "n", default=3, lo=1, hi=12)
    T = number(params, "T", default=1024, lo=1, hi=8192)
    x = torch.randn(1, T, 2 * n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = HornInjection(_tiny_3pt(n))(x)
    return {"n": n, "T": T, "r": y.mean(-1)[0, :min(T, 256)],  # the all-ones component = r(t)
            "zero_sum_before": zero_sum_diagnostic(x, n), "zero_sum": zero_sum_diagnostic(y, n),
            "closed_form": horn_zero_sum(n, T)}


MODS = [  # (label, config switches added to the preset's N = 1 twin) — 3PT §2, modifications 1-5
    ("1 partition into N stripes", dict(n_phases=3)),
    ("2 phase rotation (θ per pair, per layer)", dict(n_phases=3, phase_rotation=True)),
    ("3 per-stripe RMSNorm", dict(n_phases=3, phase_norm=True)),
    ("4 phase-aligned GQA (a check)", dict(n_phases=3, phase_aligned_gqa=True)),
    ("5 horn DC injection", dict(n_phases=3, horn=True)),
    ("ablation: learnable horn gain", dict(n_phases=3, horn=True, learnable_horn=True)),
    ("ablation: learnable offsets", dict(n_phases=3, phase_rotation=True, learnable_offsets=True)),
    ("all five (the 3PT model)", dict(n_phases=3, phase_rotation=True, phase_norm=True,
                                      phase_aligned_gqa=True, horn=True)),
]
OFF = dict(n_phases=1, phase_rotation=False, phase_norm=False, phase_aligned_gqa=False, horn=False)


@functools.lru_cache(maxsize=4)
def _costs(preset: str) -> dict:
    base = ModelConfig.from_preset(preset, **OFF)
    base_total = sum(breakdown(base).values())
    rows = []
    for label, on in MODS:
        total = sum(breakdown(ModelConfig.from_preset(preset, **{**OFF, **on})).values())
        rows.append({"modification": label, "total": total, "extra": total - base_total})
    return {"preset": preset, "baseline_total": base_total, "rows": rows,
            "n_layers": base.n_layers, "d_model": base.d_model}


def costs(ctx, params) -> dict:
    return _costs(choice(params, "preset", ["3pt-5.5m", "3pt-123m", "3pt-small"], "3pt-123m"))


# --------------------------------------------------------------------------- Hyperloop
_GLOBAL_RNG = threading.Lock()
HYPERLOOP_PRESETS = ["hyperloop-135m", "hyperloop-579m", "hyperloop-990m", "hyperloop-small"]


@functools.lru_cache(maxsize=8)
def _layout(preset: str) -> dict:
    cfg = ModelConfig.from_preset(preset)
    b, m, e = cfg.loop_split
    parts = {}
    for twin in (preset, preset.replace("hyperloop", "looped")):
        bd = breakdown(ModelConfig.from_preset(twin))
        parts[twin] = {"parts": bd, "total": sum(bd.values()),
                       "without_input_embedding": sum(bd.values()) - bd["embedding"]}
    return {"preset": preset, "begin": b, "middle": m, "end": e, "loops": cfg.n_loops,
            "streams": cfg.n_streams, "depth": b + m * cfg.n_loops + e, "d_model": cfg.d_model,
            "models": parts}


def layout(ctx, params) -> dict:
    return _layout(choice(params, "preset", HYPERLOOP_PRESETS, "hyperloop-135m"))


def mixing(ctx, params) -> dict:
    """One HyperConnection (hyperconn.py) on a small example: T tokens, n streams of width
    8 with random contents (``seed``), alpha scaling the dynamic part; H_pre, H_post and
    H_res per token, and the streams before and after (F = a fixed random linear map)."""
    n = number(params, "n", default=4, lo=2, hi=8)
    T = number(params, "tokens", default=3, lo=1, hi=8)
    alpha = number(params, "alpha", float, default=0.01, lo=0.0, hi=10.0)
    form = choice(params, "form", ["diagonal", "sinkhorn", "identity"], "sinkhorn")
    seed = number(params, "seed", default=0, lo=0, hi=2**31 - 1)
    cfg = ModelConfig(arch="hyperloop", vocab_size=16, d_model=8, n_layers=3, n_heads=2,
                      n_kv_heads=2, d_ff=16, max_seq_len=8, n_streams=n, hc_res=form,
                      hc_alpha_init=alpha, init_std=0.5)
    # W's init draws from the global generator: one seeded draw at a time (endpoints run in threads)
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hc = HyperConnection(cfg, loop_embedding=True, residual_f=True).double()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, T, 8, generator=g, dtype=torch.float64)
    streams = copy_streams(x, n) + 0.3 * torch.randn(1, T, n, 8, generator=g, dtype=torch.float64)
    W = torch.randn(8, 8, generator=g, dtype=torch.float64) / 8 ** 0.5
    with torch.no_grad():
        pre, post, res = hc.coefficients(streams)
        out = hc(streams, lambda h: h @ W)
    if res is not None and res.dim() == 3:
        res = torch.diag_embed(res)
    return {"n": n, "tokens": T, "alpha": alpha, "form": form, "H_pre": pre[0], "H_post": post[0],
            "H_res": res[0] if res is not None else [torch.eye(n, dtype=torch.float64)] * T,
            "streams_in": streams[0], "streams_out": out[0]}


ENDPOINTS = {
    "/api/learn/3pt/wheel": wheel,
    "/api/learn/3pt/horn": horn,
    "/api/learn/3pt/costs": costs,
    "/api/learn/hyperloop/layout": layout,
    "/api/learn/hyperloop/mixing": mixing,
}
