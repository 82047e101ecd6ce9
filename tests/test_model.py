"""The shared decoder: config validation, attention, RoPE, init, KV cache, generation.
Causality and cache equivalence run on every `*-tiny` preset and on every registered
architecture at its defaults, so each architecture, a plugin's too, is covered
without a hand-kept list."""

import math

import pytest
import torch
import torch.nn.functional as F

from phaseloop import PRESETS, ConfigError, ModelConfig, build_model, registry
from phaseloop.layers import KVCache, apply_rope, rope_tables

ARCHS = registry.arch_names()  # first: loads the installed plugins, whose presets join PRESETS
TINY = sorted(n for n in PRESETS if n.endswith("-tiny")) + [f"arch={a}" for a in ARCHS]


def _config(case: str) -> ModelConfig:
    """A `*-tiny` preset, or ``arch=NAME``: that architecture's defaults."""
    return ModelConfig(arch=case[5:]) if case.startswith("arch=") else ModelConfig.from_preset(case)


def tiny(**kw):
    return ModelConfig(**{**dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                 d_ff=64, max_seq_len=32), **kw})


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw, field", [
    (dict(d_model=30, n_heads=4), "n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
    (dict(d_model=24, n_heads=8), "n_heads"),  # odd head dim
    (dict(dropout=1.5), "dropout"),
    (dict(n_layers=0), "n_layers"),
    (dict(arch="nope"), "arch"),
    (dict(vocab_size=2.5), "vocab_size"),
])
def test_invalid_config_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=rf"\b{field}="):
        tiny(**kw)


def test_presets_and_overrides():
    cfg = ModelConfig.from_preset("rope-123m")
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size,
            cfg.max_seq_len, cfg.tie_embeddings, cfg.embed_scale) == (768, 12, 12, 3, 2048, 32000, 1024, False, True)
    assert ModelConfig.from_preset("rope-5.5m", n_layers=2).n_layers == 2
    with pytest.raises(ConfigError, match="unknown preset"):
        ModelConfig.from_preset("rope-1t")
    with pytest.raises(ConfigError, match="n_layerz"):
        ModelConfig.from_preset("rope-tiny", n_layerz=3)
    cfg = ModelConfig.from_preset("rope-small")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------- params
def closed_form_params(c: ModelConfig) -> int:
    hd = c.head_dim
    attn = c.d_model * c.n_heads * hd + 2 * c.d_model * c.n_kv_heads * hd + c.n_heads * hd * c.d_model
    ffn = 3 * c.d_model * c.d_ff
    per_layer = attn + ffn + 2 * c.d_model
    head = 0 if c.tie_embeddings else c.vocab_size * c.d_model
    return c.vocab_size * c.d_model + c.n_layers * per_layer + c.d_model + head


@pytest.mark.parametrize("preset", ["rope-123m", "rope-5.5m", "rope-small"])
def test_parameter_count_closed_form(preset):
    from phaseloop.analysis.params import count_params

    cfg = ModelConfig.from_preset(preset)
    counts = count_params(cfg)
    assert counts["total"] == closed_form_params(cfg)
    assert counts["embedding"] == counts["unembedding"] == cfg.vocab_size * cfg.d_model
    assert counts["total"] == counts["embedding"] + counts["unembedding"] + counts["non_embedding"]
    # forward FLOPs: 2 per MAC of every matmul (incl. head) + full T x T attention products
    matmul = counts["total"] - counts["embedding"] - (2 * cfg.n_layers + 1) * cfg.d_model
    attn = 2 * 2 * cfg.n_layers * cfg.max_seq_len * cfg.n_heads * cfg.head_dim
    assert counts["flops_per_token"] == 2 * matmul + attn


def test_tied_head_shares_the_embedding():
    m = build_model(tiny(tie_embeddings=True))
    assert m.head.weight is m.embed.tok.weight
    assert sum(p.numel() for p in m.parameters()) == closed_form_params(m.cfg)


