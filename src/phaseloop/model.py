"""The shared decoder skeleton: embedding -> trunk -> final norm -> head.

Every architecture is a *trunk* (how the blocks are applied) plus options of the shared
block and embedding; see ``TRUNKS``. The skeleton owns the KV cache, RoPE tables,
the loss and generation, so no architecture re-implements them.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Block, Context, KVCache, init_weights, make_norm, rope_tables


class Stack(nn.Module):
    """A plain stack of distinct blocks (Llama baseline and 3PT)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg, i, cfg.n_layers) for i in range(cfg.n_layers))
        self.depth = cfg.n_layers  # residual layers applied per token, for init scaling

    def forward(self, x_BTD: torch.Tensor, ctx: Context) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x_BTD = layer(x_BTD, ctx, slot=i)
        return x_BTD


# arch -> "module:Class" of its trunk; modules are imported on first use.
TRUNKS: dict[str, str] = {
    "rope": "phaseloop.model:Stack",
    "three_phase": "phaseloop.model:Stack",
    "looped": "phaseloop.hyperloop:Looped",
    "hyperloop": "phaseloop.hyperloop:Hyperloop",
    "universal": "phaseloop.universal:UniversalTrunk",
    "mhc": "phaseloop.hyperloop:MHC",
}


def _trunk_class(arch: str):
    mod, _, name = TRUNKS[arch].partition(":")
    return getattr(importlib.import_module(mod), name)


class TokenEmbedding(nn.Module):
    """Token embedding, optional sqrt(d_model) scale, optional 3PT horn DC injection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0
        self.horn: nn.Module | None = None
        if cfg.horn:
            from .three_phase import HornInjection

            self.horn = HornInjection(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx_BT: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        x_BTD = self.tok(idx_BT)
        if self.scale != 1.0:
            x_BTD = x_BTD * self.scale
        if self.horn is not None:
            x_BTD = self.horn(x_BTD, start_pos)
        return self.drop(x_BTD)


@dataclass
class ModelOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None  # cross-entropy + auxiliary losses
    ce_loss: torch.Tensor | None = None
    aux_losses: dict = field(default_factory=dict)  # e.g. ACT ponder loss, logged apart
    stats: dict = field(default_factory=dict)  # e.g. per-position ponder times


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg)
        self.trunk = _trunk_class(cfg.arch)(cfg)
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg, getattr(self.trunk, "depth", cfg.n_layers))
        nn.init.normal_(self.embed.tok.weight, 0.0, cfg.embed_init_std)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.tok.weight

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                cache: KVCache | None = None) -> ModelOutput:
        """Targets equal to -100 are ignored (e.g. prompt tokens of a task)."""
        T = idx_BT.shape[1]
        start = cache.pos if cache is not None else 0
        positions = torch.arange(start, start + T, device=idx_BT.device)
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_base)
        ctx = Context(cos=cos, sin=sin, start_pos=start, cache=cache)
        x_BTD = self.trunk(self.embed(idx_BT, start), ctx)
        logits_BTV = self.head(self.norm(x_BTD))
        if cache is not None:
            cache.pos += T
        out = ModelOutput(logits=logits_BTV, aux_losses=ctx.aux_losses, stats=ctx.stats)
        if targets_BT is not None:
            out.ce_loss = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten(),
                                          ignore_index=-100)
            out.loss = out.ce_loss + sum(ctx.aux_losses.values())
        return out

    @torch.no_grad()
    def generate(self, idx_BT: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 use_cache: bool = True) -> torch.Tensor:
        """Sample continuations; temperature 0 means greedy. Returns prompt + new tokens."""
        was_training = self.training
        self.eval()
        cache = KVCache() if use_cache else None
        out_BT = idx_BT
        step_in = idx_BT
        for _ in range(max_new_tokens):
            logits_BV = self(step_in if use_cache else out_BT, cache=cache).logits[:, -1].float()
            if temperature <= 0:
                nxt_B1 = logits_BV.argmax(-1, keepdim=True)
            else:
                logits_BV = logits_BV / temperature
                if top_k is not None and top_k < logits_BV.shape[-1]:
                    kth = torch.topk(logits_BV, top_k).values[:, -1:]
                    logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
                probs = logits_BV.softmax(-1)
                nxt_B1 = torch.multinomial(probs, 1, generator=generator)
            out_BT = torch.cat([out_BT, nxt_B1], dim=1)
            step_in = nxt_B1
        self.train(was_training)
        return out_BT


def build_model(cfg: ModelConfig, device: str | torch.device | None = None) -> DecoderLM:
    """Build the model a config describes (``device='meta'`` allocates no weights)."""
    if device is not None and str(device) == "meta":
        with torch.device("meta"):
            return DecoderLM(cfg)
    model = DecoderLM(cfg)
    return model.to(device) if device is not None else model
