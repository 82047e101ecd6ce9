"""phaseloop.analysis.probe (issue 26, inside a trained model) and the zero-sum profile over every
trunk's real layer applications: hooks change no number, each captured quantity equals
the one the model computes."""

from __future__ import annotations

import pytest
import torch

from phaseloop.analysis.probe import (
    analyze,
    attention_probs,
    encode_prompt,
    loss_vs_depth,
    next_token,
    recording,
    token_losses,
)
from phaseloop.archs.three_phase import zero_sum_diagnostic
from phaseloop.cli.three_phase_cmd import zero_sum_profile
from phaseloop.config import ModelConfig
from phaseloop.data.tokenizer import ByteTokenizer
from phaseloop.decoding import pick_next, sampling_probs
from phaseloop.errors import PhaseloopError
from phaseloop.layers import Attention, ForwardContext
from phaseloop.model import build_model

PHASES = dict(n_phases=3, phase_rotation=True, phase_norm=True, horn=True)
SMALL = dict(vocab_size=64, d_model=48, n_heads=6, n_kv_heads=3, d_ff=64, max_seq_len=32)
# (arch, fields, layer applications per forward: what the profile must walk)
TRUNKS = [
    ("three_phase", dict(n_layers=2), 2),
    ("universal", dict(n_steps=3), 3),
    ("looped", dict(n_layers=3, n_loops=2), 6),
    ("hyperloop", dict(n_layers=4, n_begin=1, n_end=1, n_loops=3), 1 + 3 + 1),
    ("mhc", dict(n_layers=2), 4),  # one hyper-connection per sub-layer
]


def _model(arch, phases=True, **over):
    torch.manual_seed(0)
    return build_model(ModelConfig(arch=arch, **(PHASES if phases else {}), **SMALL, **over)).eval()


def _idx(T=16, B=2):
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch,over,n_apps", TRUNKS, ids=[t[0] for t in TRUNKS])
def test_zero_sum_profile_walks_every_application(arch, over, n_apps):
    model, idx = _model(arch, **over), _idx()
    with torch.no_grad():
        x_BTD = model.embed(idx)
        y_BTD = model.trunk(x_BTD, ForwardContext.at(model.cfg, 0, idx.shape[1], idx.device))
    rows = zero_sum_profile(model, idx)
    assert len(rows) == 1 + n_apps, [r["site"] for r in rows]  # was 1 (embedding alone) for mhc
    assert len({r["site"] for r in rows}) == len(rows)  # every application named apart
    assert rows[0]["zero_sum"] == pytest.approx(zero_sum_diagnostic(x_BTD, 3), abs=1e-6)
    # the last application writes the trunk's output (streams: their mean, as merged)
    assert rows[-1]["zero_sum"] == pytest.approx(zero_sum_diagnostic(y_BTD, 3), abs=1e-6)


@pytest.mark.parametrize("arch,over", [(a, o) for a, o, _ in TRUNKS] + [("universal", dict(act=True, act_max_steps=4))])
def test_recording_changes_no_number(arch, over):
    model, idx = _model(arch, **over), _idx()
    with torch.no_grad():
        plain = model(idx).logits
        with recording(model, attention=True) as rec:
            hooked = model(idx).logits
        after = model(idx).logits
    assert torch.equal(plain, hooked) and torch.equal(plain, after)
    assert rec.attention and rec.states[0][0] == "embedding"


def _probs_times_v_is_the_output(attn: Attention, x: torch.Tensor, ctx) -> torch.Tensor:
    """``attention_probs`` of ``attn`` on ``x``, checked: times V (GQA heads repeated) and
    through the output projection they give the module's own output."""
    B, T, _ = x.shape
    with torch.no_grad():
        p_BHTS = attention_probs(attn, x, ctx)
        _, v_BKSE = attn.project_kv(x)
        v_BHSE = v_BKSE.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)
        y = attn.o_proj((p_BHTS @ v_BHSE).transpose(1, 2).reshape(B, T, -1))
        assert torch.allclose(y, attn(x, ctx), atol=1e-5)
    return p_BHTS