def test_no_biases_and_scaled_init():
    cfg = tiny(n_layers=8, d_model=128, n_heads=4, d_ff=256, vocab_size=256)
    m = build_model(cfg)
    assert all(mod.bias is None for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    std = lambda t: t.detach().float().std().item()
    assert std(m.trunk.layers[0].attn.q_proj.weight) == pytest.approx(0.02, rel=0.1)
    assert std(m.trunk.layers[0].attn.o_proj.weight) == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert std(m.trunk.layers[0].ffn.down.weight) == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert std(m.embed.tok.weight) == pytest.approx(0.02, rel=0.1)
    m1 = build_model(cfg.replace(embed_init_std=1.0))
    assert std(m1.embed.tok.weight) == pytest.approx(1.0, rel=0.1)


def test_embedding_scale():
    cfg = tiny()
    a, b = build_model(cfg), build_model(cfg.replace(embed_scale=True))
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 64, (1, 5))
    assert torch.allclose(b.embed(idx), a.embed(idx) * math.sqrt(cfg.d_model))


# ---------------------------------------------------------------------------- attention
def test_rope_depends_only_on_relative_position():
    cos, sin = rope_tables(torch.arange(20), 8, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    rot = lambda x, p: apply_rope(x, cos[p:p + 1], sin[p:p + 1])
    s1 = (rot(q, 7) * rot(k, 3)).sum()
    s2 = (rot(q, 15) * rot(k, 11)).sum()
    assert torch.allclose(s1, s2, atol=1e-5)
    assert torch.allclose(rot(q, 0), q)  # position 0 is the identity
    assert torch.allclose(rot(q, 5).norm(), q.norm(), atol=1e-5)  # a rotation


def test_gqa_attention_matches_explicit_reference():
    cfg = tiny(n_heads=4, n_kv_heads=2)
    attn = build_model(cfg).trunk.layers[0].attn
    x = torch.randn(2, 6, cfg.d_model)
    from phaseloop.layers import ForwardContext

    cos, sin = rope_tables(torch.arange(6), cfg.head_dim, cfg.rope_base)
    got = attn(x, ForwardContext(cos, sin))
    B, T, H, K, E = 2, 6, 4, 2, cfg.head_dim
    q = apply_rope(attn.q_proj(x).view(B, T, H, E).transpose(1, 2), cos, sin)
    k, v = attn.kv_proj(x).view(B, T, 2, K, E).unbind(2)
    k = apply_rope(k.transpose(1, 2), cos, sin).repeat_interleave(H // K, dim=1)
    v = v.transpose(1, 2).repeat_interleave(H // K, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(E)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    ref = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))
    assert torch.allclose(got, ref, atol=1e-5)


def test_dropout_only_in_training():
    m = build_model(tiny(dropout=0.5))
    idx = torch.randint(0, 64, (2, 10))
    m.eval()
    assert torch.equal(m(idx).logits, m(idx).logits)
    m.train()
    assert not torch.equal(m(idx).logits, m(idx).logits)


def test_loss_ignores_masked_targets():
    m = build_model(tiny())
    idx = torch.randint(0, 64, (2, 10))
    tgt = torch.randint(0, 64, (2, 10))
    masked = tgt.clone()
    masked[:, :5] = -100
    logits = m(idx).logits
    want = F.cross_entropy(logits[:, 5:].flatten(0, 1), tgt[:, 5:].flatten())
    assert torch.allclose(m(idx, masked).loss, want, atol=1e-6)


# ---------------------------------------------------------------------------- every architecture
@pytest.mark.parametrize("preset", TINY)
def test_causal_no_future_leak(preset):
    """Changing token t+1 leaves the outputs at positions <= t unchanged."""
    m = build_model(_config(preset)).eval()
    idx = torch.randint(0, 256, (2, 24))
    t = 11
    idx2 = idx.clone()
    idx2[:, t + 1:] = (idx2[:, t + 1:] + 7) % 256
    a, b = m(idx).logits, m(idx2).logits
    assert torch.allclose(a[:, : t + 1], b[:, : t + 1], atol=1e-5)
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:], atol=1e-5)


@pytest.mark.parametrize("preset", TINY)
def test_kv_cache_equals_full_forward(preset):
    m = build_model(_config(preset)).eval()
    idx = torch.randint(0, 256, (2, 30))
    full = m(idx).logits
    cache = KVCache()
    pieces = [m(idx[:, :9], cache=cache).logits]  # prefill
    pieces += [m(idx[:, t: t + 1], cache=cache).logits for t in range(9, 20)]  # token by token
    pieces.append(m(idx[:, 20:], cache=cache).logits)  # chunk after a cached prefix
    assert cache.pos == 30
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-4)


