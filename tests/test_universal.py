"""Universal Transformer trunk (universal.py): weight tying, coordinate signal, depth
extrapolation, ACT through act.py (ponder loss/time), KV-cache equivalence."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phaseloop import ConfigError, ModelConfig, build_model
from phaseloop.archs.act import halting_schedule, ponder_cost
from phaseloop.archs.universal import CoordinateSignal, UniversalTrunk, timing_signal
from phaseloop.layers import Attention, ForwardContext, KVCache, ReLUFFN, RMSNorm, SwiGLU, make_norm, rope_tables

pytestmark = pytest.mark.usefixtures("one_thread")


PAPER = dict(ffn="relu", norm="layer", bias=True, use_rope=False)  # Dehghani et al. 2019


def ut(**kw):
    base = dict(arch="universal", n_layers=1, vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2,
                d_ff=64, max_seq_len=32, n_steps=3, embed_scale=True, embed_init_std=32 ** -0.5)
    return ModelConfig(**{**base, **kw})


def spread_halting(model, seed=0):
    """Halting unit that makes positions halt at different steps (init halts all at 2):
    it reads only the first channels (high-frequency position sines), as the low
    frequency channels accumulate the step signal and move all positions alike."""
    g = torch.Generator().manual_seed(seed)
    h = model.trunk.halting
    with torch.no_grad():
        h.weight.zero_()
        h.weight[:4] = torch.randn(4, generator=g, dtype=h.weight.dtype)
        h.bias.fill_(-0.5)


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw, field", [
    (dict(n_layers=2), "n_layers"),
    (dict(n_steps=0), "n_steps"),
    (dict(step_signal="random"), "step_signal"),
    (dict(act=True, act_type="global"), "act_type"),
    (dict(act=True, act_epsilon=1.0), "act_epsilon"),
    (dict(act=True, act_max_steps=0), "act_max_steps"),
    (dict(act_type="accumulated"), "act_type"),  # ACT option without act=True
    (dict(ffn="gelu"), "ffn"),
    (dict(norm="batch"), "norm"),
    (dict(norm="layer", phase_norm=True), "norm"),  # PhaseAwareRMSNorm replaces every norm
])
def test_invalid_config_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=rf"\b{field}="):
        ut(**kw)


def test_universal_options_refused_on_other_archs():
    with pytest.raises(ConfigError, match=r"\bact=True"):
        ModelConfig(arch="rope", act=True)
    with pytest.raises(ConfigError, match=r"\bn_steps="):
        ModelConfig(arch="rope", n_steps=3)
    assert ModelConfig(arch="rope", use_rope=False).use_rope is False


def test_act_max_steps_default_is_twice_nominal():
    assert ut(act=True).act_steps == 6
    assert ut(act=True, act_max_steps=4).act_steps == 4
    assert build_model(ut(act=True)).trunk.steps == 6
    assert build_model(ut()).trunk.steps == 3


# ---------------------------------------------------------------------------- weight tying
def test_one_set_of_block_parameters():
    counts = [sum(p.numel() for p in build_model(ut(n_steps=T)).trunk.parameters()) for T in (1, 2, 7)]
    assert counts[0] == counts[1] == counts[2]
    m = build_model(ut(n_steps=4))
    assert m.trunk.depth == 4  # one shared block applied 4 times
    names = {n.split(".")[1] for n, _ in m.named_parameters() if n.startswith("trunk.")}
    assert names == {"block"}


def test_gradients_accumulate_across_steps():
    """Grad of the shared block = sum of the grads of T untied copies of it."""
    torch.manual_seed(0)
    m = build_model(ut(n_steps=3)).double()
    copies = [copy.deepcopy(m.trunk.block) for _ in range(3)]  # unrolled: one per step
    idx = torch.randint(0, 64, (2, 10))
    m(idx, idx).loss.backward()
    tied = {n: p.grad.clone() for n, p in m.trunk.block.named_parameters()}
    m.zero_grad()
    cos, sin = rope_tables(torch.arange(10), m.cfg.head_dim, m.cfg.rope_base)
    ctx = ForwardContext(cos=cos.double(), sin=sin.double())
    x = m.embed(idx)
    pos = m.trunk.signal.position(0, 10, x.device).double()
    for t, blk in enumerate(copies):
        x = blk(m.trunk.signal(x, pos, t), ctx)
    loss = torch.nn.functional.cross_entropy(m.head(m.norm(x)).flatten(0, 1), idx.flatten())
    assert torch.allclose(loss, m(idx, idx).loss, atol=1e-12, rtol=0)  # float64 model: float64 loss
    loss.backward()
    for n, g in tied.items():
        per_step = [dict(c.named_parameters())[n].grad for c in copies]
        assert all(s.abs().sum() > 0 for s in per_step), n
        assert torch.allclose(g, sum(per_step), atol=1e-10, rtol=0), n


# ---------------------------------------------------------------------------- coordinate signal
def test_timing_signal_values():
    # d=4: two timescales, w = [1, 1e-4]; [sin p, sin 1e-4 p, cos p, cos 1e-4 p]
    s = timing_signal(torch.tensor([0, 1, 5]), 4)
    want = torch.tensor([[0.0, 0.0, 1.0, 1.0],
                         [math.sin(1), math.sin(1e-4), math.cos(1), math.cos(1e-4)],
                         [math.sin(5), math.sin(5e-4), math.cos(5), math.cos(5e-4)]])
    assert torch.allclose(s, want, atol=1e-6)
    # d=6: w_k = 1e4^(-k/2), k = 0, 1, 2; odd width pads one zero channel
    s6 = timing_signal(torch.tensor([3]), 6)[0]
    w = [1.0, 1e-2, 1e-4]
    assert torch.allclose(s6, torch.tensor([math.sin(3 * x) for x in w] + [math.cos(3 * x) for x in w]),
                          atol=1e-6)
    assert timing_signal(torch.tensor([2]), 5)[0, -1] == 0


def test_coordinate_signal_added_before_every_step():
    """P^t(i) = pos(i) + step(t): step input of step t = state + P^t at absolute positions."""
    m = build_model(ut(n_steps=3)).eval()
    seen = []
    m.trunk.block.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    idx = torch.randint(0, 64, (1, 5))
    cache = KVCache()
    m(idx[:, :2], cache=cache)
    snapshot = KVCache(entries=dict(cache.entries), pos=cache.pos)  # update() never mutates
    seen.clear()
    m(idx[:, 2:], cache=cache)  # positions 2..4 after a cached prefix
    assert len(seen) == 3
    x = m.embed(idx[:, 2:], 2)
    ctx = ForwardContext(*rope_tables(torch.arange(2, 5), 8, m.cfg.rope_base), start_pos=2, cache=snapshot)
    for t in range(3):
        want = x + timing_signal(torch.arange(2, 5), 32) + timing_signal(torch.tensor([t]), 32)[0]
        assert torch.allclose(seen[t], want, atol=1e-5)
        x = m.trunk.block(want, ctx, ("ut", t))
    for t in (1, 7):  # inside and past the trained steps
        assert torch.allclose(CoordinateSignal(m.cfg, 3).step(t, "cpu"),
                              timing_signal(torch.tensor([t]), 32)[0])


def test_learned_step_signal_clamps_past_trained_steps():
    m = build_model(ut(n_steps=2, step_signal="learned")).eval()
    table = m.trunk.signal.step_table
    assert table.shape == (2, 32)
    sig = m.trunk.signal
    assert torch.equal(sig.step(0, "cpu"), table[0]) and torch.equal(sig.step(1, "cpu"), table[1])
    assert torch.equal(sig.step(5, "cpu"), table[1])  # past the trained steps: last vector
    assert build_model(ut(n_steps=2, act=True, step_signal="learned")).trunk.signal.step_table.shape[0] == 4


@pytest.mark.parametrize("signal", ["sinusoid", "learned"])
def test_signal_over_several_steps_is_each_step_bit_for_bit(signal):
    """``CoordinateSignal.over`` (the UT's exited passes projected together, early_exit.Monitor.rest)."""
    sig = build_model(ut(n_steps=3, step_signal=signal)).trunk.signal
    x = torch.randn(2, 5, 32)
    for pos in (sig.position(4, 5, "cpu"), sig.position(0, 5, "cpu", torch.arange(10).view(2, 5))):
        for steps in ([0, 1, 2], [1, 2], [2, 3, 4], [0, 2]):  # in the table, past it, not consecutive
            want = torch.stack([sig(x, pos, t) for t in steps])
            assert torch.equal(sig.over(x, pos, steps), want)


# ---------------------------------------------------------------------------- depth extrapolation
@pytest.mark.parametrize("kw", [dict(), dict(step_signal="learned"), dict(act=True)])
def test_depth_extrapolation_runs(kw):
    m = build_model(ut(n_steps=2, **kw)).eval()
    idx = torch.randint(0, 64, (2, 12))
    base = m(idx).logits
    m.trunk.set_steps(6)
    deeper = m(idx).logits
    assert deeper.shape == base.shape and torch.isfinite(deeper).all()
    if not m.cfg.act:  # ACT at init halts by step 2, so more allowed steps change nothing
        assert not torch.allclose(base, deeper)
    out = m.generate(idx[:, :3], 5, temperature=0.0)
    assert out.shape == (2, 8)
    with pytest.raises(ConfigError):
        m.trunk.set_steps(0)


def _ctx(T, start=0):
    cos, sin = rope_tables(torch.arange(start, start + T), 8, 10000.0)
    return ForwardContext(cos=cos, sin=sin, start_pos=start)


def test_steps_kwarg_equals_set_steps():
    m = build_model(ut(n_steps=2)).eval()
    x = torch.randn(1, 6, 32)
    a = m.trunk(x, _ctx(6), steps=5)
    m.trunk.set_steps(5)
    assert torch.allclose(a, m.trunk(x, _ctx(6)))


# ---------------------------------------------------------------------------- ACT
def _act_trace(mode: str):
    """A float64 ACT trunk with spread halting, run on [2, 9] inputs: (model, x, ctx,
    output, halting probs [steps run, B, T], each step's transformed state)."""
    m = build_model(ut(act=True, act_type=mode)).double().eval()
    spread_halting(m)
    transformed = []
    m.trunk.block.register_forward_hook(lambda mod, args, out: transformed.append(out))
    ctx = _ctx(9)
    ctx.cos, ctx.sin = ctx.cos.double(), ctx.sin.double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    y = m.trunk(x, ctx)
    return m, x, ctx, y, ctx.stats["halting_probs"], transformed


@pytest.mark.parametrize("mode", ["basic", "accumulated"])
def test_act_output_matches_halting_schedule(mode):
    """The trunk's ACT output equals sum_k effective_weight_k * transformed_k, with the
    weights from act.halting_schedule on the model's own halting probabilities."""
    m, x, ctx, y, p, transformed = _act_trace(mode)
    S = p.shape[0]
    assert S == len(transformed) and S > 2
    sched = halting_schedule(p.flatten(1), threshold=0.99, max_steps=6, mode=mode)
    assert sched.steps_run == S
    eff = sched.effective_weights.view(S, 2, 9, 1)
    assert torch.allclose(y, (eff * torch.stack(transformed)).sum(0), atol=1e-10, rtol=0)
    n = ctx.stats["ponder_time"]
    assert torch.allclose(n.flatten(), ponder_cost(sched), atol=1e-12, rtol=0)
    assert len(set(sched.n_updates.tolist())) > 1  # positions halt at different steps
    assert torch.allclose(ctx.aux_losses["ponder_loss"], 0.01 * ponder_cost(sched).mean(), atol=1e-12, rtol=0)


def test_ponder_loss_has_gradient_and_is_logged_separately():
    m = build_model(ut(act=True))
    idx = torch.randint(0, 64, (2, 12))
    out = m(idx, idx)
    assert set(out.aux_losses) == {"ponder_loss"}
    assert torch.allclose(out.loss, out.ce_loss + out.aux_losses["ponder_loss"])
    pt = out.stats["ponder_time"]
    assert pt.shape == (2, 12) and (pt >= 1).all() and (pt <= 7).all()
    halting = m.trunk.halting
    g_w, g_b = torch.autograd.grad(out.aux_losses["ponder_loss"], [halting.weight, halting.bias])
    assert g_w.abs().sum() > 0 and g_b.abs() > 0
    # the halting bias starts at 1.0
    assert build_model(ut(act=True)).trunk.halting.bias.item() == 1.0


def test_train_logs_ponder_loss(tmp_path, text_file):
    from phaseloop.lm.train import TrainConfig, train

    records = []
    train(ut(act=True, vocab_size=256), TrainConfig(steps=2, batch_size=2, seq_len=16, eval_every=2,
                                                    eval_windows=2, log_every=1, ckpt_every=2),
          str(text_file), tmp_path / "run", progress=False, on_step=lambda s, r: records.append(r))
    assert "ponder_loss" in records[0] and records[0]["ponder_loss"] > 0


# ---------------------------------------------------------------------------- KV cache
def _pieces(m, idx, cuts=(7, 8, 9, 10, 11, 12, 13, 14, 15)):
    """Prefill, token by token, then a chunk after a cached prefix (by default)."""
    cache = KVCache()
    bounds = [0, *cuts, idx.shape[1]]
    out = [m(idx[:, a:b], cache=cache).logits for a, b in zip(bounds, bounds[1:])]
    return torch.cat(out, 1), cache


def _lazy_lengths(cache, steps):
    """c_t (positions with step-t keys) per step; checks the lazy-cache invariants:
    c_0 = all, c_t non-increasing, and ("ut_in", t) holds exactly [c_t, c_{t-1})."""
    c = [cache.entries[("ut", t)][0].shape[2] if ("ut", t) in cache.entries else 0
         for t in range(steps + 1)]
    assert c[0] == cache.pos
    for t in range(1, steps + 1):
        pend = cache.entries.get(("ut_in", t))
        assert c[t] <= c[t - 1] and (pend.x.shape[1] if pend else 0) == c[t - 1] - c[t]
        assert pend is None or pend.start == c[t]
    return c[:steps]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(step_signal="learned"),
    dict(act=True),
    dict(act=True, act_type="accumulated", act_max_steps=5),
    dict(use_rope=False),
    dict(n_phases=2, phase_rotation=True, phase_norm=True, horn=True),  # 3PT composition
    dict(PAPER),  # the published block
    dict(PAPER, act=True),
    dict(PAPER, act=True, act_type="t2t_literal"),
    dict(ffn="relu", bias=True),  # the options one by one, with RoPE
    dict(norm="layer"),
])
def test_kv_cache_equals_full_forward(kw):
    """Halted positions stay visible at later steps: the cached decode (slot per step,
    ACT: lazy step extension) equals the early-exit full pass exactly."""
    torch.manual_seed(0)
    m = build_model(ut(**kw)).double().eval()
    if m.cfg.act:
        spread_halting(m)
    idx = torch.randint(0, 64, (3, 24))
    full = m(idx)
    got, cache = _pieces(m, idx)
    assert cache.pos == 24
    if m.cfg.act:
        _lazy_lengths(cache, m.trunk.steps)
    else:
        assert {k for k in cache.entries} == {("ut", t) for t in range(m.trunk.steps)}
    assert torch.allclose(got, full.logits, atol=1e-10, rtol=0)
    if m.cfg.act:
        pt = full.stats["ponder_time"]
        assert len(set(pt.flatten().floor().tolist())) > 1
        assert full.stats["halting_probs"].shape[0] < m.trunk.steps or (pt >= m.trunk.steps).any()


