"""Encoder-decoder models (seq2seq.py): vanilla Transformer and UT encoder-decoder,
cached decoding, source padding, ACT on either side, and a toy copy task trained to
(near) zero loss."""

import random

import pytest
import torch

from phaseloop import ConfigError, ModelConfig
from phaseloop.archs.seq2seq import collate
from phaseloop.data.tokenizer import BOS, EOS, PAD
from phaseloop.decoding import until_eos
from phaseloop.layers import KVCache
from phaseloop.models import TransformerSeq2Seq, UniversalSeq2Seq, build_seq2seq
from phaseloop.tasks.task_model import task_train_config, train_pairs

pytestmark = pytest.mark.usefixtures("one_thread")


BASE = dict(vocab_size=12, d_model=32, n_heads=2, d_ff=64, max_seq_len=16, embed_scale=True,
            embed_init_std=32 ** -0.5)


# the published block (Vaswani et al. 2017 / Dehghani et al. 2019, tensor2tensor)
PAPER = dict(ffn="relu", norm="layer", bias=True, use_rope=False, tie_embeddings=True)


def vanilla(**kw):
    return ModelConfig(**{**BASE, "arch": "rope", "n_layers": 2, **kw})


def universal(**kw):
    return ModelConfig(**{**BASE, "arch": "universal", "n_layers": 1, "n_steps": 2, **kw})


def spread(trunk):
    """Halting unit reading a few high-frequency channels: positions halt at different steps."""
    with torch.no_grad():
        trunk.halting.weight.zero_()
        trunk.halting.weight[:4] = torch.tensor([1.0, -0.8, 0.6, 1.2])
        trunk.halting.bias.fill_(-0.5)


def copy_pairs(n, rng, max_len=5):
    out = []
    for _ in range(n):
        s = [rng.randint(3, 10) for _ in range(rng.randint(1, max_len))]
        out.append((s, s))
    return out


def test_build_and_errors():
    assert isinstance(build_seq2seq(vanilla()), TransformerSeq2Seq)
    assert isinstance(build_seq2seq(universal()), UniversalSeq2Seq)
    with pytest.raises(ConfigError, match="arch"):
        UniversalSeq2Seq(vanilla())
    with pytest.raises(ConfigError, match="arch"):
        TransformerSeq2Seq(universal())
    ut = UniversalSeq2Seq(universal())
    names = {n.split(".")[0] for n, _ in ut.named_parameters()}
    assert names == {"embed", "enc_norm", "dec_norm", "head", "encoder", "decoder"}
    # one shared decoder block holds the one cross-attention; the encoder's has none
    assert ut.decoder.block.cross_attn is not None and ut.encoder.block.cross_attn is None
    # weight tying: parameters do not grow with the number of steps
    n2 = sum(p.numel() for p in ut.parameters())
    assert n2 == sum(p.numel() for p in UniversalSeq2Seq(universal(n_steps=5)).parameters())


@pytest.mark.parametrize("cfg", [vanilla(**PAPER), universal(**PAPER)], ids=["transformer", "ut"])
def test_paper_block_on_both_sides(cfg):
    """ReLU FFN, LayerNorm (gain + bias) at every norm site incl. the two final norms,
    biases on every attention/FFN projection, no RoPE, one embedding for src/tgt/softmax."""
    from torch import nn

    from phaseloop.layers import ReLUFFN

    m = build_seq2seq(cfg)
    blocks = [mod for mod in m.modules() if hasattr(mod, "ffn_norm")]
    assert blocks and all(isinstance(b.ffn, ReLUFFN) for b in blocks)
    assert all(not mod.use_rope for b in blocks for mod in (b.attn, b.cross_attn) if mod is not None)
    assert isinstance(m.enc_norm, nn.LayerNorm) and isinstance(m.dec_norm, nn.LayerNorm)
    assert not any(type(mod).__name__ == "RMSNorm" for mod in m.modules())
    linears = [mod for b in blocks for mod in b.modules() if isinstance(mod, nn.Linear)]
    assert linears and all(mod.bias is not None for mod in linears)
    assert m.head.weight is m.embed.tok.weight and m.head.bias is None
    src, tgt_in, targets = collate(copy_pairs(2, random.Random(0)))
    assert torch.isfinite(m(src, tgt_in, targets).loss)


def test_collate():
    src, tgt_in, targets = collate([([3, 4, 5], [6]), ([7], [8, 9])])
    assert src.tolist() == [[3, 4, 5], [7, PAD, PAD]]
    assert tgt_in.tolist() == [[BOS, 6, PAD], [BOS, 8, 9]]
    assert targets.tolist() == [[6, EOS, -100], [8, 9, EOS]]


def _models():
    torch.manual_seed(0)
    act = UniversalSeq2Seq(universal(act=True))
    spread(act.encoder)
    spread(act.decoder)
    paper_act = UniversalSeq2Seq(universal(act=True, **PAPER))
    spread(paper_act.encoder)
    spread(paper_act.decoder)
    return [TransformerSeq2Seq(vanilla()), UniversalSeq2Seq(universal()), act,
            UniversalSeq2Seq(universal(act=True), encoder_act=False),
            TransformerSeq2Seq(vanilla(**PAPER)), UniversalSeq2Seq(universal(**PAPER)), paper_act]


