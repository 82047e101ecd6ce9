"""UT §3 accounting (accounting.py): closed forms checked against torch.nn.Transformer,
the known totals, FLOPs scaling with steps, the width solver and the CLI."""

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from phaseloop.analysis import accounting as acc
from phaseloop.cli import main


def torch_params(spec: acc.EncDecSpec) -> int:
    """The same model built from torch.nn modules (biases everywhere, LayerNorm with gain
    and bias, 2/3 norms per encoder/decoder layer, a final norm per stack)."""
    d, f = spec.d_model, spec.d_ff
    with torch.device("meta"):
        if spec.shared:
            parts = [nn.TransformerEncoderLayer(d, spec.n_heads, f),
                     nn.TransformerDecoderLayer(d, spec.n_heads, f), nn.LayerNorm(d), nn.LayerNorm(d)]
        else:
            parts = [nn.Transformer(d, spec.n_heads, spec.enc_layers, spec.dec_layers, f,
                                    batch_first=True)]
        parts.append(nn.Embedding(spec.vocab_size, d))  # shared by src, tgt and softmax
    return sum(p.numel() for m in parts for p in m.parameters())


@pytest.mark.parametrize("name", list(acc.PRESETS))
def test_params_match_torch_modules(name):
    spec = acc.PRESETS[name]
    r = acc.count(spec)
    assert r["total"] == torch_params(spec)
    assert r["embedding"] == 37000 * spec.d_model and r["unembedding"] == 0
    assert r["non_embedding"] == r["total"] - r["embedding"]
    assert r["steps"] == 6


def test_known_totals():
    got = {n: acc.count(s)["total"] for n, s in acc.PRESETS.items()}
    assert got == {"transformer-base": 63_084_544, "transformer-big": 214_249_472,
                   "ut-small": 26_302_464, "ut-base": 67_284_992}


def test_flops_match_flop_counter_on_torch_transformer():
    """Forward matmul FLOPs of torch's nn.Transformer (n source + n target tokens) + the
    output projection, divided by n, equal the closed form (which ignores biases/norms).
    The counter does not see nn.MultiheadAttention's fused CPU attention kernel, so the
    attention products (4 n d per attention: 2 encoder, 3 + 3 decoder) are added here."""
    d, h, V, n = 32, 4, 100, 16
    spec = acc.EncDecSpec("t", d, h, 2, 3, steps=2, vocab_size=V)
    model = nn.Transformer(d, h, 2, 3, 4 * d, dropout=0.0, batch_first=True)
    out_proj = nn.Linear(d, V, bias=False)
    src, tgt = torch.randn(1, n, d), torch.randn(1, n, d)
    mask = nn.Transformer.generate_square_subsequent_mask(n)
    with FlopCounterMode(display=False) as fc:
        out_proj(model(src, tgt, tgt_mask=mask))
    attention = (2 + 2 * 3) * 4 * n * d
    assert fc.get_total_flops() / n + attention == acc.count(spec, seq_len=n)["flops_per_token"]


def test_flops_scale_with_steps_and_width():
    small = acc.PRESETS["ut-small"]
    f6 = acc.count(small)["flops_per_token"]
    f12 = acc.count(acc.EncDecSpec("x", 512, 8, shared=True, steps=12))["flops_per_token"]
    head = 2 * 37000 * 512
    assert f12 - head == 2 * (f6 - head)
    # the paper's point: UT small costs Transformer base's compute with 0.42x the parameters,
    # UT base costs Transformer big's compute with about Transformer base's parameters
    rows = {n: acc.count(s) for n, s in acc.PRESETS.items()}
    assert rows["ut-small"]["flops_per_token"] == rows["transformer-base"]["flops_per_token"]
    assert rows["ut-base"]["flops_per_token"] == rows["transformer-big"]["flops_per_token"]
    assert rows["ut-small"]["total"] == acc.count(acc.EncDecSpec("y", 512, 8, shared=True, steps=2))["total"]


def test_width_solver():
    target = acc.count(acc.PRESETS["transformer-base"])["total"]
    d = acc.solve_width(target, shared=True)
    # closed form: 28 d^2 + (V + 36) d = P
    assert math.isclose(28 * d * d + (37000 + 36) * d, target, rel_tol=1e-12)
    assert 978 < d < 980
    res = acc.match("transformer-base", shared=True)
    assert res["d"] == 979 and res["model"]["shared"]
    assert abs(res["model"]["total"] - target) / target < 2e-4
    # the solver reproduces an untied preset's own width
    assert math.isclose(acc.solve_width(target, shared=False), 512, rel_tol=1e-9)
    assert acc.match("transformer-big", shared=False)["d"] == 1024


