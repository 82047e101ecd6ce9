"""Depth at inference (issue 25): looped trunks run more or fewer passes of their shared
middle block; the trained depth is the plain path; cached decoding = the full pass."""

import pytest
import torch

from phaseloop import ConfigError, ModelConfig, build_model
from phaseloop.layers import KVCache

torch.set_num_threads(1)

CASES = [("looped-tiny", {}), ("hyperloop-tiny", {}), ("hyperloop-tiny", {"hc_per_layer": True}),
         ("hyperloop-tiny", {"hc_transition": "pooled_mlp"})]


def _model(preset, **over):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_preset(preset, **over)).eval()


def _idx(T=20):
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))


def _set(m, n):
    m.trunk.set_depth(n, extend="last") if hasattr(m.trunk, "hc") else m.trunk.set_depth(n)


@pytest.mark.parametrize("preset,over", CASES)
def test_trained_depth_is_the_plain_forward(preset, over):
    m = _model(preset, **over)
    idx = _idx()
    plain = m(idx).logits
    trained = m.trunk.n_loops
    _set(m, trained + 2)
    assert not torch.equal(m(idx).logits, plain)
    _set(m, trained)
    assert torch.equal(m(idx).logits, plain)


@pytest.mark.parametrize("preset,over", CASES)
@pytest.mark.parametrize("delta", [-1, 2])
def test_cached_decoding_equals_full_pass_at_another_depth(preset, over, delta):
    m = _model(preset, **over).double()
    _set(m, m.trunk.n_loops + delta)
    idx = _idx()
    full = m(idx).logits
    cache = KVCache()
    parts = [m(idx[:, :7], cache=cache).logits]
    parts += [m(idx[:, t:t + 1], cache=cache).logits for t in range(7, 12)]
    parts.append(m(idx[:, 12:], cache=cache).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-10, rtol=1e-10)
    middle = {k for k in cache.entries if isinstance(k, tuple) and k[0] == "middle"}
    assert middle == {k for k in m.trunk.cache_slots() if k[0] == "middle"}
    assert {k[2] for k in middle} == set(range(m.trunk.n_loops + delta))


def test_hyperloop_fewer_passes_use_the_first_loops_and_more_need_extend():
    m = _model("hyperloop-tiny")
    L = m.trunk.n_loops
    with pytest.raises(ConfigError, match="extend='last'"):
        m.trunk.set_depth(L + 1)
    assert m.trunk.loops == L  # a refusal changes nothing
    calls = []
    hooks = [hc.register_forward_hook(lambda mod, a, o, i=i: calls.append(i))
             for i, hc in enumerate(m.trunk.hc)]
    m.trunk.set_depth(L - 1)
    m(_idx(T=4))
    assert calls == list(range(L - 1))
    calls.clear()
    m.trunk.set_depth(L + 2, extend="last")
    m(_idx(T=4))
    assert calls == list(range(L)) + [L - 1] * 2
    for h in hooks:
        h.remove()


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, [2], "3"])
def test_bad_depths_refused(bad):
    for preset in ("looped-tiny", "hyperloop-tiny"):
        with pytest.raises(ConfigError, match="invalid depth"):
            _model(preset).trunk.set_depth(bad)
    with pytest.raises(ConfigError, match="extend"):
        _model("looped-tiny").trunk.set_depth(2, extend="first")


@pytest.mark.parametrize("preset", ["transformer-tiny", "3pt-tiny", "mhc-tiny"])
def test_stacks_have_no_depth_to_change(preset):
    t = _model(preset).trunk
    assert not t.dynamic_depth
    with pytest.raises(ConfigError, match="fixed depth"):
        t.set_depth(2)


@pytest.mark.parametrize("preset", ["looped-tiny", "hyperloop-tiny", "universal-tiny"])
def test_compiled_model_compiles_once_per_depth(preset):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = _model(preset)
    compiled = torch.compile(m, backend="eager")
    idx = _idx(T=8)
    for d in (2, 3, 2, 3, 3):  # two depths, five calls: two graphs
        _set(m, d)
        with torch.no_grad():
            got = compiled(idx).logits
        torch.testing.assert_close(got, m(idx).logits, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()
