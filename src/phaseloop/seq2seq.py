"""Encoder-decoder models: the vanilla Transformer baseline (Vaswani et al. 2017) and the
Universal Transformer encoder-decoder (Dehghani et al. 2019 §2), plus a small training
helper (teacher forcing) and greedy decoding.

Both reuse the shared pieces: ``layers.Block`` (pre-norm self-attention + SwiGLU) for
every layer, with the decoder's cross-attention plugged in between self-attention and
the transition through ``Block.forward(..., cross=...)``; ``universal.UniversalTrunk``
for the weight-tied stacks. The only new module is ``CrossAttention``.

* ``TransformerSeq2Seq(cfg)``: ``cfg.n_layers`` encoder and ``cfg.n_layers`` decoder
  layers; position sinusoid added once to the embeddings (Vaswani §3.5).
* ``UniversalSeq2Seq(cfg)`` (``arch="universal"``): one shared encoder block applied
  ``n_steps`` times, then one shared decoder block + one shared cross-attention to the
  encoder's final (normed) state applied ``n_steps`` times; the coordinate signal before
  every step; ACT per side (``encoder_act``/``decoder_act``, default ``cfg.act``).

Tokens: one embedding for source and target (tensor2tensor shares it), ``PAD``/``BOS``/
``EOS`` ids 0/1/2 by default. The source padding mask is applied to encoder
self-attention and to cross-attention; targets are right-padded (``-100`` in targets).
Outputs are ``model.ModelOutput``; ACT losses/stats are prefixed ``encoder_``/``decoder_``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .errors import ConfigError
from .layers import Block, Context, KVCache, init_weights, make_norm, rope_tables
from .model import ModelOutput, Stack, TokenEmbedding
from .universal import UniversalTrunk, timing_signal

PAD, BOS, EOS = 0, 1, 2


class CrossAttention(nn.Module):
    """Pre-norm multi-head attention from decoder positions to the encoder output
    (Vaswani §3.2.3): h + CrossAttn(Norm(h), memory). No RoPE; keys/values of the memory
    are computed once per source (``memory_kv``) and reused by every step/token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.norm = make_norm(cfg)
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.o_proj.residual = True
        self.dropout = cfg.dropout

    def memory_kv(self, mem_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, _ = mem_BSD.shape
        k_BSKE, v_BSKE = self.kv_proj(mem_BSD).view(B, S, 2, self.n_kv_heads, self.head_dim).unbind(2)
        return k_BSKE.transpose(1, 2), v_BSKE.transpose(1, 2)

    def forward(self, x_BTD: torch.Tensor, kv, key_mask_B11S: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTE = self.q_proj(self.norm(x_BTD)).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k_BKSE, v_BKSE = kv
        y_BHTE = F.scaled_dot_product_attention(
            q_BHTE, k_BKSE, v_BKSE, attn_mask=key_mask_B11S,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_heads != self.n_kv_heads)
        return self.o_proj(y_BHTE.transpose(1, 2).reshape(B, T, -1))


class _EncoderDecoder(nn.Module):
    """Shared skeleton: embed -> encoder -> norm (memory); embed -> decoder (with
    cross-attention) -> norm -> head. Subclasses build ``encoder``/``decoder``/``cross``."""

    add_position_signal = False  # vanilla: sinusoid once at the embedding

    def __init__(self, cfg: ModelConfig, pad_id: int = PAD):
        super().__init__()
        self.cfg, self.pad_id = cfg, pad_id
        self.embed = TokenEmbedding(cfg)
        self.enc_norm = make_norm(cfg)
        self.dec_norm = make_norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def _init(self, depth: int) -> None:
        init_weights(self, self.cfg, depth)
        nn.init.normal_(self.embed.tok.weight, 0.0, self.cfg.embed_init_std)
        if self.cfg.tie_embeddings:
            self.head.weight = self.embed.tok.weight

    def _ctx(self, start: int, T: int, device, **kw) -> Context:
        cos, sin = rope_tables(torch.arange(start, start + T, device=device), self.cfg.head_dim,
                               self.cfg.rope_base)
        return Context(cos=cos, sin=sin, start_pos=start, **kw)

    def _embed(self, idx_BT: torch.Tensor, start: int) -> torch.Tensor:
        x_BTD = self.embed(idx_BT, start)
        if self.add_position_signal:
            pos_T = torch.arange(start, start + idx_BT.shape[1], device=idx_BT.device)
            x_BTD = x_BTD + timing_signal(pos_T, self.cfg.d_model).to(x_BTD.dtype)
        return x_BTD

    def encode(self, src_BS: torch.Tensor, src_mask_BS: torch.Tensor | None = None):
        """-> (memory [B, S, D], key mask [B, 1, 1, S], encoder Context with ACT stats)."""
        if src_mask_BS is None:
            src_mask_BS = src_BS != self.pad_id
        key_mask = src_mask_BS[:, None, None, :]
        ctx = self._ctx(0, src_BS.shape[1], src_BS.device, causal=False, key_mask=key_mask)
        mem_BSD = self.enc_norm(self._run_encoder(self._embed(src_BS, 0), ctx))
        return mem_BSD, key_mask, ctx

    def forward(self, src_BS: torch.Tensor, tgt_in_BT: torch.Tensor,
                targets_BT: torch.Tensor | None = None, cache: KVCache | None = None,
                memory=None, src_mask_BS: torch.Tensor | None = None) -> ModelOutput:
        """Teacher-forced logits for ``tgt_in`` (BOS + target). With ``cache``, pass the
        ``memory`` tuple from ``encode`` and feed the target incrementally."""
        aux, stats = {}, {}
        if memory is None:
            memory = self.encode(src_BS, src_mask_BS)
        mem_BSD, key_mask, enc_ctx = memory
        for k, v in enc_ctx.aux_losses.items():
            aux[f"encoder_{k}"] = v
        for k, v in enc_ctx.stats.items():
            stats[f"encoder_{k}"] = v
        T = tgt_in_BT.shape[1]
        start = cache.pos if cache is not None else 0
        ctx = self._ctx(start, T, tgt_in_BT.device, cache=cache)
        kvs = cache.entries.get("cross") if cache is not None else None
        if kvs is None:
            kvs = [c.memory_kv(mem_BSD) for c in self._cross_modules()]
            if cache is not None:
                cache.entries["cross"] = kvs
        x_BTD = self._run_decoder(self._embed(tgt_in_BT, start), ctx, kvs, key_mask)
        logits_BTV = self.head(self.dec_norm(x_BTD))
        if cache is not None:
            cache.pos += T
        aux.update({f"decoder_{k}": v for k, v in ctx.aux_losses.items()})
        stats.update({f"decoder_{k}": v for k, v in ctx.stats.items()})
        out = ModelOutput(logits=logits_BTV, aux_losses=aux, stats=stats)
        if targets_BT is not None:
            out.ce_loss = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten(),
                                          ignore_index=-100)
            out.loss = out.ce_loss + sum(aux.values())
        return out


class TransformerSeq2Seq(_EncoderDecoder):
    """Vanilla encoder-decoder baseline: n_layers distinct encoder and decoder layers."""

    add_position_signal = True

    def __init__(self, cfg: ModelConfig, pad_id: int = PAD):
        if cfg.arch == "universal":
            raise ConfigError("invalid config: arch='universal': use UniversalSeq2Seq (or build_seq2seq)")
        super().__init__(cfg, pad_id)
        self.encoder = Stack(cfg)
        self.decoder = nn.ModuleList(Block(cfg, i, cfg.n_layers) for i in range(cfg.n_layers))
        self.cross = nn.ModuleList(CrossAttention(cfg) for _ in range(cfg.n_layers))
        self.depth = 2 * cfg.n_layers
        self._init(self.depth)

    def _cross_modules(self):
        return list(self.cross)

    def _run_encoder(self, x_BSD, ctx):
        return self.encoder(x_BSD, ctx)

    def _run_decoder(self, x_BTD, ctx, kvs, key_mask):
        for i, (block, cross) in enumerate(zip(self.decoder, self.cross)):
            x_BTD = block(x_BTD, ctx, i, functools.partial(cross, kv=kvs[i], key_mask_B11S=key_mask))
        return x_BTD


def _side(cfg: ModelConfig, act: bool | None) -> ModelConfig:
    if act is None or act == cfg.act:
        return cfg
    if act:
        return cfg.replace(act=True)
    return cfg.replace(act=False, **{k: ModelConfig.__dataclass_fields__[k].default for k in (
        "act_type", "act_epsilon", "act_max_steps", "act_loss_weight", "act_halting_bias_init",
        "act_early_exit")})


class UniversalSeq2Seq(_EncoderDecoder):
    """UT encoder-decoder (UT §2): shared encoder block, shared decoder block with one
    shared cross-attention to the encoder's final state; ACT on either side.
    Depth at inference: ``model.set_steps(n)`` (both sides)."""

    def __init__(self, cfg: ModelConfig, encoder_act: bool | None = None,
                 decoder_act: bool | None = None, pad_id: int = PAD):
        if cfg.arch != "universal":
            raise ConfigError(f"invalid config: arch={cfg.arch!r}: UniversalSeq2Seq needs "
                              "arch='universal' (use TransformerSeq2Seq for a stack)")
        super().__init__(cfg, pad_id)
        self.encoder = UniversalTrunk(_side(cfg, encoder_act))
        self.decoder = UniversalTrunk(_side(cfg, decoder_act))
        self.cross = CrossAttention(cfg)
        self.depth = 2 * cfg.n_steps
        self._init(self.depth)

    def set_steps(self, steps: int) -> None:
        self.encoder.set_steps(steps)
        self.decoder.set_steps(steps)

    def _cross_modules(self):
        return [self.cross]

    def _run_encoder(self, x_BSD, ctx):
        return self.encoder(x_BSD, ctx)

    def _run_decoder(self, x_BTD, ctx, kvs, key_mask):
        return self.decoder(x_BTD, ctx, cross=functools.partial(self.cross, kv=kvs[0],
                                                                key_mask_B11S=key_mask))


def build_seq2seq(cfg: ModelConfig, **kw) -> _EncoderDecoder:
    """UniversalSeq2Seq for arch='universal', else the vanilla TransformerSeq2Seq."""
    return UniversalSeq2Seq(cfg, **kw) if cfg.arch == "universal" else TransformerSeq2Seq(cfg, **kw)


# ---------------------------------------------------------------------------- data + training
Pair = tuple[Sequence[int], Sequence[int]]


def collate(pairs: Sequence[Pair], pad_id: int = PAD, bos_id: int = BOS, eos_id: int = EOS,
            device=None):
    """(src, tgt) id lists -> src [B, S] (PAD-padded), tgt_in [B, T+1] = BOS + tgt,
    targets [B, T+1] = tgt + EOS (-100 on padding)."""
    S = max(len(s) for s, _ in pairs)
    T = max(len(t) for _, t in pairs) + 1
    src = torch.full((len(pairs), S), pad_id, dtype=torch.long)
    tgt_in = torch.full((len(pairs), T), pad_id, dtype=torch.long)
    targets = torch.full((len(pairs), T), -100, dtype=torch.long)
    for i, (s, t) in enumerate(pairs):
        src[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        tgt_in[i, : len(t) + 1] = torch.as_tensor([bos_id, *t], dtype=torch.long)
        targets[i, : len(t) + 1] = torch.as_tensor([*t, eos_id], dtype=torch.long)
    return src.to(device), tgt_in.to(device), targets.to(device)


def train_seq2seq(model: _EncoderDecoder,
                  data: Sequence[Pair] | Callable[[int, random.Random], Sequence[Pair]],
                  steps: int = 300, batch_size: int = 32, lr: float = 3e-3, warmup_steps: int = 20,
                  weight_decay: float = 0.0, seed: int = 0, device=None,
                  stop_loss: float | None = None,
                  on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Teacher-forced training with the library's AdamW + warmup/cosine schedule.

    ``data``: a list of (src, tgt) id pairs (batches drawn at random) or a function
    ``(batch_size, rng) -> pairs``. Returns one record per step (loss, ce_loss and the
    auxiliary losses such as ``decoder_ponder_loss``). ``stop_loss``: stop early once the
    mean cross-entropy of the last 10 steps is below it."""
    from .train import TrainConfig, autocast, lr_at, make_optimizer

    tc = TrainConfig(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps,
                     weight_decay=weight_decay, seed=seed)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    rng = random.Random(seed)
    opt = make_optimizer(model, tc)
    history = []
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        pairs = data(batch_size, rng) if callable(data) else rng.choices(data, k=batch_size)
        src, tgt_in, targets = collate(pairs, model.pad_id, device=device)
        with autocast(device):
            out = model(src, tgt_in, targets)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec = {"step": step + 1, "loss": out.loss.item(), "ce_loss": out.ce_loss.item(),
               **{k: v.item() for k, v in out.aux_losses.items()}}
        history.append(rec)
        if on_step is not None:
            on_step(step + 1, rec)
        if stop_loss is not None and len(history) >= 10 and \
                sum(r["ce_loss"] for r in history[-10:]) / 10 < stop_loss:
            break
    return history


@torch.no_grad()
def greedy_decode(model: _EncoderDecoder, src_BS: torch.Tensor, max_len: int, bos_id: int = BOS,
                  eos_id: int = EOS, use_cache: bool = True) -> list[list[int]]:
    """Greedy decoding; returns each row's tokens up to (excluding) EOS."""
    was_training = model.training
    model.eval()
    memory = model.encode(src_BS)
    B = src_BS.shape[0]
    cache = KVCache() if use_cache else None
    out_BT = torch.full((B, 1), bos_id, dtype=torch.long, device=src_BS.device)
    done_B = torch.zeros(B, dtype=torch.bool, device=src_BS.device)
    for _ in range(max_len):
        inp = out_BT[:, -1:] if use_cache else out_BT
        nxt_B = model(src_BS, inp, cache=cache, memory=memory).logits[:, -1].argmax(-1)
        out_BT = torch.cat([out_BT, nxt_B[:, None]], dim=1)
        done_B |= nxt_B == eos_id
        if bool(done_B.all()):
            break
    model.train(was_training)
    rows = []
    for row in out_BT[:, 1:].tolist():
        rows.append(row[: row.index(eos_id)] if eos_id in row else row)
    return rows
