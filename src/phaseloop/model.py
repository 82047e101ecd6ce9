"""The shared decoder skeleton: embedding -> trunk -> final norm -> head.

Every architecture is a *trunk* (how the blocks are applied: ``ArchSpec.trunk``, a
``trunk.Trunk``) plus options of the shared block and embedding
(``layers.register_block_option``). The skeleton owns the KV cache, RoPE tables, the loss
and generation, so no architecture re-implements them; it names no architecture.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from phaseloop.config import MAX_DEPTH, ModelConfig
from phaseloop.decoding import check_request, decode, padded_rows
from phaseloop.errors import ConfigError
from phaseloop.kvcache import KVCache, StaticKVCache
from phaseloop.layers import Block, ForwardContext, init_weights, make_norm, option_modules
from phaseloop.trunk import Trunk, reset_derived_buffers


class Stack(Trunk):
    """A plain stack of distinct blocks (the Llama baseline, 3PT; with ``cross=True`` the
    encoder-decoder's decoder stack). Layer i uses KV-cache slot i."""

    def __init__(self, cfg: ModelConfig, cross: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg, i, cfg.n_layers, cross) for i in range(cfg.n_layers))
        self.depth = cfg.n_layers

    def forward(self, x_BTD: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x_BTD = layer(x_BTD, ctx, slot=i)
        return x_BTD

    def cache_slots(self) -> list:
        return list(range(len(self.layers)))


class TokenEmbedding(nn.Module):
    """Token embedding, optional sqrt(d_model) scale, then the registered embedding options
    the config switches on (the 3PT horn), as ``module(x, start_pos)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0
        self.options = nn.ModuleDict(option_modules(cfg, "embedding"))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx_BT: torch.Tensor | None, start_pos: int = 0,
                tok_BTD: torch.Tensor | None = None, positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        """``tok_BTD``: token embeddings given directly (``self.tok`` of some ids, or any
        vectors in its place; transformers' ``inputs_embeds``), instead of ``idx_BT``.
        ``positions_BT``: each token's position in its document (options that read
        positions take it as ``positions_BT``)."""
        x_BTD = self.tok(idx_BT) if tok_BTD is None else tok_BTD
        if self.scale != 1.0:
            x_BTD = x_BTD * self.scale
        for name, option in self.options.items():
            if positions_BT is None:
                x_BTD = option(x_BTD, start_pos)
            elif "positions_BT" in inspect.signature(option.forward).parameters:
                x_BTD = option(x_BTD, start_pos, positions_BT=positions_BT)
            else:
                raise ConfigError(f"the embedding option {name!r} reads no per-token positions (positions_BT), "
                                  "which documents (--doc-positions), left-padded rows sharing a batch and a "
                                  "static cache (export) give it")
        return self.drop(x_BTD)


@dataclass
class ModelOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None  # cross-entropy + auxiliary losses
    ce_loss: torch.Tensor | None = None
    aux_losses: dict = field(default_factory=dict)  # e.g. ACT ponder loss, logged apart
    stats: dict = field(default_factory=dict)  # e.g. per-position ponder times

    def add_loss(self, targets_BT: torch.Tensor) -> ModelOutput:
        """Cross-entropy over targets (-100 ignored), plus the auxiliary losses; in fp32 at
        least (bf16 logits under autocast are promoted, float64 ones kept)."""
        logits = self.logits if self.logits.dtype == torch.float64 else self.logits.float()
        self.ce_loss = F.cross_entropy(logits.flatten(0, 1), targets_BT.flatten(), ignore_index=-100)
        self.loss = self.ce_loss + sum(self.aux_losses.values())
        return self


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg)
        self.trunk: Trunk = cfg.spec.trunk(cfg)
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg, self.trunk.depth)
        nn.init.normal_(self.embed.tok.weight, 0.0, cfg.embed_init_std)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.tok.weight

    def forward(self, idx_BT: torch.Tensor | None, targets_BT: torch.Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None, embeds_BTD: torch.Tensor | None = None,
                positions_BT: torch.Tensor | None = None, doc_ids_BT: torch.Tensor | None = None) -> ModelOutput:
        """Targets equal to -100 are ignored (e.g. prompt tokens of a task). ``embeds_BTD``
        replaces the token embedding of ``idx_BT`` (pass None for ``idx_BT`` then); the
        embedding's scale and options (the 3PT horn) still apply. Windows holding several
        documents (no cache): ``positions_BT`` each token's position in its
        document, ``doc_ids_BT`` its document's index (attention stays within it). A cache
        with left-padded rows (``KVCache.pad``) sets each row's positions and mask itself. With a
        ``StaticKVCache``, ``positions_BT`` are the new tokens' absolute positions (default:
        the cache's ``pos`` on)."""
        src = idx_BT if embeds_BTD is None else embeds_BTD
        B, T = src.shape[:2]
        start = cache.pos if cache is not None else 0
        static = cache is not None and cache.static
        if cache is not None and (doc_ids_BT is not None or (positions_BT is not None and not static)):
            raise ConfigError("document positions and masks apply to training windows, not to "
                              "cached decoding (one sequence is one document there)")
        if static and positions_BT is None:  # else: the new tokens' positions (export's input_pos)
            positions_BT = cache.positions(B, T, src.device)
        for name, t in (("positions_BT", positions_BT), ("doc_ids_BT", doc_ids_BT)):
            if t is not None and tuple(t.shape) != (B, T):
                raise ConfigError(f"{name} has shape {tuple(t.shape)}; it must be [batch, tokens] = {(B, T)}")
        key_mask = None
        if cache is not None and cache.pad is not None:
            positions_BT, key_mask = padded_rows(cache, T, src.device)
        ctx = ForwardContext.at(self.cfg, start, T, src.device, positions_BT, cache=cache, doc_ids=doc_ids_BT,
                                key_mask=key_mask)
        x_BTD = self.trunk(self.embed(idx_BT, start, tok_BTD=embeds_BTD, positions_BT=positions_BT), ctx)
        read = ctx.readout.take(x_BTD) if ctx.readout is not None else None  # an exit rule's, of this state
        logits_BTV = self.head(self.norm(x_BTD)) if read is None else read
        if cache is not None:
            cache.pos += T
        out = ModelOutput(logits=logits_BTV, aux_losses=ctx.aux_losses, stats=ctx.stats)
        return out if targets_BT is None else out.add_loss(targets_BT)

    def reset_buffers(self) -> None:
        """Recompute the derived buffers (after a load onto the meta device, ``to_empty``)."""
        reset_derived_buffers(self)

    def generate(self, idx_BT: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 use_cache: bool = True, eos_id: int | None = None, on_output=None) -> torch.Tensor:
        """Sample continuations; temperature 0 means greedy. Returns prompt + new tokens
        (``decoding.decode``: stops early once every row produced ``eos_id``)."""
        check_request(idx_BT, max_new_tokens, temperature, top_k, self.cfg.vocab_size)
        was_training = self.training
        self.eval()
        try:
            return decode(lambda x_BT, cache: self(x_BT, cache=cache), idx_BT, max_new_tokens,
                          temperature=temperature, top_k=top_k, generator=generator,
                          eos_id=eos_id, use_cache=use_cache, on_output=on_output)
        finally:
            self.train(was_training)


def _check_depth(model: DecoderLM) -> DecoderLM:
    """Refuse a trunk applying more than ``MAX_DEPTH`` layers a token (e.g. a loop run
    100,000 times) before any forward pass: counting its FLOPs alone would take minutes."""

    depth = getattr(model.trunk, "depth", 0)
    if isinstance(depth, int) and depth > MAX_DEPTH:
        raise ConfigError.invalid(f"the {model.cfg.arch} model applies {depth:,} layers a token "
                          f"(its layers times its loops or steps); at most {MAX_DEPTH} are supported, "
                          "as every pass runs them in turn: use fewer layers or loops")
    return model


def build_model(cfg: ModelConfig, device: str | torch.device | None = None) -> DecoderLM:
    """Build the model a config describes (``device='meta'`` allocates no weights)."""
    if device is not None and str(device) == "meta":
        with torch.device("meta"):
            return _check_depth(DecoderLM(cfg))
    model = _check_depth(DecoderLM(cfg))
    return model.to(device) if device is not None else model
