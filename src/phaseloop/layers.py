"""Building blocks of the shared decoder: RMSNorm, RoPE, GQA attention with a KV cache,
SwiGLU and the pre-norm block. Architecture files reuse these; they do not copy them.

Shapes live in names: B batch, T time (new tokens), S keys (cached + new), D d_model,
H query heads, K kv heads, E head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) with a learnable gain, eps inside the sqrt."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """Every norm site goes through here, so the 3PT phase norm replaces all of them."""
    if cfg.phase_norm:
        from .three_phase import PhaseRMSNorm

        return PhaseRMSNorm(cfg.d_model, cfg.n_phases, cfg.norm_eps)
    return RMSNorm(cfg.d_model, cfg.norm_eps)


# ---------------------------------------------------------------------------- RoPE
def rope_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, E] for rotate-half RoPE (Su et al. 2021) over the full head dim."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim))
    angles_TE2 = positions.float()[:, None] * inv_freq[None, :]
    angles_TE = torch.cat([angles_TE2, angles_TE2], dim=-1)
    return angles_TE.cos(), angles_TE.sin()


def apply_rope(x_BHTE: torch.Tensor, cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHTE.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHTE * cos_TE + rotated * sin_TE).to(x_BHTE.dtype)


# ---------------------------------------------------------------------------- KV cache
@dataclass
class KVCache:
    """Keys/values per *slot*. A slot is one application of an attention layer: layer i
    of a plain stack, or (layer, pass) of a weight-shared block, so looped and universal
    trunks keep one entry per pass. ``pos`` is the absolute position of the next token."""

    entries: dict = field(default_factory=dict)
    pos: int = 0

    def update(self, slot, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor):
        if slot in self.entries:
            k_old, v_old = self.entries[slot]
            k_BKTE = torch.cat([k_old, k_BKTE], dim=2)
            v_BKTE = torch.cat([v_old, v_BKTE], dim=2)
        self.entries[slot] = (k_BKTE, v_BKTE)
        return k_BKTE, v_BKTE


@dataclass
class Context:
    """What every block needs besides its input: RoPE tables for the new positions,
    the cache (or None) and the absolute position of the first new token."""

    cos: torch.Tensor
    sin: torch.Tensor
    start_pos: int = 0
    cache: KVCache | None = None
    causal: bool = True  # False: bidirectional self-attention (seq2seq encoder)
    key_mask: torch.Tensor | None = None  # bidirectional only: bool [B, 1, 1, S], True = attend
    aux_losses: dict = field(default_factory=dict)  # scalar losses added to the loss (ACT ponder)
    stats: dict = field(default_factory=dict)  # tensors for analysis (ACT ponder times)


# ---------------------------------------------------------------------------- modules
class Attention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023) through SDPA; no biases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.o_proj.residual = True  # scaled init
        self.dropout = cfg.dropout
        self.use_rope = cfg.use_rope

    def forward(self, x_BTD: torch.Tensor, ctx: Context, slot=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTE = self.q_proj(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k_BTKE, v_BTKE = self.kv_proj(x_BTD).view(B, T, 2, self.n_kv_heads, self.head_dim).unbind(2)
        k_BKTE, v_BKTE = k_BTKE.transpose(1, 2), v_BTKE.transpose(1, 2)
        if self.use_rope:
            q_BHTE = apply_rope(q_BHTE, ctx.cos, ctx.sin)
            k_BKTE = apply_rope(k_BKTE, ctx.cos, ctx.sin)
        past = 0
        if ctx.cache is not None:
            k_BKSE, v_BKSE = ctx.cache.update(slot, k_BKTE, v_BKTE)
            past = k_BKSE.shape[2] - T
        else:
            k_BKSE, v_BKSE = k_BKTE, v_BKTE
        mask, causal = None, ctx.causal and past == 0 and T > 1
        if not ctx.causal:
            mask = ctx.key_mask
        elif past and T > 1:  # chunked prefill after a cached prefix: offset causal mask
            S = past + T
            mask = torch.ones(T, S, dtype=torch.bool, device=x_BTD.device).tril(diagonal=past)
        y_BHTE = F.scaled_dot_product_attention(
            q_BHTE, k_BKSE, v_BKSE, attn_mask=mask, is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(y_BHTE.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """FFN(x) = down(silu(gate(x)) * up(x)) (Shazeer 2020); no biases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.down.residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm block: h = h + Attn(N1(h)); h = mid(h); h = h + FFN(N2(h)).

    ``mid`` is the identity for the Llama baseline and the 3PT PhaseRotation when
    ``cfg.phase_rotation`` (3PT §2: between attention and FFN, not residual).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, n_layers: int | None = None):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        self.ffn = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.mid: nn.Module = nn.Identity()
        if cfg.phase_rotation:
            from .three_phase import PhaseRotation

            self.mid = PhaseRotation(cfg, layer_idx, n_layers or cfg.n_layers)

    def forward(self, x_BTD: torch.Tensor, ctx: Context, slot=None, cross=None) -> torch.Tensor:
        """``cross``: optional sub-layer after self-attention, h = h + cross(h) (the
        encoder-decoder's cross-attention, seq2seq.py)."""
        x_BTD = x_BTD + self.drop(self.attn(self.attn_norm(x_BTD), ctx, slot))
        if cross is not None:
            x_BTD = x_BTD + self.drop(cross(x_BTD))
        x_BTD = self.mid(x_BTD)
        return x_BTD + self.drop(self.ffn(self.ffn_norm(x_BTD)))


def init_weights(module: nn.Module, cfg: ModelConfig, n_residual_layers: int) -> None:
    """Normal(0, init_std) for linear layers; projections that write into the residual
    stream get init_std / sqrt(2 * depth) (GPT-2 §2.3); norms keep gain 1."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            std = cfg.init_std
            if getattr(m, "residual", False):
                std = cfg.init_std / math.sqrt(2 * n_residual_layers)
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