class FloorHalting(torch.nn.Module):
    """Test halting unit with p in [0.25, 0.75]: every position halts within 4 steps, at
    a step that depends on its state."""

    def forward(self, h_BTD):
        return 0.25 + 0.5 * torch.sigmoid(3 * h_BTD[..., :4].sum(-1))


def _counting_block(m):
    """Records the number of positions each block application processes."""
    sizes = []
    m.trunk.block.register_forward_pre_hook(lambda mod, args: sizes.append(args[0].shape[1]))
    return sizes


@pytest.mark.parametrize("mode", ["basic", "accumulated", "t2t_literal"])
@pytest.mark.parametrize("B, cuts", [
    (1, range(1, 24)),  # token by token from one token
    (3, (7, 8, 9, 10, 11, 12, 13, 14, 15)),  # prefill, tokens, chunk
    (2, (5, 6, 13, 14, 15, 20)),  # chunks and tokens interleaved
])
def test_lazy_act_cache_equals_early_exit_forward(mode, B, cuts):
    """Positions halt at different steps; the full pass stops early (all halted); each
    cached call runs only the steps its tokens need and catches up earlier positions."""
    m = build_model(ut(act=True, act_type=mode, act_max_steps=8)).double().eval()
    m.trunk.halting = FloorHalting()
    idx = torch.randint(0, 64, (B, 24))
    full = m(idx)
    assert full.stats["halting_probs"].shape[0] < 8  # early exit
    assert len(set(full.stats["ponder_time"].floor().flatten().tolist())) > 1
    sizes = _counting_block(m)
    got, cache = _pieces(m, idx, cuts)
    assert torch.allclose(got, full.logits, atol=1e-10, rtol=0)
    c = _lazy_lengths(cache, 8)
    # each (position, step) runs once, never past the full pass's steps (not all 8 max steps)
    assert c[full.stats["halting_probs"].shape[0]] == 0 and sum(sizes) == sum(c)
    calls = [b - a for a, b in zip([0, *cuts], [*cuts, 24])]
    assert max(sizes) > max(calls[1:])  # some call caught up earlier positions