@pytest.mark.parametrize("arch,over", [("rope", dict(n_layers=1)), ("three_phase", dict(n_layers=1))])
def test_attention_probs_are_the_weights_sdpa_applies(arch, over):
    model = _model(arch, phases=arch != "rope", **over)
    attn: Attention = next(m for m in model.modules() if isinstance(m, Attention))
    x = torch.randn(2, 12, 48)
    ctx = ForwardContext.at(model.cfg, 0, 12, x.device)
    p_BHTS = _probs_times_v_is_the_output(attn, x, ctx)
    assert torch.allclose(p_BHTS.sum(-1), torch.ones(2, 6, 12))
    assert p_BHTS[..., 0, 1:].abs().max() == 0  # causal: the first token sees itself only


def test_attention_probs_keep_to_documents():
    """With document ids (``--doc-mask``) and positions (``--doc-positions``) the weights
    are causal within each document: times V they give the module's output, and no
    weight crosses a document boundary (issue 38, item 8)."""
    model = _model("rope", phases=False)
    attn: Attention = next(m for m in model.modules() if isinstance(m, Attention))
    x = torch.randn(2, 12, 48)
    doc = torch.tensor([[0] * 5 + [1] * 7, [-1] * 3 + [0] * 4 + [1] * 5])  # -1: a partial first document
    pos = torch.tensor([list(range(5)) + list(range(7)), list(range(3)) + list(range(4)) + list(range(5))])
    ctx = ForwardContext.at(model.cfg, 0, 12, x.device, pos, doc_ids=doc)
    p_BHTS = _probs_times_v_is_the_output(attn, x, ctx)
    across = doc[:, None, :, None] != doc[:, None, None, :]
    assert p_BHTS.masked_select(across.expand_as(p_BHTS)).abs().max() == 0
    assert torch.allclose(p_BHTS.sum(-1), torch.ones(2, 6, 12))


def test_analyze_passes_the_document_inputs():
    model, idx = _model("rope", phases=False), _idx(T=12, B=1)[0]
    docs = {"doc_ids_BT": torch.tensor([0] * 5 + [1] * 7),
            "positions_BT": torch.tensor(list(range(5)) + list(range(7)))}
    a, plain = analyze(model, idx, docs=docs), analyze(model, idx)
    with torch.no_grad():
        out = model(idx[None, :-1], targets_BT=idx[None, 1:], **{k: v[None, :-1] for k, v in docs.items()})
    assert sum(a.loss) / len(a.loss) == pytest.approx(out.ce_loss.item(), rel=1e-6)
    assert a.loss[:4] == pytest.approx(plain.loss[:4]) and a.loss[5:] != pytest.approx(plain.loss[5:])
    w = a.attention[0][1]  # [H, T, T]: the second document does not see the first
    assert w[:, 5:, :5].abs().max() == 0 and plain.attention[0][1][:, 5:, :5].abs().max() > 0
    rows = loss_vs_depth(_model("universal", phases=False, n_steps=2), idx, [1, 2], docs)
    assert len(rows) == 2


def test_halted_marks_the_steps_of_weight_zero():
    """ACT: a position's update weight is 0 at every step after it halted; ``halted`` is
    that mask, the same as tensor2tensor's loop on the recorded probabilities gives."""
    from phaseloop.archs.act import halting_schedule

    model = _model("universal", phases=False, act=True, act_max_steps=6)
    with torch.no_grad():  # halting probabilities that differ widely between positions
        model.trunk.halting.weight.normal_(0, 1.0)
        model.trunk.halting.bias.zero_()
    a = analyze(model, _idx(T=16, B=1)[0])
    sched = halting_schedule(torch.tensor(a.halting, dtype=torch.float64), 1 - model.cfg.act_epsilon,
                             len(a.halting))
    assert a.halted == [[t >= n for n in sched.n_updates.tolist()] for t in range(len(a.halting))]
    halted = torch.tensor(a.halted)
    assert (sched.update_weights[halted] == 0).all() and (sched.update_weights[~halted] > 0).any()
    flat = halted.flatten().tolist()
    assert any(flat) and not all(flat)  # some positions halted before others


