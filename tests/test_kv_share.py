"""The KV cache shared across passes (issue 39, --kv-share K, Huginn §6.2) and the cache's
own contracts: float64 tiny models at 4 passes. K >= passes is the unshared cache exactly;
pass i reads and writes slot i mod K (checked against hand-filled unshared caches); the
cache holds K slots per looped layer; truncate forgets positions as if never fed."""

import pytest
import torch

from phaseloop import ConfigError, ModelConfig, build_model
from phaseloop.early_exit import parse_exit, set_exit, set_kv_share
from phaseloop.inference import Options, TokenByToken, generate
from phaseloop.kvcache import OWED
from phaseloop.layers import KVCache

torch.set_num_threads(1)

D = 4
TRUNKS = ["universal-tiny", "universal-act-tiny", "looped-tiny", "hyperloop-tiny"]


def _model(preset, **over):
    torch.manual_seed(0)
    m = build_model(ModelConfig.from_preset(preset, **over)).eval().double()
    m.trunk.set_depth(D, extend="last")
    return m


def _idx(B=2, T=10):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("preset", TRUNKS)
def test_k_at_least_the_passes_is_the_unshared_cache(preset):
    m = _model(preset)
    idx = _idx()
    full = m(idx).logits
    set_kv_share(m, D)
    torch.testing.assert_close(TokenByToken(m)(idx).logits, full, atol=1e-10, rtol=0)
    set_kv_share(m, 1)
    shared = TokenByToken(m)(idx).logits
    assert not torch.allclose(shared, full, rtol=0, atol=1e-6)  # the shared cache changes the output


def _reference(m, idx, K, slot):
    """Token-by-token decoding in which pass i of a token reads every earlier token's
    keys/values of its latest pass j = i mod K (+ K, ...): the unshared code path with each
    token's cache filled by hand from a store of every (token, pass, layer)."""
    store, logits = [], []  # store[token][pass][layer] = (keys, values) of that token
    fixed = [n for n in m.trunk.cache_slots() if n[0] in ("begin", "end")]  # never shared
    for t in range(idx.shape[1]):
        cache = KVCache(pos=t)
        for name in fixed if t else ():
            cache.entries[name] = tuple(torch.cat([store[s][-1][name][h] for s in range(t)], 2) for h in (0, 1))
        for i in range(D):
            j = max(p for p in range(D) if p % K == i % K)
            for a, name in enumerate(slot(i)):
                if t:
                    cache.entries[name] = tuple(torch.cat([store[s][j][a][h] for s in range(t)], 2)
                                                for h in (0, 1))
        logits.append(m(idx[:, t:t + 1], cache=cache).logits)
        row = lambda name, c=cache: tuple(e[:, :, -1:] for e in c.entries[name])
        store.append([[row(name) for name in slot(i)] for i in range(D)] + [{n: row(n) for n in fixed}])
    return torch.cat(logits, 1)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("preset", ["universal-tiny", "looped-tiny"])