def test_lazy_act_cache_runs_only_needed_steps():
    """Token by token (batch 1): step t has run for exactly the positions up to the last
    one that needed it, c_t = 1 + max{j : L_j > t} (L_j = steps run for token j)."""
    m = build_model(ut(act=True, act_max_steps=8)).double().eval()
    m.trunk.halting = FloorHalting()
    idx = torch.randint(0, 64, (1, 20))
    cache, L = KVCache(), []
    for j in range(20):
        L.append(m(idx[:, j: j + 1], cache=cache).stats["halting_probs"].shape[0])
    assert len(set(L)) > 1
    want = [1 + max((j for j in range(20) if L[j] > t), default=-1) for t in range(8)]
    assert _lazy_lengths(cache, 8) == want


def test_act_cached_generation_equals_uncached():
    m = build_model(ModelConfig.from_preset("universal-act-tiny"))
    spread_halting(m)
    idx = torch.randint(0, 256, (2, 5))
    a = m.generate(idx, 10, temperature=0.0, use_cache=True)
    b = m.generate(idx, 10, temperature=0.0, use_cache=False)
    assert torch.equal(a, b)


def test_output_of_a_position_does_not_depend_on_the_batch():
    """The loop count is global, yet each position's output depends on its prefix only."""
    m = build_model(ut(act=True)).double().eval()
    spread_halting(m)
    idx = torch.randint(0, 64, (4, 16))
    together = m(idx).logits
    alone = torch.cat([m(idx[i: i + 1]).logits for i in range(4)])
    assert torch.allclose(together, alone, atol=1e-10, rtol=0)


