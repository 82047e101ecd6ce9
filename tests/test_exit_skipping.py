"""Exits that skip work (issue 39, passes.py): float64 tiny models at 4 passes. The gathered
pass under fill=recompute equals the dense masked pass (every position at every pass, the
exited ones' results discarded); cached decoding equals the full pass under fill=latest;
latest projects nothing; only the running rows reach the FFN; the counted FLOPs are the
executed ones; the rules compute what their papers define."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from phaseloop import ModelConfig, build_model
from phaseloop.analysis.exits import exit_flops, tally
from phaseloop.early_exit import Monitor, parse_exit, set_exit
from phaseloop.layers import KVCache
from phaseloop.passes import Running

torch.set_num_threads(1)

D = 4
CASES = [("universal-tiny", {}), ("looped-tiny", {}), ("hyperloop-tiny", {}),
         ("hyperloop-tiny", {"hc_per_layer": True}), ("hyperloop-tiny", {"hc_transition": "pooled_mlp"})]
IDS = ["universal", "looped", "hyperloop", "hyperloop-per-layer", "hyperloop-pooled"]
KINDS = ["kl", "kl-lens", "entropy", "argmax", "state", "accel"]
# every rule on the three trunks, two (an end-block readout, a state rule) on Hyperloop's variants
COMBOS = [(*c, k) for c in CASES[:3] for k in KINDS] + [(*c, k) for c in CASES[3:] for k in ("kl", "state")]
COMBO_IDS = [f"{i}-{k}" for i in IDS[:3] for k in KINDS] + [f"{i}-{k}" for i in IDS[3:] for k in ("kl", "state")]


def _model(preset, **over):
    torch.manual_seed(0)
    m = build_model(ModelConfig.from_preset(preset, **over)).eval().double()
    m.trunk.set_depth(D, extend="last")
    return m


def _idx(B=2, T=16):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))


def _mixed(m, idx, kind, fill="recompute"):
    """A value of ``kind`` under which positions exit after different passes, some after
    fewer than D (bisection of log10 EPS on the mean depth; argmax: K = 1 .. D - 1)."""
    lo, hi = -12.0, 4.0
    for v in range(1, D) if kind == "argmax" else range(24):
        if kind != "argmax":
            v = 10 ** ((lo + hi) / 2)
        set_exit(m, parse_exit(f"{kind}:{v}")[0], fill)
        passes = m(idx).stats["exit_passes"]
        if (passes < D).any() and len(passes.unique()) > 1:
            return passes
        if kind != "argmax":
            lo, hi = (lo, (lo + hi) / 2) if (passes < D).float().mean() > 0.5 else ((lo + hi) / 2, hi)
    pytest.fail(f"no {kind} value gives mixed exit decisions")


def _dense(monkeypatch):
    """Every pass computes every position (the masks of the code before issue 39)."""
    init, uniform = Running.__post_init__, Running.uniform.__func__

    def every(self):
        init(self)
        self.any = self.all = True
    monkeypatch.setattr(Running, "__post_init__", every)
    monkeypatch.setattr(Running, "uniform", classmethod(lambda cls, mask, fill, latest, running:
                                                         uniform(cls, mask, fill, latest, True)))


def _cached(m, idx):
    """Logits and exit passes decoded with a KV cache: a 5-token prefill, 6 single tokens, a
    chunk; every slot then holds every position (the skipped passes' and readouts' too)."""
    cache, outs = KVCache(), []
    for a, b in [(0, 5), *[(t, t + 1) for t in range(5, 11)], (11, idx.shape[1])]:
        outs.append(m(idx[:, a:b], cache=cache))
    kv = {s: e[0].shape[2] for s, e in cache.entries.items() if isinstance(e, tuple) and e[0].dim() == 4}
    assert set(kv) == set(m.trunk.cache_slots()) - {s for s in cache.entries if s[0] == "pool"}
    assert set(kv.values()) == {idx.shape[1]}, kv
    return torch.cat([o.logits for o in outs], 1), torch.cat([o.stats["exit_passes"] for o in outs], 1)


@pytest.mark.parametrize("preset,over,kind", COMBOS, ids=COMBO_IDS)
def test_recompute_equals_the_dense_masked_pass(preset, over, kind, monkeypatch):
    m = _model(preset, **over)
    idx = _idx()
    passes = _mixed(m, idx, kind)
    gathered = m(idx).logits
    with monkeypatch.context() as mp:
        _dense(mp)
        dense = m(idx)
    assert torch.equal(dense.stats["exit_passes"], passes)
    torch.testing.assert_close(gathered, dense.logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("preset,over,kind", COMBOS, ids=COMBO_IDS)
def test_latest_cached_decoding_equals_the_full_pass(preset, over, kind):
    m = _model(preset, **over)
    idx = _idx()
    passes = _mixed(m, idx, kind, "latest")
    full = m(idx).logits
    logits, cached_passes = _cached(m, idx)
    assert torch.equal(cached_passes, passes)
    torch.testing.assert_close(logits, full, atol=1e-10, rtol=0)
    earlier_exit = (passes[:, :, None] < passes[:, None, :]).triu(1).any()  # read by a later position
    set_exit(m, m.trunk.exits.rule, "recompute")  # the other fill: other keys for the exited ones
    assert torch.allclose(m(idx).logits, full, rtol=0, atol=1e-9) != bool(earlier_exit)


def test_latest_reads_the_deepest_keys_and_projects_none():
    """Huginn §6: a Looped model's cache holds, at every pass after a position's exit, the
    keys/values of its last computed pass, bit for bit."""
    m = _model("looped-tiny")
    idx = _idx()
    passes = _mixed(m, idx, "state", "latest")
    cache = KVCache()
    m(idx, cache=cache)
    calls = []
    for blk in m.trunk.middle:  # recompute projects the exited ones; latest does not
        blk.attn.kv_proj.register_forward_hook(lambda mod, a, out: calls.append(a[0].shape[:-1].numel()))
    for b, i in (passes < D).nonzero().tolist():
        p = int(passes[b, i])
        for j in range(len(m.trunk.middle)):
            last = cache.entries[("middle", j, p - 1)]
            for later in range(p, D):
                for got, want in zip(cache.entries[("middle", j, later)], last):
                    assert torch.equal(got[b, :, i], want[b, :, i])
    m(idx)
    assert sum(calls) == int(passes.sum()) * len(m.trunk.middle)  # one per running (position, pass)


@pytest.mark.parametrize("preset,over", CASES[:3], ids=IDS[:3])
def test_only_running_rows_reach_the_ffn(preset, over):
    m = _model(preset, **over)
    idx = _idx()
    passes = _mixed(m, idx, "state")
    rows = []
    blocks = [m.trunk.block] if hasattr(m.trunk, "block") else list(m.trunk.middle)
    for blk in blocks:
        blk.ffn.register_forward_hook(lambda mod, a, out: rows.append(a[0].shape[:-1].numel()))
    m(idx)
    assert sum(rows) == int(passes.sum()) * len(blocks) < D * idx.numel() * len(blocks)


def _executed(m, idx, cache):
    # the math kernel: its matmuls are counted (the fused CPU kernel is not), as on the meta device
    with torch.no_grad(), FlopCounterMode(display=False) as fc, tally(m) as t, sdpa_kernel(SDPBackend.MATH):
        m(idx, cache=cache)
    return fc.get_total_flops(), t


@pytest.mark.parametrize("fill", ["recompute", "latest"])
@pytest.mark.parametrize("kind", ["kl", "kl-lens", "state"])
@pytest.mark.parametrize("preset", ["universal-tiny", "looped-tiny"])
def test_counted_flops_are_the_executed_ones(preset, kind, fill):
    """FlopCounterMode over one forward (batch 1, with and without a cache) = exit_flops x
    tokens: the saving is taken off the work, not only counted."""
    m = _model(preset)
    idx = _idx(B=1)
    _mixed(m, idx, kind, fill)
    for cache in (None, KVCache()):
        flops, t = _executed(m, idx, cache)
        assert t.mean("passes") < D
        assert flops == pytest.approx(exit_flops(m, idx.shape[1], t) * idx.shape[1], rel=1e-6)


@pytest.mark.parametrize("preset", ["universal-tiny", "looped-tiny"])
@pytest.mark.parametrize("kind", ["kl", "kl-lens", "entropy"])
def test_a_readout_of_the_final_state_is_the_models_logits(preset, kind, monkeypatch):
    """Every position stopping at one decision: a UT returns the state the rule read, so
    that readout is its logits (``early_exit.Readout``: the head runs once, the logits are
    those of a second head bit for bit, the FLOPs counted are the executed ones); a Looped
    model's end block follows its loop, so its head runs again."""
    m = _model(preset)
    set_exit(m, parse_exit(f"{kind}:1e9")[0], "latest")
    idx = _idx(B=1, T=6)
    heads = []
    m.head.register_forward_hook(lambda *_: heads.append(1))
    cache, again = KVCache(), KVCache()
    for a, b in ((0, 5), (5, 6)):
        heads.clear()
        with torch.no_grad(), FlopCounterMode(display=False) as fc, tally(m) as t, sdpa_kernel(SDPBackend.MATH):
            got = m(idx[:, a:b], cache=cache).logits
        assert t.mean("passes") == 1 and len(heads) == (preset == "looped-tiny") + 1 + (kind == "kl-lens")
        if a == 0:  # exit_flops counts a sequence from its start (a decoded token attends to more)
            assert fc.get_total_flops() == pytest.approx(exit_flops(m, b, t) * b, rel=1e-6)
        with monkeypatch.context() as mp, sdpa_kernel(SDPBackend.MATH):  # the model's own head instead
            mp.setattr("phaseloop.early_exit.Readout.take", lambda self, x: None)
            assert torch.equal(m(idx[:, a:b], cache=again).logits, got)
        torch.testing.assert_close(m(idx[:, :b]).logits[:, a:], got, atol=1e-12, rtol=0)  # uncached