@pytest.mark.parametrize("i", range(7))
def test_cached_decoding_equals_teacher_forcing(i):
    m = _models()[i].double().eval()
    src, tgt_in, _ = collate(copy_pairs(3, random.Random(i), max_len=7))
    full = m(src, tgt_in)
    memory = m.encode(src)
    cache = KVCache()
    pieces = [m(src, tgt_in[:, :2], cache=cache, memory=memory).logits]
    pieces += [m(src, tgt_in[:, t: t + 1], cache=cache, memory=memory).logits
               for t in range(2, tgt_in.shape[1])]
    assert torch.allclose(torch.cat(pieces, 1), full.logits, atol=1e-10, rtol=0)
    # decoder is causal: changing a later target token leaves earlier logits alone
    t2 = tgt_in.clone()
    t2[:, -1] = (t2[:, -1] + 1) % 12
    assert torch.allclose(m(src, t2).logits[:, :-1], full.logits[:, :-1], atol=1e-10, rtol=0)


def test_source_padding_is_masked():
    m = UniversalSeq2Seq(universal(act=True)).double().eval()
    spread(m.encoder)
    src, tgt_in, _ = collate([([3, 4, 5], [3, 4, 5]), ([6, 7], [6, 7])])
    a = m(src, tgt_in)
    padded = torch.cat([src, torch.full((2, 3), PAD)], 1)
    b = m(padded, tgt_in)
    assert torch.allclose(a.logits, b.logits, atol=1e-10, rtol=0)
    mem_a, _ = m.encode(src)
    mem_b, _ = m.encode(padded)
    assert torch.allclose(mem_a.x_BSD[0], mem_b.x_BSD[0, :3], atol=1e-10, rtol=0)  # real positions unchanged
    assert torch.allclose(mem_a.x_BSD[1, :2], mem_b.x_BSD[1, :2], atol=1e-10, rtol=0)


def test_act_on_either_side():
    src, tgt_in, targets = collate(copy_pairs(4, random.Random(0)))
    both = UniversalSeq2Seq(universal(act=True))(src, tgt_in, targets)
    assert set(both.aux_losses) == {"encoder_ponder_loss", "decoder_ponder_loss"}
    assert both.stats["encoder_ponder_time"].shape == src.shape
    assert both.stats["decoder_ponder_time"].shape == tgt_in.shape
    assert torch.allclose(both.loss, both.ce_loss + sum(both.aux_losses.values()))
    enc_only = UniversalSeq2Seq(universal(), encoder_act=True)(src, tgt_in, targets)
    assert set(enc_only.aux_losses) == {"encoder_ponder_loss"}
    dec_only = UniversalSeq2Seq(universal(act=True, act_type="accumulated"), encoder_act=False)
    assert dec_only.encoder.halting is None and dec_only.decoder.cfg.act_type == "accumulated"


def greedy_decode(m, src, max_len, use_cache=True):
    return until_eos(m.generate(src, max_len, use_cache=use_cache).tolist(), EOS)


def test_depth_extrapolation_and_greedy_cache():
    m = UniversalSeq2Seq(universal())
    src, _, _ = collate(copy_pairs(3, random.Random(1)))
    a = greedy_decode(m, src, 6, use_cache=True)
    assert a == greedy_decode(m, src, 6, use_cache=False)
    m.set_steps(5)
    assert m.encoder.steps == m.decoder.steps == 5
    assert greedy_decode(m, src, 6) == greedy_decode(m, src, 6, use_cache=False)


def test_generate_equals_stepwise_argmax_of_teacher_forcing():
    """The one decoding loop: greedy generation with the cache equals feeding the growing
    target through the uncached model and taking the argmax, token for token."""
    torch.manual_seed(3)
    m = UniversalSeq2Seq(universal(act=True)).double().eval()
    spread(m.decoder)
    src, _, _ = collate(copy_pairs(2, random.Random(5)))
    got = m.generate(src, 5)
    tgt = torch.full((2, 1), BOS)
    for _ in range(5):
        tgt = torch.cat([tgt, m(src, tgt).logits[:, -1:].argmax(-1)], 1)
    n = got.shape[1]
    assert torch.equal(got, tgt[:, 1:n + 1])


@pytest.mark.parametrize("cfg,arch", [(vanilla(), "transformer-seq2seq"),
                                      (universal(act=True), "universal-seq2seq")],
                         ids=["transformer", "ut-act"])
def test_copy_task_trains_to_zero_loss(cfg, arch):
    """Through the one training engine (tasks.task_model.train_pairs): targets end in EOS."""
    pairs = [(s, t + [EOS]) for s, t in copy_pairs(400 * 32, random.Random(0))]
    tc = task_train_config(steps=400, batch_size=32, lr=1e-2, warmup_steps=20, weight_decay=0.0,
                           beta2=0.95, log_every=10)
    trainer = train_pairs(cfg, pairs, tc, arch)
    losses = [r["loss"] for r in trainer.records]
    assert min(losses) < 0.005 and losses[-1] < 0.005, losses[-5:]
    test = copy_pairs(64, random.Random(123))
    src, _, _ = collate(test)
    decoded = greedy_decode(trainer.model, src, 8)
    assert sum(d == list(t) for d, (_, t) in zip(decoded, test)) / len(test) >= 0.95
