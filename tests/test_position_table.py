"""kvcache.position_table: a decode's RoPE and UT timing tables, made once per cache and
sliced per forward, equal the tables made anew for the same positions (bit for bit), and
the model's outputs with them equal those without a cache."""

import pytest
import torch

from phaseloop import ModelConfig, build_model
from phaseloop.kvcache import KVCache, StaticKVCache, position_table
from phaseloop.layers import ForwardContext, rope_tables, timing_signal


@pytest.mark.parametrize("head_dim", [6, 48, 64])
def test_rope_slices_equal_tables_made_anew_as_the_cache_grows(head_dim):
    cache = KVCache(capacity=5)
    make = lambda p: rope_tables(p, head_dim, 10000.0)
    start, sizes = 0, []
    for T in (3, 1, 1, 4, 1, 9, 1, 30):  # a prompt, then tokens and chunks past the capacity
        cos, sin = position_table(cache, ("rope", head_dim), start, T, "cpu", make)
        want = make(torch.arange(start, start + T))
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
        sizes.append(cache.tables[("rope", head_dim), "cpu"][0].shape[0])
        start += T
    assert sizes == [5, 5, 5, 10, 10, 20, 20, 50]  # capacity, then doubled (or to the end when more)


def test_the_ut_timing_signal_and_a_second_table_share_the_cache():
    cache = KVCache()
    for start in range(0, 40, 3):
        got = position_table(cache, ("ut", 50), start, 3, "cpu", lambda p: timing_signal(p, 50))
        assert torch.equal(got, timing_signal(torch.arange(start, start + 3), 50))
        position_table(cache, ("rope", 8), start, 3, "cpu", lambda p: rope_tables(p, 8, 500.0))
    assert {k for k, _ in cache.tables} == {("ut", 50), ("rope", 8)}


def test_no_table_is_kept_without_a_growing_cache():
    calls = []

    def make(p):
        calls.append(p.tolist())
        return timing_signal(p, 16)
    assert torch.equal(position_table(None, "k", 4, 2, "cpu", make), timing_signal(torch.arange(4, 6), 16))
    static = StaticKVCache(8, batch=1)
    position_table(static, "k", 1, 2, "cpu", make)
    assert calls == [[4, 5], [1, 2]]


def test_forward_context_reads_the_cache_tables():
    cfg = ModelConfig.from_preset("rope-tiny")
    cache = KVCache(capacity=16)
    ctx = ForwardContext.at(cfg, 7, 2, "cpu", cache=cache)
    cos, sin = rope_tables(torch.arange(7, 9), cfg.head_dim, cfg.rope_base)
    assert torch.equal(ctx.cos, cos) and torch.equal(ctx.sin, sin)
    assert cache.tables[("rope", cfg.head_dim, cfg.rope_base), "cpu"][0].shape[0] == 16


@pytest.mark.parametrize("preset", ["universal-tiny", "rope-tiny"])
def test_cached_decoding_with_the_tables_equals_the_full_pass(preset):
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset(preset)).double().eval()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 13))
    with torch.no_grad():
        full = model(idx).logits
        cache = KVCache(capacity=4)  # outgrown twice
        steps = [model(idx[:, :5], cache=cache).logits]
        steps += [model(idx[:, i:i + 1], cache=cache).logits for i in range(5, 13)]
    assert len(cache.tables) == (2 if preset.startswith("universal") else 1)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


def test_compiled_code_makes_the_tables_anew():
    cache = KVCache(capacity=8)

    @torch.compile(backend="eager")
    def shifted(x):
        return x + position_table(cache, ("ut", 16), 3, 2, "cpu", lambda p: timing_signal(p, 16))

    assert torch.equal(shifted(torch.zeros(2, 16)), timing_signal(torch.arange(3, 5), 16))
    assert not cache.tables  # nothing kept from inside a graph
