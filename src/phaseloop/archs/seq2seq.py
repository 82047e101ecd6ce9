"""Encoder-decoder models: the vanilla Transformer baseline (Vaswani et al. 2017) and the
Universal Transformer encoder-decoder (Dehghani et al. 2019 §2).

Both are built from the shared pieces: ``model.Stack`` / ``universal.UniversalTrunk``
for the encoder, and the same with ``cross=True`` for the decoder, whose blocks then
carry a cross-attention sub-layer (``layers.Attention(cross=True)``) between
self-attention and the transition, attending to the encoder's final (normed) state.
Nothing here is a new layer.

* ``TransformerSeq2Seq(cfg)``: ``cfg.n_layers`` encoder and ``cfg.n_layers`` decoder
  layers; position sinusoid added once to the embeddings (Vaswani §3.5).
* ``universal.UniversalSeq2Seq(cfg)`` (``arch="universal"``): one shared encoder block applied
  ``n_steps`` times, then one shared decoder block (with its cross-attention) applied
  ``n_steps`` times; the coordinate signal before every step; ACT per side
  (``encoder_act``/``decoder_act``, default ``cfg.act``).

The block options of ``ModelConfig`` apply to both sides: ``ffn="relu", norm="layer",
bias=True, use_rope=False`` plus ``tie_embeddings=True`` is the published model with
tensor2tensor's conventions (``accounting.EncDecSpec.config()``; the built parameter
counts of the UT §3 presets equal the closed forms there). The UT decoder's shared
cross-attention projects the encoder's keys/values once for all steps (``Memory.kv``).

Tokens: one embedding for source and target (tensor2tensor shares it); special ids
``tokenizer.PAD``/``EOS``/``BOS`` (0 / 1 / 2, the task vocabularies' convention). The
source padding mask is applied to encoder self-attention and to cross-attention; targets
are right-padded (``-100`` in targets). Outputs are ``model.ModelOutput``; ACT
losses/stats are prefixed ``encoder_``/``decoder_``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from phaseloop.config import ModelConfig
from phaseloop.data.tokenizer import BOS, EOS, PAD
from phaseloop.decoding import decode
from phaseloop.errors import ConfigError
from phaseloop.layers import ForwardContext, KVCache, Memory, init_weights, make_norm, timing_signal
from phaseloop.model import ModelOutput, Stack, TokenEmbedding


class EncoderDecoder(nn.Module):
    """Shared skeleton: embed -> encoder -> norm (memory); embed -> decoder (with
    cross-attention) -> norm -> head. Subclasses build ``encoder`` and ``decoder``."""

    add_position_signal = False  # vanilla: sinusoid once at the embedding
    dynamic_depth = False  # a weight-tied encoder-decoder (the UT's) runs at another depth

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

    def _embed(self, idx_BT: torch.Tensor, start: int) -> torch.Tensor:
        x_BTD = self.embed(idx_BT, start)
        if self.add_position_signal:
            pos_T = torch.arange(start, start + idx_BT.shape[1], device=idx_BT.device)
            x_BTD = x_BTD + timing_signal(pos_T, self.cfg.d_model).to(x_BTD.dtype)
        return x_BTD

    def encode(self, src_BS: torch.Tensor, src_mask_BS: torch.Tensor | None = None):
        """-> (Memory of the encoder's final state, encoder ForwardContext with ACT stats)."""
        if src_mask_BS is None:
            src_mask_BS = src_BS != self.pad_id
        key_mask = src_mask_BS[:, None, None, :]
        ctx = ForwardContext.at(self.cfg, 0, src_BS.shape[1], src_BS.device, causal=False, key_mask=key_mask)
        mem_BSD = self.enc_norm(self.encoder(self._embed(src_BS, 0), ctx))
        return Memory(mem_BSD, key_mask), ctx

    def forward(self, src_BS: torch.Tensor, tgt_in_BT: torch.Tensor,
                targets_BT: torch.Tensor | None = None, cache: KVCache | None = None,
                memory=None, src_mask_BS: torch.Tensor | None = None) -> ModelOutput:
        """Teacher-forced logits for ``tgt_in`` (BOS + target). With ``cache``, pass the
        ``memory`` pair from ``encode`` and feed the target incrementally."""
        mem, enc_ctx = self.encode(src_BS, src_mask_BS) if memory is None else memory
        T = tgt_in_BT.shape[1]
        start = cache.pos if cache is not None else 0
        ctx = ForwardContext.at(self.cfg, start, T, tgt_in_BT.device, cache=cache, memory=mem)
        x_BTD = self.decoder(self._embed(tgt_in_BT, start), ctx)
        logits_BTV = self.head(self.dec_norm(x_BTD))
        if cache is not None:
            cache.pos += T
        aux = {f"{side}_{k}": v for side, c in (("encoder", enc_ctx), ("decoder", ctx))
               for k, v in c.aux_losses.items()}
        stats = {f"{side}_{k}": v for side, c in (("encoder", enc_ctx), ("decoder", ctx))
                 for k, v in c.stats.items()}
        out = ModelOutput(logits=logits_BTV, aux_losses=aux, stats=stats)
        return out if targets_BT is None else out.add_loss(targets_BT)

    @torch.no_grad()
    def generate(self, src_BS: torch.Tensor, max_new_tokens: int, *, bos_id: int = BOS,
                 eos_id: int = EOS, use_cache: bool = True, on_output=None, **sampling) -> torch.Tensor:
        """Decode each source from BOS (greedy unless ``temperature``/``top_k`` are given,
        as in ``decoding.decode``) until every row has produced EOS; returns the new tokens
        [B, n] (``decoding.until_eos`` cuts the rows). ``on_output`` receives the encoder's
        context first, then every decoder output."""
        was_training = self.training
        self.eval()
        try:
            memory = self.encode(src_BS)
            if on_output is not None:
                on_output(memory[1])
            bos = torch.full((src_BS.shape[0], 1), bos_id, dtype=torch.long, device=src_BS.device)
            out_BT = decode(lambda t, cache: self(src_BS, t, cache=cache, memory=memory), bos,
                            max_new_tokens, eos_id=eos_id, use_cache=use_cache, on_output=on_output,
                            **sampling)
        finally:
            self.train(was_training)
        return out_BT[:, 1:]


class TransformerSeq2Seq(EncoderDecoder):
    """Vanilla encoder-decoder baseline: n_layers distinct encoder and decoder layers."""

    add_position_signal = True

    def __init__(self, cfg: ModelConfig, pad_id: int = PAD):
        if cfg.spec.seq2seq not in (None, TransformerSeq2Seq):
            raise ConfigError.invalid(f"arch={cfg.arch!r} has its own encoder-decoder: use "
                              f"{cfg.spec.seq2seq.__name__} (or build_seq2seq)")
        super().__init__(cfg, pad_id)
        self.encoder = Stack(cfg)
        self.decoder = Stack(cfg, cross=True)
        self.depth = 2 * cfg.n_layers
        self._init(self.depth)


def build_seq2seq(cfg: ModelConfig, **kw) -> EncoderDecoder:
    """The encoder-decoder of cfg's architecture (``ArchSpec.seq2seq``: UniversalSeq2Seq
    for the UT), else the vanilla TransformerSeq2Seq with cfg's block options."""
    return (cfg.spec.seq2seq or TransformerSeq2Seq)(cfg, **kw)


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