@pytest.mark.parametrize("preset", TINY)
def test_cache_holds_the_declared_slots(preset):
    """A cached forward writes the slots the trunk declares (Trunk.cache_slots): all of
    them, or a subset where the depth depends on the input (ACT's early exit)."""
    m = build_model(_config(preset)).eval()
    cache = KVCache()
    m(torch.randint(0, 256, (2, 8)), cache=cache)
    written, declared = set(cache.entries), set(m.trunk.cache_slots())
    assert written and written <= declared, written - declared
    if not m.cfg.act:
        assert written == declared


@pytest.mark.parametrize("preset", TINY)
def test_trunk_interface(preset):
    """Every trunk declares its depth and distinct blocks; set_depth works where
    dynamic_depth says so (and changes the output) and is refused by name elsewhere."""
    from phaseloop.layers import Block
    from phaseloop.trunk import Trunk

    m = build_model(_config(preset)).eval()
    trunk = m.trunk
    assert isinstance(trunk, Trunk)
    blocks = trunk.blocks()
    assert blocks and all(isinstance(b, Block) for b in blocks) and len({id(b) for b in blocks}) == len(blocks)
    assert trunk.depth >= len(blocks)  # each block applied at least once
    idx = torch.randint(0, 256, (1, 6))
    if trunk.dynamic_depth:  # set_depth(n): n applications of the shared block(s), here 1
        before = m(idx).logits
        trunk.set_depth(1)
        assert not torch.allclose(m(idx).logits, before)  # every tiny preset trains > 1
    else:
        with pytest.raises(ConfigError, match="fixed depth"):
            trunk.set_depth(2)
        trunk.fix_depth()  # FSDP2's request: a no-op here


@pytest.mark.parametrize("preset", TINY)
def test_cached_generation_equals_uncached(preset):
    m = build_model(_config(preset))
    idx = torch.randint(0, 256, (1, 5))
    a = m.generate(idx, 12, temperature=0.0, use_cache=True)
    b = m.generate(idx, 12, temperature=0.0, use_cache=False)
    assert a.shape == (1, 17) and torch.equal(a, b)


def test_generate_sampling_top_k_and_seed():
    m = build_model(tiny())
    idx = torch.zeros(1, 3, dtype=torch.long)
    g = lambda s: torch.Generator().manual_seed(s)
    a = m.generate(idx, 20, temperature=1.0, top_k=3, generator=g(1))
    b = m.generate(idx, 20, temperature=1.0, top_k=3, generator=g(1))
    assert torch.equal(a, b)
    # every sampled token must be among the 3 most likely at its step
    logits = m(a[:, :-1]).logits[0, 2:]
    top3 = logits.topk(3, dim=-1).indices
    assert all(a[0, 3 + i].item() in top3[i].tolist() for i in range(20))


def test_rope_rotates_each_pair_by_its_angle():
    """RoPE (Su et al. 2021, §3.2) in the rotate-half layout written out per pair: element
    i and i + E/2 of a head at position p rotated by p * base^(-2i/E); so a query-key dot
    product depends on the positions' difference only."""
    E, base = 8, 500.0
    x = torch.randn(1, 2, 5, E, dtype=torch.float64)
    pos = torch.arange(3, 8)
    got = apply_rope(x, *rope_tables(pos, E, base))
    want = torch.empty_like(x)
    for t, p in enumerate(pos.tolist()):
        for i in range(E // 2):
            a = p * base ** (-2 * i / E)
            u, v = x[..., t, i], x[..., t, i + E // 2]
            want[..., t, i] = u * math.cos(a) - v * math.sin(a)
            want[..., t, i + E // 2] = u * math.sin(a) + v * math.cos(a)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)  # the tables are fp32
    q, k = torch.randn(E, dtype=torch.float64), torch.randn(E, dtype=torch.float64)
    rot = lambda v, p: apply_rope(v.view(1, 1, 1, E), *rope_tables(torch.tensor([p]), E, base)).flatten()
    assert float(rot(q, 9) @ rot(k, 4)) == pytest.approx(float(rot(q, 15) @ rot(k, 10)), abs=1e-5)
