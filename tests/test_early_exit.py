"""Early exit per position (issue 25, early_exit.py), float64 tiny models: eps = 0 is the
full depth exactly; cached decoding equals the full pass (1e-10) with identical exit
decisions for every rule and trunk; an exited position's state is frozen and its later
keys/values come from it; the FLOPs accounting; bad rules and stacks refused."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from phaseloop import ConfigError, ModelConfig, build_model
from phaseloop.analysis.exits import exit_flops, tally
from phaseloop.analysis.params import flops_per_token
from phaseloop.early_exit import Monitor, parse_exit, set_exit
from phaseloop.layers import KVCache

torch.set_num_threads(1)

D = 4  # passes the tests run (beyond the tiny models' trained 2 loops: extend='last')
CASES = [("universal-tiny", {}), ("looped-tiny", {}), ("hyperloop-tiny", {}),
         ("hyperloop-tiny", {"hc_per_layer": True}), ("hyperloop-tiny", {"hc_transition": "pooled_mlp"})]
IDS = ["universal", "looped", "hyperloop", "hyperloop-per-layer", "hyperloop-pooled"]


def _model(preset, depth=D, **over):
    torch.manual_seed(0)
    m = build_model(ModelConfig.from_preset(preset, **over)).eval().double()
    m.trunk.set_depth(depth, extend="last")
    return m


def _idx(T=16):
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))


def _rule(text):
    return parse_exit(text)[0]


def _mixed(m, idx, kind):
    """A value of rule ``kind`` under which positions exit after different passes (found by
    bisection of log10 EPS on the mean depth; argmax: K = 1 .. D - 1)."""
    lo, hi, D = -10.0, 3.0, m.trunk.passes
    for v in range(1, D) if kind == "argmax" else range(20):
        if kind != "argmax":
            v = 10 ** ((lo + hi) / 2)
        set_exit(m, _rule(f"{kind}:{v}"))
        passes = m(idx).stats["exit_passes"]
        if (passes < D).any() and len(passes.unique()) > 1:
            return passes
        if kind != "argmax":
            lo, hi = (lo, (lo + hi) / 2) if passes.float().mean() < (D + 1) / 2 else ((lo + hi) / 2, hi)
    pytest.fail(f"no {kind} value gives mixed exit decisions")


def _cached(m, idx):
    """Logits and exit passes decoded with a KV cache: a 5-token prefill, 6 single tokens, a chunk."""
    cache, outs = KVCache(), []
    for a, b in [(0, 5), *[(t, t + 1) for t in range(5, 11)], (11, idx.shape[1])]:
        outs.append(m(idx[:, a:b], cache=cache))
    return torch.cat([o.logits for o in outs], 1), torch.cat([o.stats["exit_passes"] for o in outs], 1)


@pytest.mark.parametrize("preset,over", CASES, ids=IDS)
def test_zero_eps_is_the_full_depth_exactly(preset, over):
    m = _model(preset, **over)
    idx = _idx()
    full = m(idx).logits
    for text in ("kl:0", "state:0", f"argmax:{D}"):
        set_exit(m, _rule(text))
        out = m(idx)
        assert torch.equal(out.logits, full), text
        assert (out.stats["exit_passes"] == D).all(), text
    set_exit(m, None)
    assert "exit_passes" not in m(idx).stats


@pytest.mark.parametrize("depth", [3, D])
@pytest.mark.parametrize("kind", ["kl", "argmax", "state"])
@pytest.mark.parametrize("preset,over", CASES, ids=IDS)
def test_cached_decoding_equals_the_full_pass_with_the_same_decisions(preset, over, kind, depth):
    m = _model(preset, depth, **over)
    idx = _idx()
    passes = _mixed(m, idx, kind)
    full = m(idx).logits
    logits, cached_passes = _cached(m, idx)
    assert torch.equal(cached_passes, passes)  # decisions identical with and without the cache
    torch.testing.assert_close(logits, full, atol=1e-10, rtol=0)
    set_exit(m, None)
    assert not torch.allclose(m(idx).logits, full)  # the exits changed the output


def test_act_threshold_at_inference():
    torch.manual_seed(0)
    m = build_model(ModelConfig.from_preset("universal-act-tiny", act_halting_bias_init=-1.0)).eval().double()
    idx = _idx()
    plain = m(idx)
    set_exit(m, _rule(f"act:{1 - m.cfg.act_epsilon}"))  # the trained threshold
    assert torch.equal(m(idx).logits, plain.logits)
    means = []
    for thr in (0.5, 0.8):
        set_exit(m, _rule(f"act:{thr}"))
        out = m(idx)
        logits, cached_passes = _cached(m, idx)
        torch.testing.assert_close(logits, out.logits, atol=1e-10, rtol=0)
        assert torch.equal(cached_passes, out.stats["exit_passes"])
        means.append(float(out.stats["exit_passes"].mean()))
    assert means[0] < means[1] < float(plain.stats["exit_passes"].mean())


@pytest.mark.parametrize("preset,over", CASES, ids=IDS)
def test_an_exited_position_is_frozen(preset, over, monkeypatch):
    m = _model(preset, **over)
    idx = _idx()
    passes = _mixed(m, idx, "state")
    seen, step = [], Monitor.step

    def spy(self, before, after):
        done = self.done.clone()
        x = step(self, before, after)
        seen.append((done, before, x))
        return x

    monkeypatch.setattr(Monitor, "step", spy)
    m(idx)
    assert len(seen) == int(passes.max()) and seen[-1][0].any()  # the loop stops once none runs
    for done, before, x in seen:
        assert torch.equal(x[done], before[done])
        assert done.all() or not torch.equal(x[~done], before[~done])  # running ones move


def test_later_keys_values_of_an_exited_position_come_from_its_frozen_state():
    """CALM's state propagation (Schuster et al. 2022 §3.3): each middle layer of every later
    pass projects an exited position's values from its frozen state."""
    m = _model("looped-tiny")
    idx = _idx()
    passes = _mixed(m, idx, "state")
    frozen = {}
    m.trunk.end[0].register_forward_pre_hook(lambda mod, a: frozen.update(x=a[0]))  # the loop's output
    cache = KVCache()
    m(idx, cache=cache)
    exited = (passes < D).nonzero().tolist()
    for j, blk in enumerate(m.trunk.middle):
        _, v_BKTE = blk.attn.project_kv(blk.attn_norm(frozen["x"]))
        for b, i in exited:
            for later in range(int(passes[b, i]), D):
                got = cache.entries[("middle", j, later)][1][b, :, i]
                torch.testing.assert_close(got, v_BKTE[b, :, i], atol=1e-12, rtol=1e-12)
    b, i = (passes == passes.max()).nonzero()[0].tolist()  # a running position's values change
    last = int(passes.max()) - 1
    assert not torch.allclose(cache.entries[("middle", 0, last)][1][b, :, i],
                              cache.entries[("middle", 0, last - 1)][1][b, :, i])