def test_pass_i_reads_and_writes_slot_i_mod_k(preset, K):
    m = _model(preset)
    idx = _idx(T=7)
    if preset.startswith("universal"):
        slot = lambda i: [("ut", i)]
    else:
        slot = lambda i: [("middle", j, i) for j in range(len(m.trunk.middle))]
    want = _reference(m, idx, K, slot)  # unshared: one slot per pass
    set_kv_share(m, K)
    torch.testing.assert_close(TokenByToken(m)(idx).logits, want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("preset", TRUNKS[1:])
def test_the_cache_holds_k_slots_per_looped_layer(preset):
    m = _model(preset, **({"act_halting_bias_init": -3.0} if "act" in preset else {}))  # ACT: every step
    idx = _idx()
    sizes = {}
    for K in (None, 2, 1):
        set_kv_share(m, K)
        cache = KVCache(capacity=idx.shape[1])
        m(idx, cache=cache)
        assert set(cache.entries) <= set(m.trunk.cache_slots())
        kv = [s for s, e in cache.entries.items() if isinstance(e, tuple) and len(e) == 2 and e[0].dim() == 4]
        sizes[K] = (len(kv), cache.nbytes)
        B, H, E = idx.shape[0], m.cfg.n_kv_heads, m.cfg.head_dim
        assert cache.nbytes >= len(kv) * 2 * B * H * idx.shape[1] * E * 8  # buffers held whole
    fixed = 2 if preset.startswith(("looped", "hyperloop")) else 0  # begin + end
    per_pass = (sizes[None][0] - fixed) // D
    assert sizes[1][0] == fixed + per_pass and sizes[2][0] == fixed + 2 * per_pass
    assert sizes[1][1] < sizes[2][1] < sizes[None][1]


def test_nbytes_counts_what_is_held():
    cache = KVCache(capacity=8)
    k = torch.zeros(2, 3, 5, 4)
    cache.update("a", k, k)
    assert cache.nbytes == 2 * 2 * 3 * 8 * 4 * 4  # the preallocated buffer, keys and values
    grown = KVCache()
    grown.update("a", k, k)
    assert grown.nbytes == 2 * k.nbytes


@pytest.mark.parametrize("capacity", [None, 4])
def test_owed_rows_are_what_update_would_have_written(capacity):
    """``owe`` copies nothing until the slot's next write or a read of ``entries``; then
    the cache holds, bit for bit, what ``update`` writes (appended in order; a second
    write in the same forward replaces; truncate, select_rows and nbytes see them)."""
    rows = [torch.randn(2, 3, t, 4, generator=torch.Generator().manual_seed(t)) for t in (3, 1, 1, 1)]
    eager, lazy = KVCache(capacity=capacity), KVCache(capacity=capacity)
    for i, r in enumerate(rows):
        eager.update("a", r, -r)
        (lazy.update if i == 2 else lazy.owe)("a", r, -r)
        if i == 1:
            assert len(lazy.owed["a"]) == 2 and "a" not in lazy._entries  # nothing copied yet
        eager.pos += r.shape[2]
        lazy.pos += r.shape[2]
    for c in (eager, lazy):  # a shared slot written twice in one forward: the second replaces
        for r in (rows[1], rows[3]):
            c.owe("a", r, -r) if c is lazy else c.update("a", r, -r)
        c.pos += 1
    assert lazy.nbytes == eager.nbytes and not lazy.owed
    for got, want in zip(lazy.entries["a"], eager.entries["a"]):
        assert torch.equal(got, want) and got.shape[2] == 7
    assert torch.equal(lazy.entries["a"][0][:, :, -1:], rows[3])
    for c in (eager, lazy):
        c.owe("a", rows[2], rows[2]) if c is lazy else c.update("a", rows[2], rows[2])
        c.pos += 1
        c.select_rows(torch.tensor([1]))
        c.truncate(7)
    assert [tuple(t.shape) for t in lazy.entries["a"]] == [(1, 3, 7, 4)] * 2
    assert all(torch.equal(g, w) for g, w in zip(lazy.entries["a"], eager.entries["a"]))
    for c in (eager, lazy):  # outgrowing the buffer: owed rows grow it as the writes one by one would
        for r in (r[1:] for r in rows * 4):  # row 1: the one select_rows kept
            c.owe("a", r, r) if c is lazy else c.update("a", r, r)
            c.pos += r.shape[2]
    assert lazy.nbytes == eager.nbytes
    assert [t.shape for t in lazy.buffers.get("a", ())] == [t.shape for t in eager.buffers.get("a", ())]
    assert all(torch.equal(g, w) for g, w in zip(lazy.entries["a"], eager.entries["a"]))
    many = KVCache()
    for _ in range(OWED):
        many.owe("b", rows[1], rows[1])
        many.pos += 1
    assert not many.owed and many._entries["b"][0].shape[2] == OWED  # at most OWED forwards owed


@pytest.mark.parametrize("share,capacity", [(None, 12), (1, 12), (None, 2)])  # 2: buffers outgrown, copied
@pytest.mark.parametrize("preset", TRUNKS)
def test_truncate_forgets_positions_as_if_never_fed(preset, share, capacity):
    m = _model(preset, **({"act_halting_bias_init": -1.0} if "act" in preset else {}))
    set_kv_share(m, share)
    idx = _idx(T=9)
    other = torch.randint(0, 256, (2, 3), generator=torch.Generator().manual_seed(7))
    cache = KVCache(capacity=capacity)
    m(idx[:, :4], cache=cache)
    first = [m(idx[:, t:t + 1], cache=cache).logits for t in range(4, 9)]
    cache.truncate(6)
    m(other, cache=cache)  # positions 6 .. 8 fed differently, then forgotten again
    cache.truncate(6)
    again = [m(idx[:, t:t + 1], cache=cache).logits for t in range(6, 9)]
    torch.testing.assert_close(torch.cat(again, 1), torch.cat(first[2:], 1), atol=1e-12, rtol=0)
    assert cache.pos == 9
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(10)


def test_truncate_rolls_running_sums_back_and_refuses_other_state_by_name():
    """The pooled transition's running sums (hyperconn.RunningSums) roll back with the cache:
    tokens fed again after ``truncate(3)`` give the full forward's logits (float64); an
    entry that can neither be cut nor rolled back is refused by its slot's name."""
    m, idx = _model("hyperloop-tiny", hc_transition="pooled_mlp"), _idx()
    cache = KVCache()
    with torch.no_grad():
        m(idx[:, :6], cache=cache)
        cache.truncate(3)
        again = m(idx[:, 3:], cache=cache).logits
        full = m(idx).logits[:, 3:]
    assert cache.pos == idx.shape[1] and cache.entries[("pool", 0)].count == idx.shape[1]
    torch.testing.assert_close(again, full, atol=1e-10, rtol=0)
    cache.entries["summary"] = ("not", "tensors")
    with pytest.raises(ConfigError, match="'summary'.*cannot be rolled back"):
        cache.truncate(3)


@pytest.mark.parametrize("preset", ["rope-tiny", "3pt-tiny", "mhc-tiny"])
def test_stacks_refuse_sharing_in_one_line(preset):
    m = build_model(ModelConfig.from_preset(preset))
    with pytest.raises(ConfigError, match="stack of distinct layers") as e:
        set_kv_share(m, 1)
    assert "\n" not in str(e.value) and "--kv-share applies to" in str(e.value)


def test_bad_share_values_and_fill_without_a_rule():
    m = _model("looped-tiny")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="positive integer"):
            set_kv_share(m, bad)
    with pytest.raises(ConfigError, match="add --exit"):
        set_exit(m, None, "latest")
    with pytest.raises(ConfigError, match="recompute or latest"):
        set_exit(m, parse_exit("kl:1")[0], "newest")
    act = _model("universal-act-tiny")
    with pytest.raises(ConfigError, match="no pass is skipped"):
        set_exit(act, parse_exit("act:0.5")[0], "latest")


