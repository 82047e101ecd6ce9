"""Rows of a continuous batch in one KV cache (``decoding.join_rows`` / ``keep_rows``) and the
serve decode loop over them: every row's logits equal the row decoded alone (float64, 1e-10)
for every architecture whose cache joins, whichever rows join and leave around it; the
others are said not to join and still decode alone. Greedy and seeded sampled output of the
loop equal ``DecoderLM.generate`` alone and in any batch; the nucleus rule (top_p)."""

import time

import pytest
import torch

from phaseloop import PRESETS, ModelConfig, build_model, registry
from phaseloop.decoding import join_rows, keep_rows, not_joinable, padded_rows, sampling_probs
from phaseloop.early_exit import parse_exit, set_exit, set_kv_share
from phaseloop.layers import KVCache
from phaseloop.serve.engine import Engine
from phaseloop.serve.options import Settings, applied
from phaseloop.serve.sequence import Sampling, Sequence

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = sorted(p for p in PRESETS if p.endswith("-tiny"))
CONFIGS = [(p, {}) for p in TINY] + [("looped-tiny", {"exit": "kl:0.09"}),  # 21 of 32 positions exit after pass 1
                                     ("universal-tiny", {"exit": "argmax:2"}),
                                     ("hyperloop-tiny", {"hc_transition": "pooled_mlp"}),
                                     # rows exiting after different passes: the pass gathers the running ones
                                     ("looped-tiny", {"exit": "state:1.5", "fill": "latest"}),
                                     ("hyperloop-tiny", {"exit": "state:1.5"})]
CONFIGS += [(f"arch={a}", {}) for a in registry.arch_names() if a not in {PRESETS[p]["arch"] for p in TINY}]
IDS = [f"{p}-{'-'.join(f'{k}={v}' for k, v in o.items())}" if o else p for p, o in CONFIGS]


