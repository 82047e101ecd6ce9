"""The Llama-style "RoPE-only" decoder (the baseline of every paper here): a plain stack
of the shared pre-norm blocks (``model.Stack``), RMSNorm, SwiGLU, RoPE, GQA. Nothing is
new about it, so this file is only its registration: presets, the names recipes use,
and its encoder-decoder for task runs (``seq2seq.TransformerSeq2Seq``)."""

from __future__ import annotations

from phaseloop.archs import paper_scales
from phaseloop.archs.seq2seq import TransformerSeq2Seq
from phaseloop.model import Stack
from phaseloop.registry import ArchSpec, register_arch

# The 3PT paper's baselines (its table of configurations): the author's code multiplies a
# default-initialised N(0, 1) embedding by sqrt(d_model).
_PAPER_BASELINE = dict(tie_embeddings=False, embed_scale=True, embed_init_std=1.0)


def _seq2seq_defaults(d_model: int) -> dict:
    # the UT presets' embedding scale (sqrt(d) * N(0, 1/d)): the sinusoid added at the
    # embedding would otherwise drown 0.02-std embeddings
    return {"embed_scale": True, "embed_init_std": d_model ** -0.5}


# The Hyperloop paper's Transformer at each of its scales (paper_scales.py), its CPU twins
# at matched depth 8 and a tiny test model.
_TRANSFORMERS = {f"transformer-{names[0]}": dict(paper_scales.base(d), n_layers=paper_scales.stack_depth(split))
                 for d, split, names in paper_scales.SCALES}
_TRANSFORMERS["transformer-240m"] = _TRANSFORMERS[f"transformer-{paper_scales.ALIAS_240M['transformer']}"]
_TRANSFORMERS.update({"transformer-small": dict(paper_scales.SMALL, n_layers=8),
                      "transformer-tiny": dict(paper_scales.TINY, n_layers=4)})

SPEC = register_arch(ArchSpec(
    name="rope",
    trunk=Stack,
    default=True,
    default_preset="rope-small",
    paper="Touvron et al., LLaMA (2023); the baseline of the 3PT, UT and Hyperloop papers",
    aliases=("transformer",),
    modifiers={"paper": {"embed_scale": True, "embed_init_std": 1.0}},  # the 3PT paper's baseline
    seq2seq=TransformerSeq2Seq,
    seq2seq_name="transformer-seq2seq",
    seq2seq_defaults=_seq2seq_defaults,
    presets={
        "rope-123m": dict(_PAPER_BASELINE, d_model=768, n_layers=12, n_heads=12, n_kv_heads=3,
                          d_ff=2048, vocab_size=32000, max_seq_len=1024),
        "rope-5.5m": dict(_PAPER_BASELINE, d_model=192, n_layers=4, n_heads=6, n_kv_heads=3,
                          d_ff=512, vocab_size=10000, max_seq_len=128),
        # Small byte-level presets for CPU runs.
        "rope-tiny": dict(d_model=96, n_layers=2, n_heads=6, n_kv_heads=3, d_ff=256,
                          vocab_size=256, max_seq_len=64),
        "rope-small": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=3, d_ff=512,
                           vocab_size=256, max_seq_len=128),
        **_TRANSFORMERS,
    },
))