def test_act_rows_under_a_shared_cache_are_each_row_alone():
    """UT+ACT: a row's steps past its positions' halting overwrite a shared slot only while
    another row still runs, so eval --kv-share (TokenByToken over a batch of windows)
    evaluates each row alone, and generate refuses more than one prompt in one line."""
    torch.manual_seed(0)
    m = build_model(ModelConfig.from_preset("universal-act-tiny", init_std=0.2,
                                            act_halting_bias_init=-1.0)).eval().double()
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(5))
    for k in (1, 2):
        set_kv_share(m, k)
        with torch.no_grad():
            batched = TokenByToken(m)(x).logits
            alone = torch.cat([TokenByToken(m)(x[i:i + 1]).logits for i in range(4)])
        torch.testing.assert_close(batched, alone, atol=1e-10, rtol=0)
    set_kv_share(m, None)
    with pytest.raises(ConfigError, match="one prompt at a time, not 4") as e:
        generate(m, x, Options(max_new_tokens=2, kv_share=1))
    assert "\n" not in str(e.value)
    assert generate(m, x[:1], Options(max_new_tokens=2, kv_share=1)).tokens.shape == (1, 2)
    with pytest.raises(ConfigError, match="drop --no-cache"):
        generate(_model("looped-tiny"), x[:1], Options(max_new_tokens=2, kv_share=1, use_cache=False))


def test_truncate_counts_positions_from_the_caches_origin():
    """A cache that starts at position 10 (a task's offset) and holds 10, 11, 12: truncating
    to 11 keeps one row, the keys of position 10."""
    from phaseloop.kvcache import KVCache

    c = KVCache(pos=10)
    k = torch.arange(3.0).view(1, 1, 3, 1)
    c.update("s", k, k)
    c.pos = 13
    c.truncate(11)
    assert c.entries["s"][0].shape[2] == 1 and float(c.entries["s"][0][0, 0, 0, 0]) == 0.0 and c.pos == 11


def test_a_slot_short_of_the_caches_positions_cannot_join_a_batch():
    """A slot holding 2 of a cache's 3 positions (ACT's lazily extended step) is named, and
    join_rows refuses it by that name instead of failing on tensor shapes."""
    from phaseloop.decoding import join_rows, not_joinable
    from phaseloop.kvcache import KVCache

    c = KVCache(pos=3)
    k = torch.zeros(1, 1, 2, 4)
    c.entries["s"] = (k, k)
    assert not_joinable(c) == "its cache slot 's' holds 2 of 3 positions"
    with pytest.raises(ValueError, match="holds 2 of 3 positions"):
        join_rows([c, c])
