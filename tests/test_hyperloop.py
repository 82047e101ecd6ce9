"""Looped, Hyperloop and mHC trunks (phaseloop.archs.hyperloop) and the quantize command."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from phaseloop import ConfigError, ModelConfig, build_model
from phaseloop.archs.hyperconn import HyperConnection, copy_streams, merge_streams, sinkhorn
from phaseloop.archs.hyperloop import PooledMLPTransition
from phaseloop.layers import ForwardContext, KVCache

torch.set_num_threads(1)

HL_VARIANTS = [{}, {"hc_res": "sinkhorn"}, {"hc_res": "identity"}, {"hc_per_layer": True},
               {"hc_transition": "pooled_mlp"}, {"n_streams": 2}, {"hc_dynamic": False},
               {"hc_dynamic": False, "hc_res": "sinkhorn"}]


def _model(preset, seed=0, **over):
    torch.manual_seed(seed)
    return build_model(ModelConfig.from_preset(preset, **over)).eval()


def _idx(B=2, T=24, seed=1):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _set_hc(model, alpha=None, b_res=None):
    with torch.no_grad():
        for hc in model.trunk.hc:
            if alpha is not None and hc.alpha is not None:  # static T has no alpha
                hc.alpha.fill_(alpha)
            if b_res is not None:
                hc.b[2 * hc.n:] = b_res


# ---------------------------------------------------------------------------- Sinkhorn
@pytest.mark.parametrize("scale,iters", [(0.5, 20), (1.0, 50)])
def test_sinkhorn_doubly_stochastic(scale, iters):
    """20 iterations (mHC's count) reach 1e-5 for logits of std 0.5 (the model's regime);
    logits of std 1 need ~50 (after 20 the worst row sum of 4096 draws is off by 1.5e-4)."""
    logits = torch.randn(256, 4, 4, generator=torch.Generator().manual_seed(0)) * scale
    P = sinkhorn(logits, iters)
    assert (P > 0).all()
    torch.testing.assert_close(P.sum(-1), torch.ones(256, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(P.sum(-2), torch.ones(256, 4), atol=1e-5, rtol=0)
    # a Sinkhorn projection is diag(u) exp(L) diag(v): P / exp(L) has rank one
    ratio = (P.double() / logits.double().exp())
    sv = torch.linalg.svdvals(ratio)
    assert (sv[:, 1] / sv[:, 0]).max() < 1e-5


def test_sinkhorn_is_scale_free_and_differentiable():
    """The max shift inside changes nothing (exp(L - c) normalises to the same P), two
    leading dims and n = 3 work, and gradients through the iterations pass gradcheck."""
    L = torch.randn(2, 3, 3, 3, dtype=torch.double, requires_grad=True)
    torch.testing.assert_close(sinkhorn(L, 7), sinkhorn(L + 5.0, 7))
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 4), (L,))
    assert sinkhorn(L.detach().float().bfloat16(), 3).dtype == torch.float32  # bf16 promoted


@pytest.mark.filterwarnings("ignore:Mismatch dtype")  # layers.RMSNorm on a bf16 read
@pytest.mark.parametrize("preset", ["mhc-tiny", "hyperloop-tiny"])
def test_bf16_autocast_keeps_fp32_streams_and_backpropagates(preset):
    """Under autocast (bf16 on CUDA in training) the streams stay fp32 like the residual
    they replace, and the backward runs (CPU autocast stands in for CUDA here)."""
    m = _model(preset).train()
    dtypes = []
    m.trunk.hc[-1].register_forward_hook(lambda mod, i, o: dtypes.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(_idx(), _idx(seed=2)).loss
    loss.backward()
    assert dtypes == [torch.float32]
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_model_h_res_is_doubly_stochastic():
    """At the model's own coefficients (alpha 0.01, b_res = I), and with the dynamic part
    100x larger (alpha = 1)."""
    m = _model("mhc-tiny")
    _set_hc(m, alpha=1.0)
    hc = m.trunk.hc[0]
    y = torch.randn(2, 5, hc.n, 64) * 3
    _, _, res = hc.coefficients(y)
    assert res.shape == (2, 5, 4, 4)
    torch.testing.assert_close(res.sum(-1), torch.ones(2, 5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(res.sum(-2), torch.ones(2, 5, 4), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- equations
def _reference_hc(hc, y_BTnD, fn):
    """Per-token loop over the spec's formulas (no vectorisation over streams)."""
    B, T, n, D = y_BTnD.shape
    out = torch.empty_like(y_BTnD)
    a = hc.alpha
    b_pre, b_post, b_res = hc.b[:n], hc.b[n:2 * n], hc.b[2 * n:]
    W_pre, W_post, W_res = hc.W[:n], hc.W[n:2 * n], hc.W[2 * n:]
    reads = torch.empty(B, T, D)
    coeffs = {}
    for bi in range(B):
        for t in range(T):
            y = y_BTnD[bi, t]
            z = y.flatten() / torch.sqrt(y.flatten().pow(2).mean() + hc.eps)
            H_pre = torch.sigmoid(a[0] * (W_pre @ z) + b_pre)
            H_post = 2 * torch.sigmoid(a[1] * (W_post @ z) + b_post)
            if hc.form == "diagonal":
                H_res = torch.diag(torch.sigmoid(a[2] * (W_res @ z) + b_res))
            elif hc.form == "sinkhorn":
                P = torch.exp(a[2] * (W_res @ z) + b_res).view(n, n)
                for _ in range(hc.iters):
                    P = P / P.sum(1, keepdim=True)
                    P = P / P.sum(0, keepdim=True)
                H_res = P
            else:
                H_res = torch.eye(n)
            reads[bi, t] = H_pre @ y
            coeffs[bi, t] = (H_post, H_res)
    f = fn(reads)
    if hc.e is not None:
        f = f + hc.e
    for (bi, t), (H_post, H_res) in coeffs.items():
        out[bi, t] = H_res @ y_BTnD[bi, t] + H_post[:, None] * f[bi, t][None, :]
    return out


