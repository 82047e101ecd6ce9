"""The static KV cache (kvcache.StaticKVCache: module buffers of fixed shape, written at the
new tokens' positions, read under a mask) equals phaseloop's own KVCache: every `*-tiny`
preset and every registered architecture at its defaults, in float64 to 1e-10, over a
prefill, a chunk after it and single-token decode steps, and both equal the full pass. What
it cannot hold (state other than keys and values) is refused in one line."""

import pytest
import torch

from phaseloop import PRESETS, ConfigError, ModelConfig, build_model, registry
from phaseloop.kvcache import KVCache, StaticKVCache

ARCHS = registry.arch_names()
CASES = sorted(n for n in PRESETS if n.endswith("-tiny")) + [f"arch={a}" for a in ARCHS]
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(case: str, **kw):
    cfg = ModelConfig(arch=case[5:], **kw) if case.startswith("arch=") else ModelConfig.from_preset(case, **kw)
    torch.manual_seed(0)
    model = build_model(cfg).double().eval()
    with torch.no_grad():  # off its init: a zero-init path would hide a wrong read
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _decode(model, cache, x_BT, chunks=(0, 6, 9)):
    """Logits of x fed as the chunks [0, 6), [6, 9) (a prefill after a prefix), then one token
    at a time."""
    cuts = [*chunks, *range(chunks[-1] + 1, x_BT.shape[1] + 1)]
    return torch.cat([model(x_BT[:, a:b], cache=cache).logits for a, b in zip(cuts, cuts[1:])], 1)


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_static_cache_equals_the_kv_cache_and_the_full_pass(case):
    model = _model(case)
    if getattr(model.trunk, "halting", None) is not None:  # ACT: positions halting at different steps
        model.trunk.halting.weight.normal_(0, 1.0)
    x = torch.randint(0, model.cfg.vocab_size, (2, 24))
    full = model(x).logits
    dynamic = _decode(model, KVCache(), x)
    static_cache = StaticKVCache(model.cfg.max_seq_len, batch=2)
    static = _decode(model, static_cache, x)
    torch.testing.assert_close(static, dynamic, rtol=0, atol=1e-10)
    torch.testing.assert_close(static, full, rtol=0, atol=1e-10)
    assert static_cache.pos == 24 and len(static_cache.slots) == len(list(static_cache.buffers())) // 2
    if getattr(model.trunk, "halting", None) is not None:
        assert len(model(x).stats["exit_passes"].unique()) > 1  # the masks had something to mask


@torch.no_grad()
def test_positions_given_rewrite_the_cache_and_a_new_sequence_restarts_at_zero():
    """The exported program's contract: ``positions_BT`` (input_pos) says where the new keys
    go; a second sequence written from position 0 over a longer first one sees none of it."""
    model = _model("looped-tiny")
    cache = StaticKVCache(32)
    a, b = torch.randint(0, 256, (1, 20)), torch.randint(0, 256, (1, 12))
    model(a, cache=cache, positions_BT=torch.arange(20)[None])
    got = torch.cat([model(b[:, :5], cache=cache, positions_BT=torch.arange(5)[None]).logits,
                     *(model(b[:, t:t + 1], cache=cache, positions_BT=torch.tensor([[t]])).logits
                       for t in range(5, 12))], 1)
    torch.testing.assert_close(got, model(b).logits, rtol=0, atol=1e-10)


def test_what_a_static_cache_cannot_hold_is_refused_in_one_line():
    x = torch.randint(0, 256, (1, 4))
    pooled = _model("hyperloop-tiny", hc_transition="pooled_mlp")
    with pytest.raises(ConfigError, match="pooled_mlp.*running sums.*static cache") as e:
        pooled(x, cache=StaticKVCache(64))
    assert "\n" not in str(e.value)
    rope = _model("rope-tiny")
    with pytest.raises(ConfigError, match="exceed the static cache's max_len=8"):
        rope(torch.randint(0, 256, (1, 9)), cache=StaticKVCache(8))
    with pytest.raises(ConfigError, match="for batch 1 got a batch of 2"):
        rope(torch.randint(0, 256, (2, 4)), cache=StaticKVCache(8))
    with pytest.raises(ConfigError, match="state other than keys and values"):
        _ = StaticKVCache(8).entries
    with pytest.raises(ConfigError, match="positive number of positions"):
        StaticKVCache(0)
    with pytest.raises(ConfigError, match="document positions and masks"):
        rope(x, cache=StaticKVCache(8), doc_ids_BT=torch.zeros(1, 4, dtype=torch.long))


def test_a_static_cache_fills_exactly_and_refuses_past_it_across_calls():
    """max_len positions fit (8 tokens into 8); positions past it, over two calls, are one
    ConfigError, not an index error inside the write."""
    m = build_model(ModelConfig.from_preset("rope-tiny")).eval()
    with torch.no_grad():
        m(torch.randint(0, 256, (1, 8)), cache=StaticKVCache(8))
        cache = StaticKVCache(8)
        m(torch.randint(0, 256, (1, 5)), cache=cache)
        with pytest.raises(ConfigError, match="10 positions exceed the static cache's max_len=8"):
            m(torch.randint(0, 256, (1, 5)), cache=cache)
