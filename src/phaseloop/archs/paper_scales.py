"""The Hyperloop paper's model scales (Zeitoun et al., arXiv 2604.21254, Table 1), which
its four models share: the Transformer (``rope.py``), mHC, the Looped and the Hyperloop
Transformer (``hyperloop.py``); and their byte-level CPU twins. Each architecture file
registers its own presets from these tables."""

from __future__ import annotations

SCALES = (  # d, (begin, middle, end), names: transformer, mhc, looped and hyperloop
    (1024, (2, 4, 2), ("238m", "241m", "135m")),  # depth 16
    (2048, (3, 4, 3), ("990m", "997m", "579m")),  # depth 18
    (2048, (4, 10, 4), ("2018m", "2033m", "990m")),  # depth 38
)
LOOPS = 3  # the paper's middle block runs 3 times
# the first scale's earlier names, kept while benchmarks/ and README.md use them
ALIAS_240M = {"transformer": "238m", "mhc": "241m", "looped": "135m", "hyperloop": "135m"}
# Byte-level CPU twins at matched depth 8 (looped: 1 -> 2 x 3 -> 1) and tiny test models.
SMALL = dict(d_model=128, n_heads=4, n_kv_heads=4, d_ff=352, vocab_size=256, max_seq_len=128,
             embed_scale=False, tie_embeddings=False)
TINY = dict(SMALL, d_model=64, d_ff=176, max_seq_len=64)


def base(d: int) -> dict:
    """The fields every model at width ``d`` shares (Llama-style, 16 heads, d_ff = 2.75 d)."""
    return dict(d_model=d, n_heads=16, n_kv_heads=16, d_ff=int(2.75 * d), vocab_size=32000,
                max_seq_len=2048, rope_base=10000.0, tie_embeddings=False, embed_scale=False,
                embed_init_std=0.02, init_std=0.02)


def stack_depth(split: tuple[int, int, int]) -> int:
    """The layers of the non-looped models at a scale: begin + LOOPS x middle + end."""
    b, m, e = split
    return b + LOOPS * m + e