@pytest.mark.parametrize("form", ["diagonal", "sinkhorn", "identity"])
@pytest.mark.parametrize("loop_embedding", [True, False])
def test_hyper_connection_matches_per_token_formula(form, loop_embedding):
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("hyperloop-tiny", hc_res=form)
    hc = HyperConnection(cfg, loop_embedding=loop_embedding, residual_f=True)
    with torch.no_grad():
        hc.alpha.copy_(torch.tensor([0.7, -0.5, 0.9]))
        hc.b.add_(torch.randn_like(hc.b) * 0.3)
        if hc.e is not None:
            hc.e.normal_()
    y = torch.randn(2, 3, 4, 64) * 2
    lin = torch.nn.Linear(64, 64)
    fn = lambda x: torch.tanh(lin(x))
    torch.testing.assert_close(hc(y, fn), _reference_hc(hc, y, fn), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("form", ["diagonal", "sinkhorn", "identity"])
def test_hyper_connection_shortcut_on_copied_streams(form):
    """copy_streams returns a stride-0 view, which takes the one-copy path: it must give
    what the general path gives on the materialised copies (values and gradients)."""
    torch.manual_seed(0)
    hc = HyperConnection(ModelConfig.from_preset("hyperloop-tiny", hc_res=form), True, True)
    with torch.no_grad():
        hc.alpha.fill_(0.5)
    lin = torch.nn.Linear(64, 64)
    x = torch.randn(2, 3, 64, requires_grad=True)
    a = hc(copy_streams(x, 4), lambda h: torch.tanh(lin(h)))
    ga = torch.autograd.grad(a.square().sum(), (x, hc.W, hc.b))
    b = hc(copy_streams(x, 4).contiguous(), lambda h: torch.tanh(lin(h)))
    gb = torch.autograd.grad(b.square().sum(), (x, hc.W, hc.b))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, atol=1e-4, rtol=1e-4)


