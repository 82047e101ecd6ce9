"""Parameter and compute accounting of the Universal Transformer paper's §3 comparison
(Dehghani et al. 2019), with tensor2tensor's conventions for encoder-decoder models:

* one embedding matrix (vocabulary 37,000) shared by source, target and the output
  projection (so ``unembedding`` is 0 and ``embedding`` is V*d);
* biases on every attention projection (q, k, v, o) and FFN projection; d_ff = 4d
  (``ffn_dim`` sets another);
* LayerNorm (gain + bias) before each sub-layer: 2 per encoder layer, 3 per decoder
  layer, plus one final LayerNorm per stack;
* a weight-tied ("shared") model has one encoder layer and one decoder layer applied
  ``steps`` times; the sinusoid coordinate signal has no parameters (no ACT unit).

FLOPs per token: forward pass, 2 per multiply-add, matmuls only (biases, norms and
softmax ignored), for one source token plus one target token: every layer application
on each side, attention score/value products over ``seq_len`` keys (full context,
Kaplan et al. 2020 convention: 4*n*d per attention), and the output projection 2*V*d.
These are closed forms, checked against ``torch.nn.Transformer`` in the tests, and the
presets are also *buildable*: ``EncDecSpec.config()`` is the ModelConfig of the same
model in this library (ReLU FFN, LayerNorm, biases, no RoPE, tied embedding and softmax)
and ``count_built`` builds it with the ``seq2seq`` classes on the meta device and counts
its parameters (and its forward FLOPs with torch's FlopCounterMode).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from phaseloop.archs.seq2seq import build_seq2seq
from phaseloop.config import ModelConfig
from phaseloop.errors import ConfigError

T2T_VOCAB = 37000
DEFAULT_SEQ_LEN = 256  # tensor2tensor's max_length for WMT


@dataclass(frozen=True)
class EncDecSpec:
    """An encoder-decoder counted with tensor2tensor conventions. ``enc_layers``/
    ``dec_layers`` are distinct layers for a stack; with ``shared`` there is one layer
    per side applied ``steps`` times."""

    name: str
    d_model: int
    n_heads: int
    enc_layers: int = 6
    dec_layers: int = 6
    shared: bool = False
    steps: int = 6
    vocab_size: int = T2T_VOCAB
    ffn_dim: int | None = None  # d_ff; None: 4d, as every published model here

    @property
    def d_ff(self) -> int:
        return 4 * self.d_model if self.ffn_dim is None else self.ffn_dim

    @property
    def unique(self) -> tuple[int, int]:
        return (1, 1) if self.shared else (self.enc_layers, self.dec_layers)

    @property
    def applications(self) -> tuple[int, int]:
        return (self.steps, self.steps) if self.shared else (self.enc_layers, self.dec_layers)

    def config(self, **overrides):
        """The ModelConfig of this model in phaseloop (for ``seq2seq.build_seq2seq``): the
        published block (ReLU FFN with d_ff = 4d, biases, LayerNorm, sinusoids only), one
        embedding shared by source, target and softmax, scaled by sqrt(d) on input; a
        shared model is ``arch="universal"`` with a sinusoid step signal and no ACT."""

        if not self.shared and self.enc_layers != self.dec_layers:
            raise ConfigError(f"{self.name}: TransformerSeq2Seq builds n_layers encoder and "
                              f"n_layers decoder layers; enc_layers={self.enc_layers} != "
                              f"dec_layers={self.dec_layers}")
        d = self.d_model
        kw = dict(vocab_size=self.vocab_size, d_model=d, n_heads=self.n_heads, d_ff=self.d_ff,
                  max_seq_len=DEFAULT_SEQ_LEN, ffn="relu", norm="layer", bias=True,
                  use_rope=False, tie_embeddings=True, embed_scale=True, embed_init_std=d ** -0.5)
        if self.shared:
            kw.update(arch="universal", n_layers=1, n_steps=self.steps)
        else:
            kw.update(arch="rope", n_layers=self.enc_layers)
        return ModelConfig(**{**kw, **overrides})


PRESETS: dict[str, EncDecSpec] = {
    "transformer-base": EncDecSpec("transformer-base", 512, 8, 6, 6, steps=6),
    "transformer-big": EncDecSpec("transformer-big", 1024, 16, 6, 6, steps=6),
    "ut-small": EncDecSpec("ut-small", 512, 8, shared=True, steps=6),
    "ut-base": EncDecSpec("ut-base", 1024, 16, shared=True, steps=6),
}


def encoder_layer_params(d: int, d_ff: int) -> int:
    """Self-attention 4(d^2 + d) + FFN (2 d d_ff + d_ff + d) + 2 LayerNorms (2d each)."""
    return 4 * (d * d + d) + (2 * d * d_ff + d_ff + d) + 2 * 2 * d


def decoder_layer_params(d: int, d_ff: int) -> int:
    """Self- and cross-attention 8(d^2 + d) + FFN + 3 LayerNorms."""
    return 8 * (d * d + d) + (2 * d * d_ff + d_ff + d) + 3 * 2 * d


def count(spec: EncDecSpec, seq_len: int = DEFAULT_SEQ_LEN) -> dict:
    """The JSON fields of ``phaseloop params`` (total, embedding, unembedding,
    non_embedding, flops_per_token) plus ``steps`` and the shape of the model."""
    d, f, V = spec.d_model, spec.d_ff, spec.vocab_size
    ue, ud = spec.unique
    ae, ad = spec.applications
    embedding = V * d
    layers = ue * encoder_layer_params(d, f) + ud * decoder_layer_params(d, f)
    total = embedding + layers + 2 * 2 * d  # + final LayerNorm of each stack
    enc_flops = 2 * (4 * d * d + 2 * d * f) + 4 * seq_len * d
    dec_flops = 2 * (8 * d * d + 2 * d * f) + 2 * 4 * seq_len * d
    flops = ae * enc_flops + ad * dec_flops + 2 * V * d
    # the layers' weight matrices alone (no attention scores/values, no softmax): the
    # convention under which UT base costs "exactly 4x" base (explainer §3)
    layer_matmuls = ae * 2 * (4 * d * d + 2 * d * f) + ad * 2 * (8 * d * d + 2 * d * f)
    return {"preset": spec.name, "arch": "ut-encdec" if spec.shared else "transformer-encdec",
            "total": total, "embedding": embedding, "unembedding": 0,
            "non_embedding": total - embedding, "flops_per_token": flops,
            "layer_matmul_flops_per_token": layer_matmuls, "steps": spec.steps,
            "shared": spec.shared, "d_model": d, "d_ff": f, "n_heads": spec.n_heads,
            "enc_layers": ue, "dec_layers": ud, "vocab_size": V, "seq_len": seq_len}


def build(spec: EncDecSpec, device="meta"):
    """The encoder-decoder of ``spec`` (UniversalSeq2Seq for a shared model, else
    TransformerSeq2Seq); on the meta device by default, allocating no weights."""

    with torch.device(device):
        return build_seq2seq(spec.config())


def count_built(spec: EncDecSpec, seq_len: int = DEFAULT_SEQ_LEN, flops: bool = True) -> dict:
    """Parameters of the built model (``build``; a tied matrix counted once) and, with
    ``flops``, its forward FLOPs per token measured by FlopCounterMode on meta tensors:
    ``seq_len`` source and ``seq_len`` target tokens, divided by ``seq_len`` (the same
    convention as ``count``: one source plus one target token, attention over
    ``seq_len`` keys)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build(spec, "meta")
    out = {"built_total": int(sum(p.numel() for p in model.parameters())),
           "built_class": type(model).__name__}
    if flops:
        src_BS = torch.full((1, seq_len), 3, dtype=torch.long, device="meta")
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(src_BS, src_BS, src_mask_BS=torch.ones(1, seq_len, dtype=torch.bool, device="meta"))
        out["built_flops_per_token"] = int(fc.get_total_flops() // seq_len)
    return out


def solve_width(target_params: int, shared: bool = True, enc_layers: int = 6, dec_layers: int = 6,
                vocab_size: int = T2T_VOCAB) -> float:
    """Real d (d_ff = 4d) at which the model has ``target_params`` parameters:
    V d + Le (12 d^2 + 13 d) + Ld (16 d^2 + 19 d) + 4 d = P, solved for d > 0."""
    le, ld = (1, 1) if shared else (enc_layers, dec_layers)
    a = 12 * le + 16 * ld
    b = vocab_size + 13 * le + 19 * ld + 4
    return (-b + math.sqrt(b * b + 4 * a * target_params)) / (2 * a)


def match(target: str, shared: bool = True, seq_len: int = DEFAULT_SEQ_LEN) -> dict:
    """Width of a (weight-tied) encoder-decoder with the parameter count of ``target``;
    returns the exact d, the nearest integer d and the counts of that model (the UT
    explainer's 978.9 -> 979), and the nearest width its heads divide (``buildable``: the
    model that can be built, e.g. 976 for 8 heads)."""
    ref = get(target)
    want = count(ref, seq_len)["total"]
    d_exact = solve_width(want, shared, ref.enc_layers, ref.dec_layers, ref.vocab_size)

    def at(d: int) -> EncDecSpec:
        return replace(ref, name=f"{'shared' if shared else 'stack'}-d{d}", d_model=d, shared=shared)
    d = max(1, round(d_exact))
    h = ref.n_heads
    d_built = max(h, h * round(d_exact / h))
    spec = at(d)
    return {"target": target, "target_total": want, "shared": shared, "d_exact": d_exact,
            "d": d, "model": count(spec, seq_len), "spec": asdict(spec),
            "buildable": {"d": d_built, "n_heads": h, "model": count(at(d_built), seq_len),
                          "spec": asdict(at(d_built))}}


def get(name: str) -> EncDecSpec:
    if name not in PRESETS:
        raise ConfigError(f"unknown accounting preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]


def table(rows: list[dict], reference: dict) -> str:
    """Side-by-side table: parameters, FLOPs per token and ratios to ``reference``."""
    lines = [f"{'model':<18}{'d':>6}{'layers':>9}{'steps':>7}{'params':>10}{'GFLOP/tok':>11}"
             f"{'params/ref':>12}{'FLOPs/ref':>11}"]
    for r in rows:
        layers = "1+1 tied" if r["shared"] else f"{r['enc_layers']}+{r['dec_layers']}"
        lines.append(f"{r['preset']:<18}{r['d_model']:>6}{layers:>9}{r['steps']:>7}"
                     f"{r['total'] / 1e6:>9.1f}M{r['flops_per_token'] / 1e9:>11.3f}"
                     f"{r['total'] / reference['total']:>12.2f}"
                     f"{r['flops_per_token'] / reference['flops_per_token']:>11.2f}")
    lines.append(f"(tensor2tensor conventions, vocab {reference['vocab_size']} shared; FLOPs: forward, "
                 f"one source + one target token, attention over {reference['seq_len']} keys; "
                 f"ratios to {reference['preset']})")
    return "\n".join(lines)
