"""Parallel blocks (Wang & Komatsuzaki, GPT-J, 2021; Chowdhery et al., PaLM §2, 2022):
attention and FFN read the same input and their outputs are added together,

    x <- x + Attn(N1(x)) + FFN(N2(x))

instead of the sequential x <- x + Attn(N1(x)); x <- x + FFN(N2(x)). The first
``sequential_layers`` layers stay sequential. A phaseloop architecture in one file: an
option group, a trunk built from the shared block's branches, and one ``ArchSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from phaseloop.config import ModelConfig, fail
from phaseloop.layers import Block, Context
from phaseloop.registry import ArchSpec, register_arch
from phaseloop.trunk import Trunk


@dataclass
class ParallelOptions:
    sequential_layers: int = 0  # the first k layers are ordinary sequential blocks

    def validate(self, cfg: ModelConfig) -> None:
        if not 0 <= self.sequential_layers <= cfg.n_layers:
            fail("sequential_layers", self.sequential_layers, f"must be in [0, n_layers={cfg.n_layers}]")


class ParallelStack(Trunk):
    """n_layers blocks; layer i uses KV-cache slot i."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg, i, cfg.n_layers) for i in range(cfg.n_layers))
        self.sequential = cfg.sequential_layers
        self.depth = cfg.n_layers

    def forward(self, x_BTD: torch.Tensor, ctx: Context) -> torch.Tensor:
        for i, blk in enumerate(self.layers):
            if i < self.sequential:
                x_BTD = blk(x_BTD, ctx, slot=i)
            else:  # both branches read x (a 3PT rotation, if switched on, acts on the sum)
                x_BTD = blk.between(x_BTD + blk.attn_branch(x_BTD, ctx, i) + blk.ffn_branch(x_BTD))
        return x_BTD

    def cache_slots(self) -> list:
        return list(range(len(self.layers)))


SPEC = register_arch(ArchSpec(
    name="parallel",
    trunk=ParallelStack,
    options=(ParallelOptions,),
    paper="Wang & Komatsuzaki, GPT-J-6B (2021); Chowdhery et al., PaLM (2022) §2",
    aliases=("gptj",),
    presets={
        "parallel-tiny": dict(d_model=96, n_layers=2, n_heads=6, n_kv_heads=3, d_ff=256,
                              vocab_size=256, max_seq_len=64),
        "parallel-small": dict(d_model=192, n_layers=4, n_heads=6, n_kv_heads=3, d_ff=512,
                               vocab_size=256, max_seq_len=128),
    },
))