def _flops(fn, *args) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn(*args)
    return fc.get_total_flops()


@pytest.mark.parametrize("preset", ["looped-tiny", "universal-tiny"])
def test_exit_flops(preset):
    """F(D) without exits; all exiting after pass 1: F(1) + readouts of the head (kl-lens:
    p_0 and p_1; kl: p_1 through the end block), + (D - 1) x the keys/values of a pass where
    a cache waits for them (recompute), each counted here on its own; a UT's last readout
    is its logits (nothing follows its loop: ``early_exit.Readout``), so it counts one fewer."""
    m = _model(preset)
    T = 16
    idx = _idx(T)
    F1 = flops_per_token(m.cfg, T, 1, "last")
    assert exit_flops(m, T) == flops_per_token(m.cfg, T, D, "last")
    blocks = getattr(m.trunk, "middle", None) or [m.trunk.block]
    x1 = torch.zeros(1, 1, m.cfg.d_model, dtype=torch.float64)
    kv = sum(_flops(b.attn.kv_proj, x1) for b in blocks)
    head = _flops(m.head, x1)
    end = (flops_per_token(m.cfg, T, 2, "last") - F1) / len(blocks) * len(getattr(m.trunk, "end", []))
    for text, readouts, each in (("state:1e9", 0, 0), ("kl-lens:1e9", 2, head), ("kl:1e9", 1, head + end)):
        set_exit(m, _rule(text))
        readouts -= bool(readouts) and preset == "universal-tiny"
        for cache in (None, KVCache()):
            with tally(m) as t:
                m(idx, cache=cache)
            assert t.mean("passes") == 1 and t.mean("readouts") == readouts
            filled = 0 if cache is None else (D - 1) * kv  # nobody reads the later passes' keys uncached
            assert exit_flops(m, T, t) == round(F1 + filled + readouts * each)