def test_pooled_mlp_transition_formula_and_causal_pooling():
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("hyperloop-tiny", hc_transition="pooled_mlp")
    tr = PooledMLPTransition(cfg)
    y = torch.randn(2, 6, 4, 64)
    fn = lambda x: 3 * x
    out = tr(y, fn)
    for t in range(6):
        pooled = y[:, : t + 1].mean(1).flatten(-2)  # running mean over positions <= t
        gate = tr.mlp(F.rms_norm(pooled, (256,), eps=cfg.norm_eps)).view(2, 4, 64)
        want = gate * y[:, t] + fn(y[:, t].mean(1))[:, None]
        torch.testing.assert_close(out[:, t], want, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------- init relations
def _transplant(src, dst):
    """Copy the shared (begin/middle/end/embedding/head) weights of src into dst."""
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    assert not unexpected and all(".hc." in k for k in missing)


def test_hyperloop_equals_looped_when_dynamic_part_off_and_h_res_zero():
    looped, hyper = _model("looped-tiny"), _model("hyperloop-tiny", seed=1)
    _transplant(looped, hyper)
    _set_hc(hyper, alpha=0.0, b_res=-math.inf)  # H_pre = 1/n, H_post = 1, H_res = 0
    idx = _idx()
    torch.testing.assert_close(hyper(idx).logits, looped(idx).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form,keep", [("diagonal", 0.01), ("sinkhorn", 1.0), ("identity", 1.0)])
def test_hyperloop_init_relation_alpha_zero(form, keep):
    """alpha = 0 at the default biases: every stream follows y <- keep * y + F(y), with
    keep = H_res init 0.01 (diagonal) or 1 (rows of Sinkhorn / identity sum to 1)."""
    looped, hyper = _model("looped-tiny"), _model("hyperloop-tiny", seed=1, hc_res=form)
    _transplant(looped, hyper)
    _set_hc(hyper, alpha=0.0)
    idx = _idx()
    x = looped.embed(idx)
    T = idx.shape[1]
    from phaseloop.layers import rope_tables
    cos, sin = rope_tables(torch.arange(T), 16, 10000.0)
    ctx = ForwardContext(cos=cos, sin=sin)
    tr = looped.trunk
    x = tr.run(tr.begin, x, ctx, "begin")
    for loop in range(tr.n_loops):
        x = keep * x + tr.run(tr.middle, x, ctx, "middle", loop)
    x = tr.run(tr.end, x, ctx, "end")
    want = looped.head(looped.norm(x))
    torch.testing.assert_close(hyper(idx).logits, want, atol=1e-4, rtol=1e-4)


def test_hyperloop_default_init_is_close_to_looped():
    looped, hyper = _model("looped-tiny"), _model("hyperloop-tiny", seed=1)
    _transplant(looped, hyper)
    idx = _idx()
    a, b = hyper(idx).logits, looped(idx).logits
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 0.05, rel
    # the dynamic part is not zero: streams differ after the first loop
    streams = []
    hyper.trunk.hc[0].register_forward_hook(lambda m, i, o: streams.append(o))
    hyper(idx)
    assert (streams[0][:, :, 0] - streams[0][:, :, 1]).abs().max() > 0


@pytest.mark.parametrize("form", ["sinkhorn", "identity"])
def test_mhc_equals_transformer_when_dynamic_part_off(form):
    """Identical streams stay identical under a doubly stochastic (or identity) H_res, so
    with alpha = 0 mHC is exactly the pre-norm Transformer with the same blocks."""
    tf = _model("transformer-tiny", n_layers=2)
    mhc = _model("mhc-tiny", seed=1, hc_res=form)
    _transplant(tf, mhc)
    _set_hc(mhc, alpha=0.0)
    idx = _idx()
    torch.testing.assert_close(mhc(idx).logits, tf(idx).logits, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- structure
def test_stream_copy_and_average():
    x = torch.randn(2, 5, 8)
    s = copy_streams(x, 3)
    assert s.shape == (2, 5, 3, 8)
    for k in range(3):
        assert torch.equal(s[:, :, k], x)
    torch.testing.assert_close(merge_streams(s), x)
    y = torch.randn(2, 5, 3, 8)
    torch.testing.assert_close(merge_streams(y), (y[:, :, 0] + y[:, :, 1] + y[:, :, 2]) / 3)


def test_hyperloop_number_of_streams_is_invisible_when_streams_stay_identical():
    looped = _model("looped-tiny")
    outs = []
    for n in (2, 6):
        h = _model("hyperloop-tiny", seed=1, n_streams=n)
        _transplant(looped, h)
        _set_hc(h, alpha=0.0)
        outs.append(h(_idx()).logits)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_middle_block_shared_and_per_loop_parameters_distinct():
    m = _model("hyperloop-tiny")
    cfg = m.cfg
    b, mid, e = cfg.loop_split
    sd = m.state_dict()
    block_keys = [k for k in sd if k.startswith("trunk.middle.0.")]
    assert len([k for k in sd if k.startswith("trunk.middle.")]) == mid * len(block_keys)
    tr = m.trunk
    assert tr.depth == b + mid * cfg.n_loops + e
    assert len(tr.begin) + len(tr.middle) + len(tr.end) == cfg.n_layers  # unique layers
    hcs = m.trunk.hc
    assert len(hcs) == cfg.n_loops
    ptrs = {p.data_ptr() for hc in hcs for p in hc.parameters()}
    assert len(ptrs) == sum(1 for hc in hcs for _ in hc.parameters())  # no sharing
    assert not torch.equal(hcs[0].W, hcs[1].W)
    # one KV-cache entry per (middle layer, loop)
    cache = KVCache()
    m(_idx(T=4), cache=cache)
    assert {k for k in cache.entries if k[0] == "middle"} == {("middle", i, loop) for i in range(mid)
                                                              for loop in range(cfg.n_loops)}
    # the shared block collects gradient from every loop
    m.train()
    m(_idx(), _idx(seed=2)).loss.backward()
    assert all(p.grad is not None for p in m.trunk.middle.parameters())
    assert all(hc.W.grad.abs().sum() > 0 for hc in hcs)


def test_per_layer_option_has_one_connection_per_layer_application():
    m = _model("hyperloop-tiny", hc_per_layer=True)
    assert len(m.trunk.hc) == m.cfg.n_loops * m.cfg.loop_split[1]


def _count(preset):
    return sum(p.numel() for p in build_model(ModelConfig.from_preset(preset), "meta").parameters())


# The paper's table (Hyperloop §4): parameters in millions as printed (without the input
# embedding), for Transformer, mHC, Looped, Hyperloop at each (d, begin/middle/end) scale.
PAPER_TABLE = [
    ((1024, (2, 4, 2)), ("238m", "241m", "135m"), ("238", "241", "135.5", "135.7")),
    ((2048, (3, 4, 3)), ("990m", "997m", "579m"), ("990.5", "997.5", "579.4", "579.7")),
    ((2048, (4, 10, 4)), ("2018m", "2033m", "990m"), ("2018", "2033", "990.5", "990.8")),
]


@pytest.mark.parametrize("scale,names,paper", PAPER_TABLE)
def test_paper_scale_parameter_counts(scale, names, paper):
    """Each preset's count (built on the meta device, as `phaseloop params` counts it)
    equals the closed-form count of its layers, and total minus the input embedding
    rounds to the paper's figure; vocab 32000 is what makes all twelve figures agree."""
    from phaseloop.analysis.params import count_params

    (d, (b, m, e)), L, n, V = scale, 3, 4, 32000
    d_ff = int(2.75 * d)  # SwiGLU d_ff = 2.75 d
    layer = 4 * d * d + 3 * d * d_ff + 2 * d  # q, k, v, o (16-head MHA), SwiGLU, 2 RMSNorm gains
    outer = 2 * V * d + d  # input embedding, untied head, final norm
    depth = b + m * L + e
    per_loop = 3 * n * n * d + 3 * n + 3 + d  # W (pre, post, diagonal res), b, alpha, e_l
    per_sublayer = (2 * n + n * n) * n * d + 2 * n + n * n + 3  # Sinkhorn H_res: n^2 rows
    want = {"transformer": outer + depth * layer,
            "looped": outer + (b + m + e) * layer}
    want["mhc"] = want["transformer"] + 2 * depth * per_sublayer
    want["hyperloop"] = want["looped"] + L * per_loop
    tf, mhc, looped = names
    presets = {"transformer": f"transformer-{tf}", "mhc": f"mhc-{mhc}",
               "looped": f"looped-{looped}", "hyperloop": f"hyperloop-{looped}"}
    for (arch, preset), printed in zip(presets.items(), paper):
        cfg = ModelConfig.from_preset(preset)
        assert (cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.vocab_size) == (d, 16, d_ff, V)
        counted = count_params(cfg, seq_len=8)
        assert counted["total"] == want[arch], (preset, counted["total"] - want[arch])
        assert counted["embedding"] == V * d and counted["depth"] == depth
        without_input_embedding = (counted["total"] - counted["embedding"]) / 1e6
        half_unit = 0.5 * 10.0 ** -len(printed.partition(".")[2])  # the paper's rounding
        assert abs(without_input_embedding - float(printed)) <= half_unit, (preset, without_input_embedding)
    assert 1e5 < L * per_loop < 5e5  # "a few hundred thousand" extra parameters at d 1024+


def test_earlier_preset_names_are_the_first_scale():
    from phaseloop.config import PRESETS

    for arch, name in (("transformer", "238m"), ("mhc", "241m"), ("looped", "135m"),
                       ("hyperloop", "135m")):
        assert PRESETS[f"{arch}-240m"] == PRESETS[f"{arch}-{name}"]


# ---------------------------------------------------------------------------- static T
@pytest.mark.parametrize("form", ["diagonal", "sinkhorn", "identity"])
def test_static_transition_coefficients_do_not_depend_on_the_input(form):
    """hc_dynamic=False (the paper's ablation "w/o dynamic transition (static T)"): no W and
    no alpha exist; H_pre, H_post, H_res are sigmoid / 2 sigmoid / sigmoid-or-Sinkhorn of
    each loop's own b, the same for any input. With the switch on they follow the input."""
    static = _model("hyperloop-tiny", hc_res=form, hc_dynamic=False)
    n_loops, n, D = static.cfg.n_loops, static.cfg.n_streams, static.cfg.d_model
    hc_params = {k for k, _ in static.named_parameters() if ".hc." in k}
    assert hc_params == {f"trunk.hc.{loop}.{p}" for loop in range(n_loops) for p in ("b", "e")}
    n_b = 2 * n + {"diagonal": n, "sinkhorn": n * n, "identity": 0}[form]
    assert _count_model(static) == _count_model(_model("looped-tiny")) + n_loops * (n_b + D)
    assert not torch.equal(static.trunk.hc[0].b, static.trunk.hc[1].b)  # per loop
    g = torch.Generator().manual_seed(0)
    y1, y2 = torch.randn(2, 5, n, D, generator=g), 3 * torch.randn(2, 5, n, D, generator=g) + 1
    for hc in static.trunk.hc:
        c1, c2 = hc.coefficients(y1), hc.coefficients(y2)
        for a, b in zip(c1, c2):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
        b = hc.b.detach()
        torch.testing.assert_close(c1[0], torch.sigmoid(b[:n]).expand(2, 5, n))
        torch.testing.assert_close(c1[1], 2 * torch.sigmoid(b[n:2 * n]).expand(2, 5, n))
        if form == "diagonal":
            torch.testing.assert_close(c1[2], torch.sigmoid(b[2 * n:]).expand(2, 5, n))
        elif form == "sinkhorn":
            torch.testing.assert_close(c1[2], sinkhorn(b[2 * n:].view(n, n)).expand(2, 5, n, n))
    dynamic = _model("hyperloop-tiny", hc_res=form)
    for c1, c2 in zip(dynamic.trunk.hc[0].coefficients(y1), dynamic.trunk.hc[0].coefficients(y2)):
        assert c1 is None or not torch.equal(c1, c2)


def _count_model(model):
    return sum(p.numel() for p in model.parameters())


def test_static_transition_breaks_stream_symmetry_and_trains():
    """Streams start as copies; static coefficients symmetric in the streams would keep
    them copies for ever (equal gradients), so b starts with N(0, init_std) noise: the
    streams differ after the first loop. One AdamW step moves every b and lowers the loss
    on its batch."""
    m = _model("hyperloop-tiny", hc_dynamic=False).train()
    streams = []
    m.trunk.hc[0].register_forward_hook(lambda mod, i, o: streams.append(o.detach()))
    idx, tgt = _idx(), _idx(seed=2)
    loss = m(idx, tgt).loss
    assert (streams[0][:, :, 0] - streams[0][:, :, 1]).abs().max() > 1e-4
    before = [hc.b.detach().clone() for hc in m.trunk.hc]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    loss.backward()
    assert all(hc.b.grad.abs().sum() > 0 for hc in m.trunk.hc)
    opt.step()
    assert all(not torch.equal(hc.b, b) for hc, b in zip(m.trunk.hc, before))
    assert m(idx, tgt).loss < loss


# ---------------------------------------------------------------------------- causality, cache
ARCH_CASES = ([("transformer-tiny", {}), ("3pt-tiny", {}), ("looped-tiny", {}), ("mhc-tiny", {}),
               ("mhc-tiny", {"hc_res": "diagonal"}), ("mhc-tiny", {"hc_dynamic": False})]
              + [("hyperloop-tiny", v) for v in HL_VARIANTS])


@pytest.mark.parametrize("preset,over", ARCH_CASES)
def test_no_future_leak(preset, over):
    m = _model(preset, **over)
    if hasattr(m.trunk, "hc") and over.get("hc_transition") != "pooled_mlp":
        _set_hc(m, alpha=1.0)  # make the token-dependent coefficients matter
    idx = _idx(T=16)
    base = m(idx).logits
    for t in (0, 7, 14):
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 17) % 256
        out = m(changed).logits
        assert torch.equal(out[:, : t + 1], base[:, : t + 1]), (preset, over, t)
        assert not torch.equal(out[:, t + 1], base[:, t + 1])


@pytest.mark.parametrize("preset,over", ARCH_CASES[2:])
def test_incremental_decoding_matches_full_forward(preset, over):
    m = _model(preset, **over)
    idx = _idx(T=20)
    full = m(idx).logits
    cache = KVCache()
    parts = [m(idx[:, :7], cache=cache).logits]
    for t in range(7, 12):
        parts.append(m(idx[:, t:t + 1], cache=cache).logits)
    parts.append(m(idx[:, 12:], cache=cache).logits)  # chunked prefill after a prefix
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.pos == 20


def test_composes_with_three_phase_structure():
    over = dict(d_model=96, n_heads=6, n_kv_heads=3, n_phases=3, phase_rotation=True,
                phase_norm=True, horn=True)
    for preset in ("hyperloop-tiny", "mhc-tiny"):
        m = _model(preset, **over)
        assert any("theta" in k for k in m.state_dict())
        idx = _idx(T=12)
        full = m(idx).logits
        cache = KVCache()
        inc = torch.cat([m(idx[:, :5], cache=cache).logits, m(idx[:, 5:], cache=cache).logits], 1)
        torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize("over,field", [
    (dict(arch="rope", n_loops=4), "n_loops"),
    (dict(arch="rope", n_streams=8), "n_streams"),
    (dict(arch="looped", n_layers=4, n_begin=2, n_end=2), "n_unique_layers"),  # its name there
    (dict(arch="looped", n_unique_layers=4, n_begin=2, n_end=2), "n_unique_layers"),
    (dict(arch="rope", n_unique_layers=4), "n_unique_layers"),  # the looped archs' name
    (dict(arch="hyperloop", hc_res="full"), "hc_res"),
    (dict(arch="hyperloop", n_streams=1), "n_streams"),
    (dict(arch="hyperloop", hc_transition="pooled_mlp", hc_res="sinkhorn"), "hc_transition"),
    (dict(arch="mhc", hc_per_layer=True), "hc_per_layer"),
    (dict(arch="looped", n_loops=0), "n_loops"),
    (dict(arch="looped", hc_dynamic=False), "hc_dynamic"),
    (dict(arch="hyperloop", hc_dynamic=False, hc_alpha_init=0.1), "hc_alpha_init"),
    (dict(arch="hyperloop", hc_dynamic=False, hc_transition="pooled_mlp"), "hc_dynamic"),
])
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ConfigError, match=f"invalid config: {field}="):
        ModelConfig(**over)


def test_default_split():
    assert ModelConfig(arch="looped", n_layers=8).loop_split == (2, 4, 2)
    # looped archs write their layer count as n_unique_layers; n_layers (earlier versions) loads
    cfg = ModelConfig(arch="hyperloop", n_unique_layers=8)
    assert cfg.n_layers == cfg.n_unique_layers == 8 and cfg == ModelConfig(arch="hyperloop", n_layers=8)
    assert "n_unique_layers" in cfg.to_dict() and "n_layers" not in cfg.to_dict()
    assert cfg.replace(n_layers=4).loop_split == (1, 2, 1) == cfg.replace(n_unique_layers=4).loop_split
    assert ModelConfig(arch="looped", n_layers=2).loop_split == (0, 2, 0)
    assert ModelConfig(arch="hyperloop").hc_res_form == "diagonal"
    assert ModelConfig(arch="mhc").hc_res_form == "sinkhorn"
    cfg = ModelConfig.from_preset("hyperloop-135m")
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# ---------------------------------------------------------------------------- quantisation
def test_quantised_weights_round_trip(tmp_path):
    from phaseloop.quant import QUANT_ATTR, collect_hessians, load_quantized_state_dict, quantize_model, save_quantized

    m = _model("hyperloop-tiny")
    calib = [_idx(B=2, T=16, seed=s) for s in range(2)]
    _, counts = collect_hessians(m, calib, return_counts=True)
    # Hessians of the shared middle block pool all loop passes
    assert counts["trunk.middle.0.attn.q_proj"]["calls"] == 2 * m.cfg.n_loops
    assert counts["trunk.begin.0.attn.q_proj"]["calls"] == 2
    orig = {k: v.clone() for k, v in m.state_dict().items()}
    report = quantize_model(m, 4, 32, "gptq", calib)
    assert report["layers"]["trunk.middle.0.ffn.down"]["calls"] == 2 * m.cfg.n_loops
    for name, mod in m.named_modules():
        qw = getattr(mod, QUANT_ATTR, None)
        if qw is None:
            continue
        w = mod.weight.detach()
        # every weight is a grid point (q - zero) * scale of its group
        s = qw.scale.float().repeat_interleave(qw.group_size, 1)
        z = qw.zero.float().repeat_interleave(qw.group_size, 1)
        q = w / s + z
        torch.testing.assert_close(q, q.round(), atol=1e-3, rtol=0)
        # ... and GPTQ stays near the original (error feedback spreads, bounded by the range)
        assert (w - orig[name + ".weight"]).abs().max() <= s.max() * 8
    assert "trunk.hc.0.W" not in report["layers"]  # hyper-connection weights stay fp32
    path = tmp_path / "q.safetensors"
    save_quantized(m, path)
    fresh = _model("hyperloop-tiny", seed=5)
    load_quantized_state_dict(path, fresh)
    idx = _idx()
    assert torch.equal(fresh(idx).logits, m(idx).logits)


def test_quantize_cli_end_to_end(tmp_path, text_file, capsys):
    from phaseloop.cli import main
    from phaseloop.lm.train import TrainConfig, train

    run = tmp_path / "run"
    train(ModelConfig.from_preset("looped-tiny"),
          TrainConfig(steps=3, batch_size=4, eval_every=3, eval_windows=4, ckpt_every=3,
                      log_every=1, warmup_steps=1), str(text_file), run, progress=False)
    rc = main(["quantize", str(run), "--bits", "4", "--group-size", "32", "--method", "gptq",
               "--windows", "4", "--calib-batches", "2"])
    assert rc == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "bpb" in line and "->" in line
    rep = json.loads((run / "quant-w4-g32-gptq.json").read_text())
    for k in ("before", "after", "bytes_before", "bytes_after", "layers"):
        assert k in rep
    assert rep["after"]["val_loss"] > 0 and rep["bytes_after"] < rep["bytes_before"]
    assert (run / "quant-w4-g32-gptq.safetensors").exists()
    with pytest.raises(SystemExit) as e:  # argparse: one line, exit 2
        main(["quantize", str(run), "--bits", "3"])
    assert e.value.code == 2
    assert main(["quantize", str(tmp_path / "nope"), "--bits", "8"]) == 2


def test_torch_path_compiles_with_fullgraph():
    """The torch-ops connection (what CUDA and compile run) traces without graph breaks,
    and the compiled forward and backward equal eager (Sinkhorn form: every op kind)."""
    torch.manual_seed(0)
    hc = HyperConnection(ModelConfig.from_preset("mhc-tiny", hc_alpha_init=0.5), False, False)
    y = torch.randn(2, 5, 4, 64, requires_grad=True)
    run = lambda t: hc(t, torch.tanh)
    want = run(y)
    g_want, = torch.autograd.grad(want.square().sum(), y)
    got = torch.compile(run, fullgraph=True)(y)  # graph breaks would raise
    g_got, = torch.autograd.grad(got.square().sum(), y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


def test_param_breakdown_sums_to_the_total():
    from phaseloop.analysis.params import breakdown, count_params

    for name in ("hyperloop-tiny", "looped-tiny", "transformer-tiny"):
        cfg = ModelConfig.from_preset(name)
        b = breakdown(cfg)
        assert sum(b.values()) == count_params(cfg)["total"]
        assert b["embedding"] == cfg.vocab_size * cfg.d_model
    b = breakdown(ModelConfig.from_preset("hyperloop-tiny"))
    assert b["trunk.begin"] == b["trunk.end"] and b["trunk.middle"] == 2 * b["trunk.begin"]
    assert b["trunk.hc"] > 0 and "trunk.hc" not in breakdown(ModelConfig.from_preset("looped-tiny"))