def test_cli_presets_json_and_table(capsys):
    assert main(["params", "--preset", "ut-base", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for k in ("total", "embedding", "unembedding", "non_embedding", "flops_per_token", "steps"):
        assert isinstance(r[k], int)
    assert r["total"] == 67_284_992 and r["steps"] == 6
    assert main(["params", "--preset", "transformer-base"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in acc.PRESETS) and "params/ref" in out


def test_cli_match(capsys):
    assert main(["params", "--match", "transformer-base", "--shared", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["d"] == 979 and r["target_total"] == 63_084_544
    assert main(["params", "--match", "transformer-base", "--shared"]) == 0
    out = capsys.readouterr().out
    assert "d = 979" in out and "shared-d979" in out
    b = r["buildable"]  # 979 is the count the explainer checks; 8 heads divide 976, which builds
    assert (b["d"], b["n_heads"]) == (976, 8) and "8 heads need a width they divide: d = 976" in out
    assert acc.count_built(acc.EncDecSpec(**b["spec"]), flops=False)["built_total"] == b["model"]["total"]
    big = acc.match("transformer-big", shared=True)["buildable"]
    assert big["d"] % 16 == 0 and abs(big["d"] - acc.match("transformer-big", shared=True)["d_exact"]) <= 8
    assert main(["params", "--shared"]) == 2
    assert main(["params", "--match", "nope", "--shared"]) == 2
    assert "unknown accounting preset" in capsys.readouterr().err


# ---------------------------------------------------------------------------- built models
TABLE = {"transformer-base": 63_084_544, "transformer-big": 214_249_472,
         "ut-small": 26_302_464, "ut-base": 67_284_992}


@pytest.mark.parametrize("name", list(TABLE))
def test_built_counts_equal_the_table(name):
    """The presets built with the seq2seq classes (meta device, faithful options) have
    exactly the closed-form parameter counts."""
    from phaseloop.models import TransformerSeq2Seq, UniversalSeq2Seq

    spec = acc.PRESETS[name]
    cfg = spec.config()
    assert (cfg.ffn, cfg.norm, cfg.bias, cfg.use_rope, cfg.tie_embeddings, cfg.act) == \
        ("relu", "layer", True, False, True, False)
    assert (cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.vocab_size) == (spec.d_model, spec.n_heads, 4 * spec.d_model, 37000)
    model = acc.build(spec)
    assert isinstance(model, UniversalSeq2Seq if spec.shared else TransformerSeq2Seq)
    assert all(p.is_meta for p in model.parameters())
    built = acc.count_built(spec, flops=False)
    assert built["built_total"] == TABLE[name] == acc.count(spec)["total"]
    # the output projection is the embedding; the sinusoid step signal adds no parameter
    assert model.head.weight is model.embed.tok.weight and model.head.bias is None


@pytest.mark.parametrize("name", ["transformer-base", "ut-small"])
def test_built_flops_match_the_closed_form(name):
    """FlopCounterMode on the built meta model. A stack matches the closed form exactly;
    the shared UT decoder projects the encoder's keys/values for cross-attention once
    (Memory.kv) instead of at each of its T steps: (T - 1) * 2 * (2 d^2) FLOPs fewer."""
    spec, n = acc.PRESETS[name], 16
    closed = acc.count(spec, seq_len=n)["flops_per_token"]
    built = acc.count_built(spec, seq_len=n)["built_flops_per_token"]
    saved = (spec.steps - 1) * 4 * spec.d_model ** 2 if spec.shared else 0
    assert built == closed - saved


def test_cli_built(capsys):
    assert main(["params", "--preset", "ut-base", "--built", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["built_total"] == r["total"] == 67_284_992 and r["built_equals_closed_form"]
    assert r["built_class"] == "UniversalSeq2Seq" and isinstance(r["built_flops_per_token"], int)
    assert main(["params", "--preset", "transformer-base", "--built", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "transformer-base built (TransformerSeq2Seq, meta device): 63,084,544 parameters; " \
           "closed form 63,084,544 (equal)" in out
    assert main(["params", "--preset", "rope-tiny", "--built"]) == 2
    assert main(["params", "--match", "transformer-base", "--shared", "--built"]) == 2
    assert "--built" in capsys.readouterr().err


def test_spec_config_refuses_unequal_stacks():
    with pytest.raises(acc.ConfigError, match="enc_layers"):
        acc.EncDecSpec("x", 64, 4, 2, 3).config()


def test_free_d_ff_counts_match_torch_modules_and_the_built_model():
    """``ffn_dim`` frees d_ff (the explore calculator's input): the closed form still
    equals torch's modules and phaseloop's built model."""
    for spec in (acc.EncDecSpec("t", 64, 4, 2, 2, vocab_size=100, ffn_dim=96),
                 acc.EncDecSpec("u", 64, 4, shared=True, steps=3, vocab_size=100, ffn_dim=320)):
        assert spec.d_ff == spec.ffn_dim
        assert acc.count(spec)["total"] == torch_params(spec) == \
            acc.count_built(spec, flops=False)["built_total"]
    assert acc.EncDecSpec("t", 64, 4).d_ff == 256


def test_layer_matmul_flops_are_the_4x_convention():
    """UT base costs "exactly 4x" base in the layers' weight matrices alone (0.0881 vs
    0.3523 GFLOP/token); with attention over 256 keys and the softmax: 3.30x."""
    base, ut = acc.count(acc.PRESETS["transformer-base"]), acc.count(acc.PRESETS["ut-base"])
    # per layer application, 2 FLOPs per multiply-add: encoder 4d^2 + 2 d d_ff = 12 d^2,
    # decoder 8d^2 + 2 d d_ff = 16 d^2; 6 of each
    assert base["layer_matmul_flops_per_token"] == 6 * 2 * (12 + 16) * 512**2 == 88_080_384
    assert round(base["layer_matmul_flops_per_token"] / 1e9, 4) == 0.0881
    assert round(ut["layer_matmul_flops_per_token"] / 1e9, 4) == 0.3523
    assert ut["layer_matmul_flops_per_token"] == 4 * base["layer_matmul_flops_per_token"]
    assert round(ut["flops_per_token"] / base["flops_per_token"], 2) == 3.30


def test_without_input_embedding_keeps_an_untied_head():
    """The Hyperloop paper's count: the total less the input embedding only; an untied
    head is counted."""
    from phaseloop.analysis.params import count_params
    from phaseloop.config import ModelConfig

    c = count_params(ModelConfig(arch="rope", vocab_size=256, d_model=64, n_heads=4, n_layers=2, d_ff=128,
                                 max_seq_len=32, tie_embeddings=False))
    assert c["unembedding"] == c["embedding"] == 256 * 64
    assert c["without_input_embedding"] == c["non_embedding"] + c["unembedding"] == c["total"] - 256 * 64
