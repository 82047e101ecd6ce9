"""The pieces of the GPU path that a CPU can check: every trunk traces for torch.compile
in one graph (zero graph breaks), a preallocated KV cache written in place equals the
full pass, activation checkpointing changes no number, MFU arithmetic."""

import pytest
import torch

from phaseloop.config import ModelConfig
from phaseloop.engine import TrainConfig, Trainer, dist
from phaseloop.layers import KVCache
from phaseloop.model import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = [("rope-tiny", {}), ("3pt-tiny", {}), ("universal-tiny", {}), ("universal-act-tiny", {}),
         ("universal-act-tiny", {"act_type": "accumulated"}), ("looped-tiny", {}), ("hyperloop-tiny", {}),
         ("hyperloop-tiny", {"hc_res": "sinkhorn"}), ("hyperloop-tiny", {"hc_transition": "pooled_mlp"}),
         ("mhc-tiny", {}), ("rope-tiny", {"n_phases": 3, "phase_rotation": True, "phase_norm": True,
                                          "phase_aligned_gqa": True, "horn": True})]
IDS = [p + "".join(f"-{v}" for v in o.values()) for p, o in ARCHS]


def _model(preset, over, dtype=torch.float32):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_preset(preset, **over)).to(dtype).eval()


@pytest.mark.parametrize("preset, over", ARCHS, ids=IDS)
def test_every_trunk_compiles_without_graph_breaks(preset, over):
    """fullgraph=True fails on any graph break; the traced model equals eager."""
    torch._dynamo.reset()
    m = _model(preset, over).train()
    x, y = torch.randint(0, 256, (2, 12)), torch.randint(0, 256, (2, 12))
    explain = torch._dynamo.explain(m)(x, y)
    assert explain.graph_break_count == 0, [str(b.reason)[:200] for b in explain.break_reasons]
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, y).loss, m(x, y).loss)


@pytest.mark.parametrize("preset, over", ARCHS, ids=IDS)
def test_preallocated_cache_equals_the_full_pass(preset, over):
    """Prefill then token by token into a preallocated cache (float64, rtol 0), keys and
    values written in place: the buffers never move."""
    m = _model(preset, over, torch.float64)
    x = torch.randint(0, 256, (2, 10))
    full = m(x).logits
    cache = KVCache(capacity=10)
    steps = [m(x[:, :4], cache=cache).logits]
    ptrs = {s: b[0].data_ptr() for s, b in cache.buffers.items()}
    for t in range(4, 10):
        steps.append(m(x[:, t:t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=0)
    assert ptrs and {s: b[0].data_ptr() for s, b in cache.buffers.items() if s in ptrs} == ptrs
    grown = KVCache()  # no capacity: grown by cat, the same numbers
    out = [m(x[:, :4], cache=grown).logits] + [m(x[:, t:t + 1], cache=grown).logits for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(out, 1), full, atol=1e-10, rtol=0)


def test_a_cache_that_outgrows_its_capacity_grows():
    m = _model("rope-tiny", {}, torch.float64)
    x = torch.randint(0, 256, (1, 9))
    cache = KVCache(capacity=3)
    out = [m(x[:, :2], cache=cache).logits] + [m(x[:, t:t + 1], cache=cache).logits for t in range(2, 9)]
    torch.testing.assert_close(torch.cat(out, 1), m(x).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("preset", ["rope-tiny", "universal-act-tiny", "hyperloop-tiny", "3pt-tiny"])
def test_activation_checkpointing_changes_no_number(preset):
    cfg = ModelConfig.from_preset(preset, dropout=0.1)
    x, y = torch.randint(0, 256, (2, 12)), torch.randint(0, 256, (2, 12))
    grads = []
    for ac in (False, True):
        torch.manual_seed(0)
        m = build_model(cfg).double()
        if ac:
            assert dist.checkpoint_activations(m) == len(dist.blocks_of(m)) > 0
        torch.manual_seed(1)  # the same dropout masks, recomputed ones included
        out = m(x, y)
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, atol=1e-12, rtol=0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-12, rtol=0, msg=n)


def test_trainer_with_activation_checkpointing_logs_the_same_losses():
    from phaseloop.data import TrainBatches
    from phaseloop.lm.train import lm_loss

    tokens = torch.randint(0, 256, (4000,)).numpy()
    runs = []
    for ac in (False, True):
        tc = TrainConfig(steps=3, batch_size=2, seq_len=16, warmup_steps=1, log_every=1, eval_every=100,
                         device="cpu", checkpoint_activations=ac)
        t = Trainer(lambda: build_model(ModelConfig.from_preset("rope-tiny")), tc,
                    TrainBatches(tokens, 16, 2, 0), lm_loss)
        t.fit()
        runs.append([r["loss"] for r in t.records])
    assert runs[0] == pytest.approx(runs[1], rel=1e-6)


def test_mfu_arithmetic():
    assert dist.mfu(1000.0, 1e6, 1e12, 1) == pytest.approx(3 * 1e6 * 1000 / 1e12)
    assert dist.mfu(1000.0, 1e6, 1e12, 2) == pytest.approx(3 * 1e6 * 1000 / 2e12)
    assert dist.mfu(1000.0, None, 1e12, 1) is None and dist.mfu(1.0, 1e6, None, 1) is None
    assert dist.peak_flops(torch.device("cpu")) is None
    assert dist.peak_flops(torch.device("cpu"), 2.5) == 2.5e12


def test_compare_table_shows_mfu_only_when_measured():
    from phaseloop.compare.report import format_table

    v = dict(name="rope", finished_seeds=[0], flops_per_token=1e6, params=10, depth=1, tok_per_s={"mean": 1e3},
             peak_memory_mb={"mean": 5.0}, val_loss={"mean": 1.0, "std": None}, val_bpb={"mean": 1.0, "std": None},
             val_ppl={"mean": 2.7, "std": None}, step_speedup=None, wallclock_speedup=None, vs_reference=None)
    assert "MFU" not in format_table({"variants": [v]})
    table = format_table({"variants": [{**v, "mfu": {"mean": 0.42, "std": None}}]})
    head, _, row = table.splitlines()
    assert "| MFU |" in head and "| 0.420 |" in row and head.count("|") == row.count("|")


@pytest.mark.parametrize("preset", ["rope-tiny", "universal-act-tiny"])
def test_compiled_decoding_with_the_preallocated_cache_equals_eager(preset):
    from phaseloop.decoding import decode

    torch._dynamo.reset()
    m = _model(preset, {})
    x = torch.randint(0, 256, (2, 5))
    compiled = torch.compile(m, backend="eager", dynamic=True)
    out = decode(lambda inp, cache: compiled(inp, cache=cache), x, 5, temperature=0)
    assert torch.equal(out, m.generate(x, 5, temperature=0))