def _model(name: str, over: dict, dtype=torch.float64):
    over = dict(over)
    rule, fill = over.pop("exit", None), over.pop("fill", "recompute")
    cfg = ModelConfig(arch=name[5:]) if name.startswith("arch=") else ModelConfig.from_preset(name, **over)
    torch.manual_seed(0)
    model = build_model(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if rule:
        set_exit(model, parse_exit(rule)[0], fill)
    return model


PROMPTS = [[5, 17, 99, 3, 42], [7, 1, 250, 33, 8, 8, 61, 2, 19], [100, 4, 77]]


def _alone(model, prompt, steps):
    """Logits [steps + 1, V] of greedy decoding ``prompt`` by itself, and its tokens."""
    cache = KVCache(capacity=len(prompt) + steps + 1)
    x, logits, toks = torch.tensor([prompt]), [], []
    for _ in range(steps + 1):
        out = model(x, cache=cache)
        logits.append(out.logits[0, -1])
        x = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(int(x))
    return torch.stack(logits), toks


@pytest.mark.parametrize("name,over", CONFIGS, ids=IDS)
def test_rows_in_a_batch_equal_each_row_alone(name, over):
    """Rows 0 and 1 start together, row 2 joins two steps later (longer rows left-pad it, its
    cache pads theirs), rows finish in turn and the padding shrinks: every row's logits are
    its logits alone (tokens teacher-forced to the row's own greedy ones)."""
    model, steps = _model(name, over), 5
    with torch.no_grad():
        alone = [_alone(model, p, steps) for p in PROMPTS]
        caches, got = [], {r: [] for r in range(3)}
        for r, p in enumerate(PROMPTS):
            caches.append(KVCache(capacity=len(p) + steps))
            got[r].append(model(torch.tensor([p]), cache=caches[r]).logits[0, -1])
        why = not_joinable(caches[0])
        if over.get("hc_transition") or getattr(model.trunk, "halting", None) is not None:
            assert why is not None and "slot" in why  # UT+ACT's step inputs, the pooled sums
            return
        assert why is None, why
        batch, rows = join_rows(caches[:2], capacity=32), [0, 1]
        for it in range(2 * steps):
            if it == 2:
                batch, rows = join_rows([batch, caches[2]], capacity=0), rows + [2]  # 0: as many as it holds
            x = torch.tensor([[alone[r][1][len(got[r]) - 1]] for r in rows])
            out = model(x, cache=batch)
            for i, r in enumerate(rows):
                got[r].append(out.logits[i, -1])
            keep = [i for i, r in enumerate(rows) if len(got[r]) <= steps]
            keep_rows(batch, keep)
            rows = [rows[i] for i in keep]
            if not rows:
                break
            assert batch.pad is None or int(batch.pad.min()) == 0  # all-padding columns dropped
    for r in range(3):
        assert len(got[r]) == steps + 1
        assert (torch.stack(got[r]) - alone[r][0]).abs().max() < 1e-10, r


def test_padded_rows_mask_and_positions():
    cache = KVCache(pos=6, pad=torch.tensor([0, 2, 5]))
    pos_BT, mask = padded_rows(cache, 2, "cpu")
    assert pos_BT.tolist() == [[6, 7], [4, 5], [1, 2]]
    assert mask.shape == (3, 1, 2, 8)
    assert mask.any(-1).all()  # no empty softmax row
    assert mask[2, 0, 0].tolist() == [False] * 5 + [True, True, False]  # causal, padding unseen
    pos_BT, mask = padded_rows(KVCache(pos=0, pad=torch.tensor([0, 2])), 3, "cpu")
    assert pos_BT.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert mask[1, 0].tolist() == [[True, False, False], [False, True, False], [False, False, True]]


def test_nucleus_is_the_smallest_set_reaching_top_p():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    full = sampling_probs(logits, 0.7)
    assert torch.equal(sampling_probs(logits, 0.7, top_p=1.0), full)
    for p in (0.05, 0.3, 0.9, 0.999):
        cut = sampling_probs(logits, 0.7, top_p=p)
        assert torch.allclose(cut.sum(-1), torch.ones(6, dtype=cut.dtype))
        for b in range(6):
            order = full[b].argsort(descending=True)
            need = int((full[b][order].cumsum(0) < p).sum()) + 1  # the one crossing p included
            kept = cut[b] > 0
            assert int(kept.sum()) == need and bool(kept[order[:need]].all())
            assert torch.allclose(cut[b][kept], full[b][kept] / full[b][kept].sum())
    k = sampling_probs(logits, 1.0, top_k=3, top_p=0.999)
    assert int((k > 0).sum(-1).max()) <= 3  # top-k first, then the nucleus within it


def test_a_temperature_below_float_precision_takes_its_limit_row_by_row():
    """logits / T overflows in row 0 only: row 0 is its argmax (the T -> 0 limit, ties
    shared), row 1 is still softmax(logits / T), as it would be alone in its batch."""
    logits = torch.tensor([[3e38, 1e38, 3e38], [1e-3, 2e-3, 0.0]])
    p = sampling_probs(logits, 1e-3)
    assert p[0].tolist() == [0.5, 0.0, 0.5]
    torch.testing.assert_close(p[1], torch.tensor([1.0, 2.0, 0.0]).softmax(-1))
    torch.testing.assert_close(p[1:], sampling_probs(logits[1:], 1e-3))


def _loop(model, prompts, sampling, max_batch, settings=None, stagger=False, max_new=6):
    """Tokens the serve decode loop gives each prompt (``stagger``: submitted one by one)."""
    eng = Engine(model, max_batch=max_batch, max_queue=64).start()
    try:
        seqs = [Sequence(p, max_new, sampling, settings or Settings(), lambda ids: "", lambda ev: None)
                for p in prompts]
        for s in seqs:
            eng.submit([s])
            if stagger:
                time.sleep(0.01)
        deadline = time.monotonic() + 60
        while any(s.finish is None for s in seqs):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        return [s.tokens for s in seqs], eng
    finally:
        eng.stop()


@pytest.mark.parametrize("name", ["rope-tiny", "looped-tiny", "universal-act-tiny", "mhc-tiny"])
def test_loop_greedy_and_sampled_equal_generate_alone_and_batched(name):
    model = _model(name, {}, torch.float32)
    prompts = PROMPTS * 2
    for sampling in (Sampling(0.0), Sampling(0.9, top_k=20, seed=5)):
        want = []
        for p in prompts:
            g = torch.Generator().manual_seed(5)
            want.append(model.generate(torch.tensor([p]), 6, temperature=sampling.temperature, top_k=sampling.top_k,
                                       generator=g)[0, len(p):].tolist())
        for max_batch, stagger in ((1, False), (4, True), (16, False)):
            got, eng = _loop(model, prompts, sampling, max_batch, stagger=stagger)
            assert got == want, (sampling, max_batch)
        if max_batch > 1 and name != "universal-act-tiny":
            assert eng.steps < 6 * len(prompts)  # rows shared forwards


def test_loop_groups_requests_by_settings():
    """Different depths and exits in flight at once: each row decodes as the model set to
    its own settings would alone."""
    model = _model("looped-tiny", {}, torch.float32)
    passes = model.trunk.passes
    settings = [Settings(), Settings(depth=3), Settings(exit=parse_exit("kl:1e-2")[0]), Settings(depth=1)]
    eng = Engine(model, max_batch=16, max_queue=64).start()
    try:
        seqs = [Sequence(p, 6, Sampling(0.0), s, lambda ids: "", lambda ev: None) for s in settings for p in PROMPTS]
        eng.submit(seqs)
        while any(s.finish is None for s in seqs):
            time.sleep(0.005)
    finally:
        eng.stop()
    for s in seqs:
        with applied(model, s.settings):
            want = model.generate(torch.tensor([s.prompt]), 6, temperature=0)[0, len(s.prompt):].tolist()
        assert s.tokens == want, s.settings
    assert model.trunk.passes == passes and model.trunk.exits is None  # the loop leaves the model as it was


@pytest.mark.parametrize("share,rest_batch", [(None, None), (2, None), (None, 1)])
def test_rows_that_all_exit_fill_each_rows_own_keys(share, rest_batch, monkeypatch):
    """Left-padded rows (per-row RoPE tables) that all exit after pass 1 under recompute: the
    passes left are projected in one batch (``Monitor.rest``; ``rest_batch`` 1: one pass a
    batch), and every row's keys/values at every pass (with --kv-share 2: the later pass of
    each shared slot) equal those it writes alone."""
    model = _model("universal-tiny", {"exit": "state:1e9"})
    set_kv_share(model, share)
    alone, caches = [], []
    with torch.no_grad():
        for p in PROMPTS:
            caches.append(KVCache(capacity=len(p) + 1))
            model(torch.tensor([p]), cache=caches[-1])
            single = KVCache(capacity=len(p) + 1)
            model(torch.tensor([p]), cache=single)
            model(torch.tensor([[11 + len(p)]]), cache=single)
            alone.append(single)
        batch = join_rows(caches, capacity=16)
        if rest_batch:
            monkeypatch.setattr("phaseloop.early_exit.REST_BATCH", rest_batch)
        model(torch.tensor([[11 + len(p)] for p in PROMPTS]), cache=batch)
    slots = sorted({("ut", model.trunk.kv_slot(s)) for s in range(model.trunk.steps)})
    assert all(s in batch.entries for s in slots)
    for b, p in enumerate(PROMPTS):
        for s in slots:
            for got, want in zip(batch.entries[s], alone[b].entries[s], strict=True):
                assert (got[b:b + 1, :, -(len(p) + 1):] - want).abs().max() < 1e-10, (b, s)


def test_top_k_keeps_ties_at_the_kth_logit():
    """``sampling_probs``: the top_k largest logits, ties at the k-th kept (as documented)."""
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    p = sampling_probs(logits, 1.0, top_k=2)
    want = torch.tensor([[3.0, 2.0, 2.0]]).softmax(-1)
    torch.testing.assert_close(p, torch.cat([want, torch.zeros(1, 2)], 1), atol=1e-7, rtol=0)
