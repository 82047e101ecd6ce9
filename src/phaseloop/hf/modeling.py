"""``transformers`` classes around phaseloop's own model (no second implementation).

``PhaseloopConfig`` carries the whole ``ModelConfig`` (``config.phaseloop``);
``PhaseloopForCausalLM`` holds the same ``DecoderLM`` as ``model`` and returns its
logits, so the weights, the equations and the KV cache are phaseloop's.

Cache: ``generate`` gets a ``PhaseloopCache`` (not a ``transformers`` layer cache): one
phaseloop ``KVCache`` per group of rows with the same left padding. A slot of it is one
application of an attention layer (layer i, or (layer, pass) of a weight-shared block),
so looped and universal trunks keep one entry per pass; under ACT it also holds the
step inputs of positions that halted early (``universal.py``, lazy step extension). None
of that fits the layer-indexed ``Cache`` API, which is why the model supplies its own
cache (``_supports_default_dynamic_cache`` is False, as for Mamba).

Padding: rows of a left-padded batch (``attention_mask`` 0 … 0 1 … 1) run as one
sub-batch per padding length, each exactly as those rows alone (3PT's horn and UT's
coordinate signal read absolute positions, which padding would shift); pad positions
get logits 0. Only left padding is accepted (right padding needs no mask: causal).
"""

from __future__ import annotations

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig,
                          PreTrainedModel)
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..config import ModelConfig
from ..errors import ConfigError
from ..layers import KVCache
from ..model import DecoderLM
from ..trunk import DerivedBuffers


class PhaseloopConfig(PretrainedConfig):
    model_type = "phaseloop"

    def __init__(self, phaseloop: dict | None = None, **kwargs):
        cfg = ModelConfig.from_dict(phaseloop or {})
        self.phaseloop = cfg.to_dict()
        # the names other tools read (lm-eval: max_length from max_position_embeddings)
        kwargs.setdefault("tie_word_embeddings", cfg.tie_embeddings)
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.d_model
        self.num_hidden_layers = cfg.n_layers
        self.num_attention_heads = cfg.n_heads
        self.max_position_embeddings = cfg.max_seq_len
        self.use_cache = kwargs.pop("use_cache", True)
        super().__init__(**kwargs)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.phaseloop)


class PhaseloopCache:
    """One phaseloop ``KVCache`` per left-padding length (see the module docstring).

    ``groups``: pad -> (row indices [R], KVCache); ``seen``: columns consumed so far."""

    is_compileable = False
    is_croppable = False

    def __init__(self):
        self.groups: dict[int, tuple[torch.Tensor, KVCache]] = {}
        self.seen = 0

    @property
    def is_linear(self) -> list[bool]:  # generate() asks on a cache passed back in
        return [False]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row r continues from row beam_idx[r] (always a row of its group)."""
        for pad, (rows, kv) in self.groups.items():
            where = {int(r): i for i, r in enumerate(rows.tolist())}
            local = torch.tensor([where[int(s)] for s in beam_idx[rows].tolist()], device=rows.device)
            kv.select_rows(local)


def _pads(attention_mask: torch.Tensor | None, B: int, S: int) -> list[int]:
    """Left padding per row; refuses any other mask."""
    if attention_mask is None:
        return [0] * B
    if attention_mask.shape != (B, S):
        raise ConfigError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, S)} "
                          "(a 2-D mask over the whole sequence so far)")
    m = attention_mask.bool()
    pads = (~m).cumprod(1).sum(1)  # leading zeros
    if bool((m.sum(1) + pads != S).any()):
        raise ConfigError("attention_mask has padding that is not on the left; pad on the left "
                          "(tokenizer.padding_side = 'left'), or on the right without a mask")
    return pads.tolist()


class PhaseloopForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = PhaseloopConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # the cache cannot be cropped: no assisted decoding
    _supports_sdpa = True

    def __init__(self, config: PhaseloopConfig):
        super().__init__(config)
        self.model = DecoderLM(config.model_config)
        if config.tie_word_embeddings:
            self._tied_weights_keys = {"model.head.weight": "model.embed.tok.weight"}
        self.post_init()

    @classmethod
    def from_decoder(cls, model: DecoderLM) -> "PhaseloopForCausalLM":
        """Wrap an existing DecoderLM (its weights, no copy) in eval mode."""
        with torch.device("meta"):  # the placeholder DecoderLM allocates nothing
            hf = cls(PhaseloopConfig(phaseloop=model.cfg.to_dict()))
        hf.model = model
        return hf.eval()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _init_weights(self, module):
        """DecoderLM initialises its own parameters; after a load (built on the meta
        device) only the derived, non-persistent buffers need their values."""
        if isinstance(module, DerivedBuffers):
            module.reset_buffers()

    def get_input_embeddings(self):
        return self.model.embed.tok

    def set_input_embeddings(self, value):
        self.model.embed.tok = value

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value):
        self.model.head = value

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None,
                                      attention_mask=None, **kwargs):
        """The new tokens only once a cache holds the rest (``cache.seen`` columns)."""
        if cache is not None and cache.seen:
            input_ids = input_ids[:, cache.seen:]
        out = {"input_ids": input_ids, "cache": cache, "attention_mask": attention_mask,
               "use_cache": kwargs.get("use_cache", True)}
        return out

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                cache: PhaseloopCache | None = None, use_cache: bool | None = None,
                labels: torch.LongTensor | None = None, return_dict: bool | None = None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = PhaseloopCache()
        B, T = input_ids.shape
        seen = cache.seen if cache is not None else 0
        pads = _pads(attention_mask, B, seen + T)
        if cache is not None and not cache.groups:
            for p in sorted(set(pads)):
                rows = torch.tensor([b for b in range(B) if pads[b] == p], device=input_ids.device)
                cache.groups[p] = (rows, KVCache())
        groups = cache.groups.items() if cache is not None else \
            ((p, (torch.tensor([b for b in range(B) if pads[b] == p], device=input_ids.device), None))
             for p in sorted(set(pads)))
        logits = None
        for p, (rows, kv) in groups:
            lo = max(p - seen, 0)  # this call's first real column of these rows
            if lo >= T:
                continue
            ids = input_ids if len(rows) == B else input_ids[rows]
            out = self.model(ids[:, lo:], cache=kv)
            if len(rows) == B and lo == 0:
                logits = out.logits
                break
            if logits is None:
                logits = out.logits.new_zeros(B, T, out.logits.shape[-1])
            logits[rows, lo:] = out.logits
        if cache is not None:
            cache.seen += T
        loss = None
        if labels is not None:  # transformers' convention: labels = input_ids, shifted here
            shift = labels[:, 1:].clone()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), shift.flatten(), ignore_index=-100)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)


AutoConfig.register("phaseloop", PhaseloopConfig, exist_ok=True)
AutoModelForCausalLM.register(PhaseloopConfig, PhaseloopForCausalLM, exist_ok=True)