def test_sampling_probs_is_what_pick_next_samples():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    p = sampling_probs(logits, 0.5)
    assert torch.allclose(p, torch.softmax(logits / 0.5, -1))
    p2 = sampling_probs(logits, 1.0, top_k=2)
    e = torch.exp(torch.tensor([2.0, 1.0]))
    assert torch.allclose(p2[0, :2], e / e.sum()) and p2[0, 2:].abs().max() == 0
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([pick_next(logits.expand(4000, -1), 1.0, 2, g) for _ in range(1)])
    assert set(draws.flatten().tolist()) <= {0, 1}
    assert (draws == 0).float().mean().item() == pytest.approx((e / e.sum())[0].item(), abs=0.03)
    top = next_token(logits[0], 1.0, 2)
    assert [t["id"] for t in top][:2] == [0, 1] and top[0]["p"] == pytest.approx((e / e.sum())[0].item())


def test_analyze_loss_ponder_and_stripes():
    model, idx = _model("universal", act=True, act_max_steps=4), _idx(T=10, B=1)
    with torch.no_grad():
        out = model(idx[:, :-1], targets_BT=idx[:, 1:])
        ref = model(idx)
    a = analyze(model, idx[0])
    assert sum(a.loss) / len(a.loss) == pytest.approx(out.ce_loss.item(), rel=1e-5)
    assert a.ponder == pytest.approx(ref.stats["ponder_time"][0].tolist())
    assert len(a.halting[0]) == 10 and len(a.halting) == ref.stats["halting_probs"].shape[0]
    # the horn sets the DC of token t to r(t) = 1/(t+1) and the stripes' sum to N H_T / T
    emb = a.extras["stripes"][0]
    assert emb["site"] == "embedding"
    assert emb["dc"] == pytest.approx([1 / (t + 1) for t in range(10)], abs=1e-5)
    assert emb["zero_sum"] == pytest.approx(3 * sum(1 / k for k in range(1, 11)) / 10, abs=1e-5)
    assert torch.allclose(token_losses(ref.logits[0], idx[0]), torch.tensor(a.loss))


def test_analyze_angles_and_mixing():
    model, idx = _model("hyperloop", n_layers=4, n_begin=1, n_end=1, n_loops=3), _idx(T=8, B=1)
    a = analyze(model, idx[0])
    rot = [m for m in model.modules() if type(m).__name__ == "PhaseRotation"]
    assert len(a.extras["angles"]["theta"]) == len(rot) and len(a.extras["angles"]["theta"][0]) == 8  # d_phase / 2
    assert [r["layer"] for r in a.extras["angles"]["drift"]] == [m.layer_idx for m in rot]
    assert len(a.mixing) == 3  # one hyper-connection per loop
    hc = model.trunk.hc[0]
    with torch.no_grad():
        x = model.trunk.run(model.trunk.begin, model.embed(idx), ForwardContext.at(model.cfg, 0, 8, idx.device),
                            "begin")
        pre, post, res = hc.coefficients(x.unsqueeze(2).expand(-1, -1, 4, -1))
    assert torch.allclose(torch.tensor(a.mixing[0]["pre"]), pre[0], atol=1e-6)
    assert torch.allclose(torch.tensor(a.mixing[0]["post"]), post[0], atol=1e-6)
    sim = torch.tensor(a.mixing[1]["similarity"])
    assert torch.allclose(sim.diagonal(), torch.ones(4), atol=1e-5) and a.mixing[0]["vs_previous"] is None
    assert len(a.attention) == 1 + 2 * 3 + 1 and a.attention[0][1].shape == (6, 8, 8)


def test_loss_vs_depth_on_a_copy():
    model, idx = _model("looped", phases=False, n_layers=2, n_loops=2), _idx(T=8, B=1)
    plain = sum(analyze(model, idx[0], attention=False).loss) / 7
    rows = loss_vs_depth(model, idx[0], [1, 2, 3])
    assert [r["depth"] for r in rows] == [1, 2, 3]
    assert rows[1]["loss"] == pytest.approx(plain, rel=1e-6)
    assert rows[0]["loss"] != pytest.approx(plain) and model.trunk.loops == 2  # the model itself unchanged


def test_recording_refuses_other_models():
    with pytest.raises(PhaseloopError, match="not a decoder-only phaseloop model"):
        with recording(torch.nn.Linear(2, 2)):
            pass


def test_encode_prompt_bounds():
    tok = ByteTokenizer()
    assert encode_prompt(tok, "hello", 8).tolist() == list(b"hello")
    for text, match in (("x" * 9, "longer than this model's max_seq_len 8"), ("", "empty"), ("x", "at least 2")):
        with pytest.raises(PhaseloopError, match=match):
            encode_prompt(tok, text, 8)