# ---------------------------------------------------------------------------- the rules
def _states(m, idx, kind, value, monkeypatch):
    """The state after every pass as the monitor sees it, and the exit passes."""
    seen, step = [], Monitor.step

    def spy(self, before, after):
        x = step(self, before, after)
        seen.append(x.detach().clone())
        return x
    set_exit(m, parse_exit(f"{kind}:{value}")[0])
    with monkeypatch.context() as mp:
        mp.setattr(Monitor, "step", spy)
        passes = m(idx).stats["exit_passes"]
    return seen, passes


def _first_exit(stop_TBT):
    """Expected exit passes: the first pass t (1-based, < D) whose rule holds, else D."""
    want = torch.full(stop_TBT.shape[1:], D)
    for t in range(stop_TBT.shape[0] - 1, -1, -1):
        want = torch.where(stop_TBT[t], t + 1, want)
    return want


@pytest.mark.parametrize("kind", ["kl", "kl-lens", "entropy", "state", "accel"])
def test_rules_as_their_papers_define_them(kind, monkeypatch):
    """UT (no end block: p_t = head(norm(h_t))), each rule's value written out from the
    states the monitor saw: kl = Huginn's F.kl_div(log p_t, log p_{t-1}, log_target=True)
    = KL(p_{t-1} || p_t) with p_0 uniform; kl-lens = KL(p_t || p_{t-1}) with p_0 read from
    the loop's input; entropy = |H_t - H_{t-1}| with H_0 = 100 nats; state = ||h_t - h_{t-1}||
    / ||h_{t-1}|| with h_0 the input; accel = Pappone et al.'s ||Δ_t - Δ_{t-1}|| below EPS at
    two successive passes (from pass 2). The head is sharpened (x30) so that p_t are far
    from uniform and KL's two directions differ; several thresholds each."""
    m = _model("universal-tiny")
    with torch.no_grad():
        m.head.weight.mul_(30)
    idx = _idx()
    set_exit(m, None)
    seen, _ = _states(m, idx, "state", 0, monkeypatch)  # every pass, nobody exits
    x0 = m.embed(idx)
    lens = lambda h: F.log_softmax(m.head(m.norm(h)), -1)
    logp, V = [lens(h) for h in seen], m.cfg.vocab_size
    kl = lambda p, q: (p.exp() * (p - q)).sum(-1)  # KL(p || q) of log-probabilities
    if kind == "kl":
        prev = [torch.full_like(logp[0], -math.log(V))] + logp[:-1]
        val = torch.stack([kl(pp, lp) for lp, pp in zip(logp, prev)])
        assert torch.allclose(val, torch.stack([F.kl_div(lp, pp, reduction="none", log_target=True).sum(-1)
                                                for lp, pp in zip(logp, prev)]))
    elif kind == "kl-lens":
        val = torch.stack([kl(lp, pp) for lp, pp in zip(logp, [lens(x0)] + logp[:-1])])
    elif kind == "entropy":
        H = [-(lp.exp() * lp).sum(-1) for lp in logp]
        val = torch.stack([(h - hp).abs() for h, hp in zip(H, [torch.full_like(H[0], 100.0)] + H[:-1])])
    elif kind == "state":
        val = torch.stack([(h - hp).norm(dim=-1) / hp.norm(dim=-1) for h, hp in zip(seen, [x0] + seen[:-1])])
    else:
        delta = [a - b for a, b in zip(seen, [x0] + seen[:-1])]
        acc = [torch.full(idx.shape, float("inf"), dtype=torch.float64)] + [
            (d - dp).norm(dim=-1) for d, dp in zip(delta[1:], delta[:-1])]
        val = torch.stack(acc)
    decided = (val[1:-1] if kind == "accel" else val[:-1]).detach().flatten()  # accel: none after pass 1
    values = [float(decided.quantile(q)) for q in (0.2, 0.4, 0.6, 0.8)]
    if kind == "entropy":  # H_1 <= ln V, so |H_1 - 100| >= 100 - ln V: no exit after pass 1 below that
        values += [10.0, 100 - math.log(V) + 0.5]
    if kind == "accel":  # above the first pass's own step, which a_t must not count (a_1 does not exist)
        values += [float(val[1:].max()) * 1.01, float((seen[0] - x0).norm(dim=-1).max()) * 1.01]
    exited = set()
    for eps in values:
        below = val < eps
        if kind == "accel":  # two hits in a row
            below = below & torch.cat([torch.zeros_like(below[:1]), below[:-1]])
        _, passes = _states(m, idx, kind, eps, monkeypatch)
        assert torch.equal(passes, _first_exit(below[:-1])), eps
        exited |= set(passes.unique().tolist())
        if kind == "entropy" and eps < 100 - math.log(V):
            assert int(passes.min()) >= 2
        if kind == "accel":
            assert int(passes.min()) >= 3
    assert len(exited) >= (2 if kind == "accel" else 3)  # different passes (accel: 3 or 4 of D = 4)