@pytest.mark.parametrize("text,pattern", [
    ("", "unknown exit rule"), ("foo:1", "unknown exit rule"), ("kl", "lacks a value"),
    ("kl:", "lacks a value"), ("kl:1e-3,", "lacks a value"), ("kl:x", "not a number"),
    ("kl:-1", "out of range"), ("state:nan", "out of range"), ("kl:inf", "out of range"),
    ("argmax:0", "out of range"), ("argmax:1.5", "not a number"), ("act:0", "out of range"),
    ("act:1.5", "out of range"), ("kl:1e-3,1e-3", "repeated"),
])
def test_bad_rules_are_one_line(text, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        parse_exit(text)
    assert "\n" not in str(e.value)


def test_parse_sweep():
    assert [r.label for r in parse_exit(" KL:1e-4, 1e-3 ")] == ["kl:0.0001", "kl:0.001"]
    assert parse_exit("argmax:2")[0].value == 2 and parse_exit("act:1")[0].value == 1.0


@pytest.mark.parametrize("preset", ["rope-tiny", "3pt-tiny", "mhc-tiny"])
def test_stacks_refuse(preset):
    m = build_model(ModelConfig.from_preset(preset))
    with pytest.raises(ConfigError, match="stack of distinct layers") as e:
        set_exit(m, _rule("kl:1e-3"))
    assert "\n" not in str(e.value) and "looped" in str(e.value)


def test_an_encoder_decoder_and_a_static_cache_refuse():
    """set_exit on a seq2seq model, and a rule meeting a static cache (whose slots hold a
    fixed depth), are one-line ConfigErrors, not AttributeError / TypeError mid-decode."""
    from phaseloop.archs.seq2seq import build_seq2seq
    from phaseloop.kvcache import StaticKVCache

    with pytest.raises(ConfigError, match="encoder-decoder") as e:
        set_exit(build_seq2seq(ModelConfig.from_preset("universal-tiny")), _rule("state:0.5"))
    assert "\n" not in str(e.value)
    m = build_model(ModelConfig.from_preset("looped-tiny")).eval()
    set_exit(m, _rule("state:10"))  # every position exits after the first pass
    with torch.no_grad(), pytest.raises(ConfigError, match="static KV cache") as e:
        m(torch.randint(0, 64, (1, 4)), cache=StaticKVCache(16))
    assert "\n" not in str(e.value)


def test_rule_and_act_mismatch_refused():
    ut_act = build_model(ModelConfig.from_preset("universal-act-tiny"))
    with pytest.raises(ConfigError, match="halts by ACT"):
        set_exit(ut_act, _rule("kl:1e-3"))
    with pytest.raises(ConfigError, match="has no ACT"):
        set_exit(build_model(ModelConfig.from_preset("looped-tiny")), _rule("act:0.9"))


@pytest.mark.parametrize("form, n_res", [("diagonal", 4), ("sinkhorn", 16), ("identity", 0)])
def test_a_hyper_connection_s_coefficients_cost_what_the_docs_say(form, n_res):
    """docs/early_exit.md: the uncounted work of an exited position in a Hyperloop is its
    connections' coefficient matmul, 2 n d (2n + n_res) FLOPs per connection and position."""
    from phaseloop.archs.hyperconn import HyperConnection

    cfg = ModelConfig.from_preset("hyperloop-small", hc_res=form)
    n, d = cfg.n_streams, cfg.d_model
    hc = HyperConnection(cfg, loop_embedding=True, residual_f=True)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        hc.coefficients(torch.randn(2, 5, n, d))
    assert fc.get_total_flops() == 2 * 5 * 2 * n * d * (2 * n + n_res)
    if form == "diagonal":
        assert 2 * n * d * (2 * n + n_res) == 12_288  # the docs' example at n 4, d 128


def test_one_pass_makes_no_decision_and_reads_nothing():
    """"The first decision follows pass 1; none follows the last": at depth 1 a rule has no
    decision to make, so no p_0 readout is spent (or counted) on it."""
    from phaseloop.early_exit import parse_exit, set_exit

    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("looped-tiny")).eval()
    model.trunk.set_depth(1)
    x = torch.randint(0, 256, (1, 8))
    plain = model(x).logits
    for rule in ("argmax:2", "kl-lens:0.1", "kl:0.1"):
        set_exit(model, parse_exit(rule)[0])
        out = model(x)
        assert "exit_readouts" not in out.stats and torch.equal(out.logits, plain), rule
