"""Building blocks of the shared decoder: RMSNorm (or LayerNorm), RoPE, GQA attention
(self or cross) with a KV cache, SwiGLU (or the ReLU FFN) and the pre-norm block. The
defaults are the Llama-style backbone (no biases); ``norm="layer"``, ``ffn="relu"`` and
``bias=True`` give the original Transformer's / Universal Transformer's block.
Architecture files reuse these; they do not copy them, and this file imports none of
them: an architecture that changes a norm, the map between the sub-layers or the
embedding output declares a ``BlockOption`` for its config switch in its option group's
``block_options`` (3PT: ``archs/three_phase.py``).

Shapes live in names: B batch, T time (new tokens), S keys (cached + new), D d_model,
H query heads, K kv heads, E head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from phaseloop import docattn, registry
from phaseloop.config import ModelConfig
from phaseloop.kvcache import KVCache, StaticKVCache, position_table  # the caches callers import from here
from phaseloop.passes import Running, deepest_kv, merged_kv, rope_rows


# ---------------------------------------------------------------------------- options
@dataclass
class BlockOption:
    """What an option group puts into the shared block and embedding under one of its
    boolean fields (its ``block_options`` class attribute: switch -> BlockOption); each
    factory returns a module. ``norm(cfg)`` replaces every norm site (``make_norm``);
    ``between(cfg, layer_idx, n_layers)`` is the map between attention and FFN (identity
    otherwise); ``embedding(cfg)`` is applied as ``module(x_BTD, start_pos)`` to the
    embedding output."""

    norm: Callable[[ModelConfig], nn.Module] | None = None
    between: Callable[[ModelConfig, int, int], nn.Module] | None = None
    embedding: Callable[[ModelConfig], nn.Module] | None = None


def register_block_option(switch: str, **factories) -> None:
    """``BlockOption(**factories)`` under ``switch`` in the ``block_options`` of the option
    group that holds the field (the same as declaring it there)."""
    group = next((g for g in registry.all_groups(load=False) if switch in g.__dataclass_fields__), None)
    if group is None:
        raise ValueError(f"{switch!r} is not a field of a registered option group (register the group first)")
    group.block_options = {**getattr(group, "block_options", {}), switch: BlockOption(**factories)}


def option_modules(cfg: ModelConfig, kind: str, *args) -> list[tuple[str, nn.Module]]:
    """(switch, module) for every block option of ``kind`` that ``cfg`` switches on."""
    return [(name, getattr(opt, kind)(cfg, *args)) for name, opt in registry.block_options(cfg.spec).items()
            if getattr(opt, kind) is not None and getattr(cfg, name)]


def _at_most_one(found: list, kind: str):
    if len(found) > 1:
        raise ValueError(f"config switches on {len(found)} {kind} options "
                         f"({', '.join(n for n, _ in found)}); at most one can apply")
    return found[0][1] if found else None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for maths that needs at least fp32 (the 3PT rotation, the ACT halting unit):
    float64 stays float64 end to end; fp32, bf16 and half compute in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) with a learnable gain, eps inside the sqrt."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """Every norm site goes through here, so a registered norm option replaces all of them;
    otherwise RMSNorm, or with ``norm="layer"`` LayerNorm with gain and bias (Ba et al.
    2016; Vaswani et al. 2017, tensor2tensor)."""
    found = _at_most_one(option_modules(cfg, "norm"), "norm")
    if found is not None:
        return found
    if cfg.norm == "layer":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
    return RMSNorm(cfg.d_model, cfg.norm_eps)


# ---------------------------------------------------------------------------- RoPE
def rope_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [*positions.shape, E] for rotate-half RoPE (Su et al. 2021) over the full
    head dim: [T, E] for one sequence's positions, [B, T, E] for per-row positions."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim))
    angles_TE2 = positions.float()[..., None] * inv_freq
    angles_TE = torch.cat([angles_TE2, angles_TE2], dim=-1)
    return angles_TE.cos(), angles_TE.sin()


def apply_rope(x_BHTE: torch.Tensor, cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHTE.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHTE * cos_TE + rotated * sin_TE).to(x_BHTE.dtype)


def timing_signal(positions: torch.Tensor, d: int, min_timescale: float = 1.0,
                  max_timescale: float = 1.0e4) -> torch.Tensor:
    """[len(positions), d] sinusoid: [sin(p w_k)]_k ++ [cos(p w_k)]_k, w_k = (1/min) *
    (max/min)^(-k/(d/2-1)) (tensor2tensor get_timing_signal_1d; Vaswani et al. §3.5)."""
    n = d // 2
    log_inc = math.log(max_timescale / min_timescale) / max(n - 1, 1)
    inv_K = torch.exp(torch.arange(n, dtype=torch.float32, device=positions.device) * -log_inc)
    angles_TK = positions.float()[:, None] * (inv_K / min_timescale)[None, :]
    sig_TD = torch.cat([angles_TK.sin(), angles_TK.cos()], dim=-1)
    return nn.functional.pad(sig_TD, (0, d % 2))


# ---------------------------------------------------------------------------- context
@dataclass
class Memory:
    """What a decoder cross-attends to (an encoder's output, Vaswani §3.2.3): its states, a key mask
    (bool [B, 1, 1, S], True = attend) and each cross-attention's keys/values, made once for every step."""

    x_BSD: torch.Tensor
    mask_B11S: torch.Tensor | None = None
    kv: dict = field(default_factory=dict)

    def keys_values(self, attn: Attention):
        if id(attn) not in self.kv:
            self.kv[id(attn)] = attn.project_kv(self.x_BSD)
        return self.kv[id(attn)]


@dataclass
class ForwardContext:
    """What every block needs besides its input: RoPE tables for the new positions,
    the cache (or None) and the absolute position of the first new token."""

    cos: torch.Tensor
    sin: torch.Tensor
    start_pos: int = 0
    cache: KVCache | StaticKVCache | None = None
    causal: bool = True  # False: bidirectional self-attention (seq2seq encoder)
    # bool [B, 1, 1|T, S], True = attend: the bidirectional encoder's key mask, or the causal
    # mask of left-padded cached rows (KVCache.pad: DecoderLM.forward builds it)
    key_mask: torch.Tensor | None = None
    memory: Memory | None = None  # cross-attention source (seq2seq decoder)
    aux_losses: dict = field(default_factory=dict)  # scalar losses added to the loss (ACT ponder)
    stats: dict = field(default_factory=dict)  # tensors for analysis (ACT ponder times)
    # documents in a training window (no cache): each token's position in its
    # document [B, T] (read by RoPE, the 3PT horn, the UT coordinate signal), and its
    # document's index [B, T] (attention stays within a document); with a StaticKVCache,
    # the new tokens' absolute positions (where their keys are written)
    positions: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None
    doc_block_mask: object = None  # FlexAttention's BlockMask of doc_ids (docattn), built once
    running: Running | None = None  # one pass of a loop over the positions still running (passes.py)
    readout: object = None  # logits an exit rule read from the trunk's final state (early_exit.Readout)

    @classmethod
    def at(cls, cfg: ModelConfig, start: int, T: int, device, positions: torch.Tensor | None = None,
           **kw) -> ForwardContext:
        """ForwardContext for the T new tokens at absolute positions start .. start + T - 1, or at
        ``positions`` [B, T] (per row: documents restarting at 0)."""
        if positions is None:
            cos, sin = position_table(kw.get("cache"), ("rope", cfg.head_dim, cfg.rope_base), start, T, device,
                                      lambda p: rope_tables(p, cfg.head_dim, cfg.rope_base))
        else:  # [B, 1, T, E]: broadcast over heads
            cos, sin = (t.unsqueeze(1) for t in rope_tables(positions, cfg.head_dim, cfg.rope_base))
        return cls(cos=cos, sin=sin, start_pos=start, positions=positions, **kw)


Context = ForwardContext  # the name before 0.2 (plugins written against it keep working)


# ---------------------------------------------------------------------------- modules
DOC_FLEX = object()  # _self_keys' mask when FlexAttention keeps attention within documents


class Attention(nn.Module):
    """Grouped-query attention (Ainslie et al. 2023) through SDPA; biases on q, kv, o with
    ``cfg.bias`` (none by default). Self-attention
    (causal, or bidirectional with a key mask) over the new tokens and the cache; with
    ``cross=True`` queries attend to ``ctx.memory`` instead (no RoPE: positions of two
    sequences do not compare)."""

    def __init__(self, cfg: ModelConfig, cross: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.kv_proj = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.o_proj.residual = True  # scaled init
        self.dropout = cfg.dropout
        self.cross = cross
        self.use_rope = cfg.use_rope and not cross

    def project_kv(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, _ = x_BSD.shape
        k_BSKE, v_BSKE = self.kv_proj(x_BSD).view(B, S, 2, self.n_kv_heads, self.head_dim).unbind(2)
        return k_BSKE.transpose(1, 2), v_BSKE.transpose(1, 2)

    def forward(self, x_BTD: torch.Tensor, ctx: ForwardContext, slot=None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTE = self.q_proj(x_BTD).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        if self.cross:
            (k_BKSE, v_BKSE), mask, causal = ctx.memory.keys_values(self), ctx.memory.mask_B11S, False
        else:
            q_BHTE, k_BKSE, v_BKSE, mask, causal = self._self_keys(x_BTD, q_BHTE, ctx, slot)
        gqa, dropout_p = self.n_heads != self.n_kv_heads, self.dropout if self.training else 0.0
        if mask is DOC_FLEX:  # within each document, through FlexAttention (docattn)
            if ctx.doc_block_mask is None:
                ctx.doc_block_mask = docattn.block_mask(ctx.doc_ids)
            y_BHTE = docattn.attend(q_BHTE, k_BKSE, v_BKSE, ctx.doc_block_mask, gqa)
        else:
            y_BHTE = F.scaled_dot_product_attention(q_BHTE, k_BKSE, v_BKSE, attn_mask=mask, is_causal=causal,
                                                    dropout_p=dropout_p, enable_gqa=gqa)
        return self.o_proj(y_BHTE.transpose(1, 2).reshape(B, T, -1))

    def rotate(self, q_BHTE, k_BKTE, cos_TE, sin_TE):
        """RoPE on the queries and keys of the new tokens together (one place to fuse
        them: benchmarks/bench_step.py --compile pieces compiles this on the instance)."""
        return apply_rope(q_BHTE, cos_TE, sin_TE), apply_rope(k_BKTE, cos_TE, sin_TE)

    def _self_keys(self, x_BTD, q_BHTE, ctx: ForwardContext, slot):
        """The new tokens' queries and keys (RoPE'd), values (keys and values appended to
        the cache) and the mask."""
        T = x_BTD.shape[1]
        k_BKTE, v_BKTE = self.project_kv(x_BTD)
        if self.use_rope:
            q_BHTE, k_BKTE = self.rotate(q_BHTE, k_BKTE, ctx.cos, ctx.sin)
        if ctx.running is not None and ctx.running.fill == "latest":  # every position ran: the deepest
            ctx.running.latest[id(self)] = (k_BKTE.transpose(1, 2), v_BKTE.transpose(1, 2))
        past = 0
        if ctx.cache is not None and ctx.cache.static:  # every position's buffer, masked
            k_BKSE, v_BKSE, visible_B1TS = ctx.cache.update(slot, k_BKTE, v_BKTE, ctx.positions)
            return q_BHTE, k_BKSE, v_BKSE, visible_B1TS, False
        if ctx.cache is not None:
            k_BKTE, v_BKTE = ctx.cache.update(slot, k_BKTE, v_BKTE)
            past = k_BKTE.shape[2] - T
        # is_causal on the new tokens alone (T = 1 included): a plain bool, also when a
        # compiled graph sees T as a symbol
        mask, causal = None, ctx.causal and past == 0
        if not ctx.causal or ctx.key_mask is not None:
            mask, causal = ctx.key_mask, False
        elif ctx.doc_ids is not None and docattn.wanted(q_BHTE, self.dropout if self.training else 0.0):
            mask, causal = DOC_FLEX, False
        elif ctx.doc_ids is not None:  # causal within each document: [B, 1, T, T]
            same_BTT = ctx.doc_ids[:, :, None] == ctx.doc_ids[:, None, :]
            mask, causal = (same_BTT & torch.ones(T, T, dtype=torch.bool, device=x_BTD.device).tril())[:, None], False
        elif past and T > 1:  # chunked prefill after a cached prefix: offset causal mask
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x_BTD.device).tril(diagonal=past)
        return q_BHTE, k_BKTE, v_BKTE, mask, causal

    def forward_running(self, h_BTD, h_ND, ctx: ForwardContext, slot, run: Running, T: int):
        """One pass over the running positions only (``passes``): [N, D] output of their
        queries, or None when none runs (then only this pass's keys/values are filled into
        the cache: ``h_BTD``, every position's normed input, with ``fill=recompute``)."""
        if self.cross or not ctx.causal:
            raise ValueError("a pass over running positions is causal self-attention only")
        cos, sin = (rope_rows(t, run, T) for t in (ctx.cos, ctx.sin)) if run.any else (None, None)
        if run.fill == "recompute":
            k_BKTE, v_BKTE = self.project_kv(h_BTD)
            if self.use_rope:
                k_BKTE = apply_rope(k_BKTE, ctx.cos, ctx.sin)
        else:  # latest: the running rows' fresh keys, the others' deepest
            fresh = ()
            if run.any:
                fresh = self.kv_proj(h_ND).view(len(h_ND), 2, self.n_kv_heads, self.head_dim).unbind(1)
                fresh = (apply_rope(fresh[0], cos, sin) if self.use_rope else fresh[0], fresh[1])
            if fresh:
                merged_kv(self, run, fresh)
            k_BKTE, v_BKTE = deepest_kv(self, run)
        if not run.any:  # no query reads this pass's keys/values in this forward: owed (None)
            return None if ctx.cache is None else ctx.cache.owe(slot, k_BKTE, v_BKTE)
        if ctx.cache is not None:
            k_BKTE, v_BKTE = ctx.cache.update(slot, k_BKTE, v_BKTE)
        q_NHE = self.q_proj(h_ND).view(len(h_ND), self.n_heads, self.head_dim)
        q_BHQE = run.pad(apply_rope(q_NHE, cos, sin) if self.use_rope else q_NHE).transpose(1, 2)
        S = k_BKTE.shape[2]
        mask = run.mask_BQS(S - T, S, ctx.doc_ids if ctx.cache is None else None, ctx.key_mask)
        y_BHQE = F.scaled_dot_product_attention(q_BHQE, k_BKTE, v_BKTE, attn_mask=mask,
                                                dropout_p=self.dropout if self.training else 0.0,
                                                enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(run.unpad(y_BHQE.transpose(1, 2)).flatten(1))


class SwiGLU(nn.Module):
    """FFN(x) = down(silu(gate(x)) * up(x)) (Shazeer 2020); biases only with ``cfg.bias``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=cfg.bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.down.residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class ReLUFFN(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Vaswani et al. 2017 §3.3; the UT paper's
    transition, Dehghani et al. 2019 §2.1); biases with ``cfg.bias``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.down.residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


def make_ffn(cfg: ModelConfig) -> nn.Module:
    return ReLUFFN(cfg) if cfg.ffn == "relu" else SwiGLU(cfg)


class Block(nn.Module):
    """Pre-norm block: h = h + Attn(N1(h)) [+ CrossAttn(Nc(h))]; h = between(h);
    h = h + FFN(N2(h)).

    ``between`` is the identity for the Llama baseline, or a registered option's map
    (the 3PT PhaseRotation: between attention and FFN, not residual). ``cross=True``
    adds the encoder-decoder's cross-attention sub-layer to ``ctx.memory`` (seq2seq.py).
    The branches are public so that trunks which replace the residual additions (mHC)
    reuse them instead of the block's internals.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, n_layers: int | None = None,
                 cross: bool = False):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.cross_norm = make_norm(cfg) if cross else None
        self.cross_attn = Attention(cfg, cross=True) if cross else None
        self.ffn_norm = make_norm(cfg)
        self.ffn = make_ffn(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        found = option_modules(cfg, "between", layer_idx, n_layers or cfg.n_layers)
        self.between: nn.Module = _at_most_one(found, "between-sub-layer") or nn.Identity()

    def attn_branch(self, x_BTD: torch.Tensor, ctx: ForwardContext, slot=None) -> torch.Tensor:
        return self.drop(self.attn(self.attn_norm(x_BTD), ctx, slot))

    def cross_branch(self, x_BTD: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.drop(self.cross_attn(self.cross_norm(x_BTD), ctx))

    def ffn_branch(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.drop(self.ffn(self.ffn_norm(x_BTD)))

    def forward(self, x_BTD: torch.Tensor, ctx: ForwardContext, slot=None) -> torch.Tensor:
        if ctx.running is not None and not ctx.running.all:
            return self._running(x_BTD, ctx, slot, ctx.running)
        x_BTD = x_BTD + self.attn_branch(x_BTD, ctx, slot)
        if self.cross_attn is not None:
            x_BTD = x_BTD + self.cross_branch(x_BTD, ctx)
        x_BTD = self.between(x_BTD)
        return x_BTD + self.ffn_branch(x_BTD)


    def _running(self, x_BTD, ctx: ForwardContext, slot, run: Running) -> torch.Tensor:
        """The running rows only (passes.py); an exited row leaves the block unchanged."""
        if not run.any and ctx.cache is None:
            return x_BTD  # no query reads this pass's keys
        x_ND = run.gather(x_BTD) if run.any else None
        h_BTD = self.attn_norm(x_BTD) if run.fill == "recompute" else None
        h_ND = (run.gather(h_BTD) if h_BTD is not None else self.attn_norm(x_ND)) if run.any else None
        a_ND = self.attn.forward_running(h_BTD, h_ND, ctx, slot, run, x_BTD.shape[1])
        if a_ND is None:
            return x_BTD
        x_ND = self.between((x_ND + self.drop(a_ND))[None])[0]
        return run.scatter(x_BTD, x_ND + self.ffn_branch(x_ND))


def init_weights(module: nn.Module, cfg: ModelConfig, n_residual_layers: int) -> None:
    """Linear layers, ``cfg.init="normal"``: N(0, init_std), projections that write into the
    residual stream N(0, init_std / sqrt(2 * depth)) (GPT-2 §2.3), biases 0;
    ``init="torch"``: PyTorch's default, ``nn.Linear.reset_parameters`` (weights and biases
    U(±1/sqrt(fan_in)), no depth scaling), as the 3PT author's script leaves them. Norms
    keep gain 1; the embedding is the caller's (``embed_init_std``)."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and cfg.init == "torch":
            m.reset_parameters()
        elif isinstance(m, nn.Linear):
            std = cfg.init_std
            if getattr(m, "residual", False):
                std = cfg.init_std / math.sqrt(2 * n_residual_layers)
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