def test_accel_counts_successive_hits_from_the_second_pass():
    """Pappone et al.'s rule on states with set steps (the monitor driven directly):
    a_t = |Δ_t - Δ_{t-1}| exists from pass 2 and must be below EPS at two passes in a row."""
    from types import SimpleNamespace

    from phaseloop.early_exit import Exits
    from phaseloop.layers import ForwardContext

    def exit_pass(steps, eps=0.5):
        trunk = SimpleNamespace(exits=Exits(parse_exit(f"accel:{eps}")[0], torch.nn.Identity(),
                                            torch.nn.Linear(1, 2)), readout_blocks=0)
        ctx, x = ForwardContext(cos=None, sin=None), torch.zeros(1, 1, 1)
        mon = Monitor(trunk, x, ctx, len(steps) + 1)
        for d in steps:
            x = mon.step(x, x + d)
        return int(ctx.stats["exit_passes"])

    assert exit_pass([0.1, 0.1, 0.1, 0.1]) == 3  # a_2, a_3 = 0: after pass 3, not 2 (|Δ_1| < EPS is no a_1)
    assert exit_pass([1.0, 1.0, 3.0, 3.0, 3.0]) == 5  # hit (a_2), miss (a_3), hit, hit: after pass 5
    assert exit_pass([1.0, 3.0, 5.0, 7.0]) == 5  # never two hits: every pass


def test_kl_reads_looped_models_through_the_end_block():
    m = _model("looped-tiny")
    idx = _idx()
    calls = []
    m.trunk.end[0].register_forward_hook(lambda mod, a, out: calls.append(a[0].shape))
    for kind, reads in (("kl", D - 1), ("kl-lens", 0)):
        set_exit(m, parse_exit(f"{kind}:0")[0])
        calls.clear()
        m(idx)
        assert len(calls) == reads + 1  # readouts after every pass but the last, + the output


@pytest.mark.parametrize("preset", ["rope-tiny", "universal-tiny"])
def test_a_bad_fill_is_named_on_any_model(preset):
    """A stack would otherwise say it cannot exit early, leaving the bad --kv-fill unnamed."""
    from phaseloop.errors import ConfigError
    m = build_model(ModelConfig.from_preset(preset))
    with pytest.raises(ConfigError, match="--kv-fill 'bogus': choose recompute or latest"):
        set_exit(m, None, "bogus")