def test_presets_build_and_are_small():
    for name in ("universal-tiny", "universal-act-tiny"):
        m = build_model(ModelConfig.from_preset(name))
        assert isinstance(m.trunk, UniversalTrunk)
        assert sum(p.numel() for p in m.parameters()) < 500_000


# ---------------------------------------------------------------------------- the published block
def _randomize(module, seed=0):
    """Non-trivial gains and biases (their init, 1 and 0, would hide a missing term)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)


def test_default_block_is_unchanged():
    """Defaults: RMSNorm, SwiGLU, no biases; the state dict keys are those of before."""
    m = build_model(ut())
    blk = m.trunk.block
    assert isinstance(blk.attn_norm, RMSNorm) and isinstance(m.norm, RMSNorm)
    assert isinstance(blk.ffn, SwiGLU) and blk.attn.use_rope
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, nn.Linear))
    assert {k for k in m.state_dict() if k.startswith("trunk.block.")} == {
        f"trunk.block.{k}" for k in ("attn_norm.weight", "attn.q_proj.weight", "attn.kv_proj.weight",
                                      "attn.o_proj.weight", "ffn_norm.weight", "ffn.gate_up.weight",
                                      "ffn.down.weight")}


def test_paper_preset_switches_every_option_on():
    for name in ("universal-paper-tiny", "universal-paper-small"):
        cfg = ModelConfig.from_preset(name)
        assert (cfg.ffn, cfg.norm, cfg.bias, cfg.use_rope, cfg.d_ff) == ("relu", "layer", True, False, 4 * cfg.d_model)
        assert cfg.n_kv_heads == cfg.n_heads and cfg.tie_embeddings and not cfg.act
    m = build_model(ModelConfig.from_preset("universal-paper-tiny"))
    norms = [mod for mod in m.modules() if isinstance(mod, (nn.LayerNorm, RMSNorm))]
    assert len(norms) == 3 and all(isinstance(n, nn.LayerNorm) for n in norms)  # 2 in the block + final
    assert all(n.bias is not None for n in norms)
    blk = m.trunk.block
    assert isinstance(blk.ffn, ReLUFFN) and not blk.attn.use_rope
    assert all(mod.bias is not None for mod in blk.modules() if isinstance(mod, nn.Linear))
    assert m.head.bias is None and m.head.weight is m.embed.tok.weight  # t2t: shared softmax
    d, f, V = 96, 384, 256
    assert sum(p.numel() for p in m.parameters()) == V * d + 4 * (d * d + d) + 2 * d * f + f + d + 3 * 2 * d


def test_relu_ffn_equals_hand_formula():
    """Transition (UT §2.1, Vaswani §3.3): max(0, x W1 + b1) W2 + b2."""
    ffn = ReLUFFN(ut(ffn="relu", bias=True)).double()
    _randomize(ffn)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    W1, b1, W2, b2 = ffn.up.weight, ffn.up.bias, ffn.down.weight, ffn.down.bias
    assert W1.shape == (64, 32) and b1.shape == (64,) and W2.shape == (32, 64) and b2.shape == (32,)
    want = torch.clamp(x @ W1.T + b1, min=0) @ W2.T + b2
    assert torch.allclose(ffn(x), want, atol=1e-12, rtol=0)
    assert ReLUFFN(ut(ffn="relu")).up.bias is None  # bias=False: none


def test_layer_norm_equals_hand_formula():
    norm = make_norm(ut(norm="layer", norm_eps=1e-6)).double()
    assert isinstance(norm, nn.LayerNorm) and norm.eps == 1e-6
    _randomize(norm)
    x = torch.randn(3, 4, 32, dtype=torch.float64) * 2 + 1
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    want = (x - mu) / torch.sqrt(var + 1e-6) * norm.weight + norm.bias
    assert torch.allclose(norm(x), want, atol=1e-12, rtol=0)
    assert torch.allclose(norm(x), F.layer_norm(x, (32,), norm.weight, norm.bias, 1e-6), atol=1e-14, rtol=0)


@pytest.mark.parametrize("use_rope", [False, True])
def test_attention_with_biases_equals_hand_formula(use_rope):
    """softmax((x Wq + bq)(x Wk + bk)^T / sqrt(E) + causal) (x Wv + bv) Wo + bo, per head
    (GQA: kv head h // (H / K)). The q, v and o biases change the output (a test that fails
    if one is dropped); without RoPE bk cannot: it adds q.bk to every score of a query
    (softmax is shift-invariant), while RoPE rotates it differently at every key position."""
    cfg = ut(bias=True, use_rope=use_rope)
    attn = Attention(cfg).double()
    _randomize(attn)
    B, T, H, K, E = 2, 6, 4, 2, 8
    x = torch.randn(B, T, 32, dtype=torch.float64)
    cos, sin = rope_tables(torch.arange(T), E, cfg.rope_base)
    ctx = ForwardContext(cos=cos.double(), sin=sin.double())

    def by_hand():
        q = (x @ attn.q_proj.weight.T + attn.q_proj.bias).view(B, T, H, E).transpose(1, 2)
        k, v = (x @ attn.kv_proj.weight.T + attn.kv_proj.bias).view(B, T, 2, K, E).unbind(2)
        k, v = k.transpose(1, 2).repeat_interleave(H // K, 1), v.transpose(1, 2).repeat_interleave(H // K, 1)
        if use_rope:
            rot = lambda t: torch.cat([-t[..., E // 2:], t[..., : E // 2]], -1)
            q, k = q * ctx.cos + rot(q) * ctx.sin, k * ctx.cos + rot(k) * ctx.sin
        s = q @ k.transpose(-1, -2) / math.sqrt(E)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * E)
        return y @ attn.o_proj.weight.T + attn.o_proj.bias

    out = attn(x, ctx)
    assert torch.allclose(out, by_hand(), atol=1e-12, rtol=0)
    bias = {"q": attn.q_proj.bias[:], "k": attn.kv_proj.bias[: K * E], "v": attn.kv_proj.bias[K * E:],
            "o": attn.o_proj.bias[:]}
    for name, b in bias.items():
        with torch.no_grad():
            saved = b.clone()
            b.zero_()
            changed = not torch.allclose(attn(x, ctx), out, atol=1e-9)
            b.copy_(saved)
        assert changed == (name != "k" or use_rope), name


def test_t2t_literal_act_in_the_trunk():
    """act_type="t2t_literal": output = sum_k w_k s_k - sum_k w_k on every channel
    (tensor2tensor's line as written), with the same halting as "basic"."""
    m, x, ctx, y, p, transformed = _act_trace("t2t_literal")
    S = p.shape[0]
    w = halting_schedule(p.flatten(1), threshold=0.99, max_steps=6).update_weights.view(S, 2, 9, 1)
    want = (w * torch.stack(transformed)).sum(0) - w.sum(0)
    assert torch.allclose(y, want, atol=1e-10, rtol=0)
    basic = build_model(m.cfg.replace(act_type="basic")).double().eval()
    basic.load_state_dict(m.state_dict())  # same weights and halting, documented form
    assert not torch.allclose(basic.trunk(x, ctx), y, atol=1e-3)


def _t2t_act(trunk, x, ctx, threshold=0.99, max_steps=6):
    """tensor2tensor's ``adaptive_universal_transformer`` (act_type basic) transcribed
    line by line — ``ut_function`` inside ``tf.while_loop(should_continue, ...)`` — with
    phaseloop's step_preprocess (signal), sigmoid dense (halting) and layer (block).
    Written from t2t, not from ``phaseloop.archs.act``; tf.cast of a comparison has no
    gradient, as torch's. Returns (new_state, ponder_loss)."""
    pos = trunk.signal.position(0, x.shape[1], x.device)
    z = torch.zeros(x.shape[:2], dtype=x.dtype)
    state, step, halting_probability, remainders, n_updates, previous_state = x, 0, z, z, z, torch.zeros_like(x)
    while bool(((halting_probability < threshold) & (n_updates < max_steps)).any()):  # should_continue
        state = trunk.signal(state, pos, step)  # step_preprocess
        p = trunk.halting(state)  # dense(state, 1, sigmoid), squeezed
        still_running = (halting_probability < 1.0).to(x.dtype)
        new_halted = (halting_probability + p * still_running > threshold).to(x.dtype) * still_running
        still_running = (halting_probability + p * still_running <= threshold).to(x.dtype) * still_running
        halting_probability = halting_probability + p * still_running
        remainders = remainders + new_halted * (1 - halting_probability)
        halting_probability = halting_probability + new_halted * remainders
        n_updates = n_updates + still_running + new_halted
        update_weights = (p * still_running + new_halted * remainders).unsqueeze(-1)
        transformed_state = trunk.block(state, ctx, ("ut", step))
        previous_state = transformed_state * update_weights + previous_state * (1 - update_weights)
        state, step = transformed_state, step + 1
    return previous_state, 0.01 * (n_updates + remainders).mean()


def test_act_gradients_equal_tensor2tensor_transcription():
    """Issue 16: the halting unit's gradient path. Every parameter's gradient of
    (task-like loss + ponder loss) through the trunk equals the t2t transcription's,
    in float64; the halting unit gets gradient from both terms."""
    m, x, ctx, y, p, _ = _act_trace("basic")
    r = torch.randn_like(y)
    names = [n for n, _ in m.trunk.named_parameters()]
    ctx.aux_losses.clear()
    y = m.trunk(x, ctx)
    ours = torch.autograd.grad((y * r).sum() + ctx.aux_losses["ponder_loss"], list(m.trunk.parameters()),
                               retain_graph=True)
    y2, ponder = _t2t_act(m.trunk, x, _ctx_like(ctx))
    assert torch.allclose(y2, y, atol=1e-12, rtol=0)
    theirs = torch.autograd.grad((y2 * r).sum() + ponder, list(m.trunk.parameters()))
    for n, a, b in zip(names, ours, theirs):
        assert torch.allclose(a, b, atol=1e-10, rtol=0), n
    w = m.trunk.halting.weight
    (g_task,) = torch.autograd.grad((y * r).sum(), [w], retain_graph=True)
    (g_ponder,) = torch.autograd.grad(ctx.aux_losses["ponder_loss"], [w])
    assert g_task.abs().sum() > 0 and g_ponder.abs().sum() > 0


def _ctx_like(ctx):
    c = _ctx(9)
    c.cos, c.sin = ctx.cos, ctx.sin
    return c


def test_act_halting_at_the_first_step_gets_no_gradient():
    """Issue 16 finding (same in tensor2tensor): a position whose first halting
    probability exceeds 1 - eps halts at step 1 with weight R = 1 - 0, a constant, and
    ponder 1 + R = 2: neither the task loss nor the ponder loss reaches the halting unit,
    so a model whose positions all halt at step 1 cannot learn to think longer."""
    m = build_model(ut(act=True)).double()
    with torch.no_grad():
        m.trunk.halting.bias.fill_(6.0)  # sigmoid(6 + w.h) > 0.99 everywhere
    idx = torch.randint(0, 64, (2, 12))
    out = m(idx, idx)
    assert torch.all(out.stats["ponder_time"] == 2.0)
    h = m.trunk.halting
    g_w, g_b = torch.autograd.grad(out.loss, [h.weight, h.bias], allow_unused=True, materialize_grads=True)
    assert g_w.abs().max() == 0 and g_b.abs().max() == 0
    with torch.no_grad():
        m.trunk.halting.bias.fill_(1.0)  # the t2t init: two steps, R = 1 - p_1 carries gradient
    out = m(idx, idx)
    g_w, g_b = torch.autograd.grad(out.loss, [h.weight, h.bias])
    assert g_b.abs().max() > 0


def test_coordinate_signal_norms_both_conventions():
    """One sinusoid has norm sqrt(d/2) (16 at d 512); position + step peaks at sqrt(2d)
    (32) where i = t and depends on i - t only; at i - t = 997 the paper's interleaved
    formula (eq. 6-7) gives 24.715, tensor2tensor's concatenated sinusoid 24.834."""
    from phaseloop.analysis.ut_explainer import coordinate_signal

    d = 512
    for conv in ("t2t", "paper"):
        one = coordinate_signal(torch.arange(50), 0, d, "position", conv).norm(dim=-1)
        assert torch.allclose(one, torch.full((50,), 16.0, dtype=torch.float64), atol=1e-4)
        step = coordinate_signal(torch.arange(5), 3, d, "step", conv)
        assert torch.equal(step[0], step[4])  # the step part: one row for every position
        s10 = coordinate_signal(torch.arange(40), 10, d, "sum", conv).norm(dim=-1)
        assert s10.argmax() == 10 and abs(s10[10] - 32.0) < 1e-4
        s20 = coordinate_signal(torch.arange(50), 20, d, "sum", conv).norm(dim=-1)
        assert torch.allclose(s10[:30], s20[10:40], atol=1e-3)  # a shift with t
    far = {c: coordinate_signal(torch.tensor([997]), 0, d, "sum", c).norm().item() for c in ("paper", "t2t")}
    assert round(far["paper"], 3) == 24.715 and round(far["t2t"], 3) == 24.834
    # "t2t" is what the model adds (CoordinateSignal's tables)
    assert torch.allclose(coordinate_signal(torch.arange(4), 0, 8, "position").float(),
                          timing_signal(torch.arange(4), 8))
    with pytest.raises(ConfigError, match="convention"):
        coordinate_signal(torch.arange(2), 0, 8, "sum", "x")


def test_schedule_grids():
    from phaseloop.analysis.ut_explainer import schedule_grids

    p = torch.tensor([[0.995, 0.5, 0.2], [0.5, 0.6, 0.2], [0.5, 0.5, 0.2]], dtype=torch.float64)
    g = schedule_grids(3, 2, p)
    assert g["rnn"] == [[0, -1, -1], [-1, 0, -1], [-1, -1, 0]]
    assert g["transformer"] == [[0, 0, 0], [1, 1, 1]] and g["ut"] == [[0, 0, 0], [0, 0, 0]]
    # position 0 halts at step 1, position 1 at step 2, position 2 runs the 3 steps
    assert g["ut_act"] == [[0, 0, 0], [-2, 0, 0], [-2, -2, 0]]
    assert g["ut_act_n_updates"] == halting_schedule(p).n_updates.tolist() == [1, 2, 3]
