"""``transformers`` classes around phaseloop's own model (no second implementation).

``PhaseloopConfig`` (``configuration.py``) carries the whole ``ModelConfig``;
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
Under torch.export / torch.compile (no cache) the batch runs at once instead, each row
rotated to start at position 0 (``_forward_batch``): no data-dependent branch.

What transformers asks of a model and these models cannot mean the same way
(``output_attentions``, ``output_hidden_states``, other ``position_ids``, generate's
``cache_implementation``) is refused with a ConfigError naming the reason, never ignored
(docs/hf.md).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from phaseloop.depth import depth_setting, set_model_depth
from phaseloop.errors import ConfigError
from phaseloop.hf.configuration import PhaseloopConfig
from phaseloop.layers import KVCache
from phaseloop.model import DecoderLM
from phaseloop.quant.packed import PackedLinear
from phaseloop.trunk import DerivedBuffers


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
        for _pad, (rows, kv) in self.groups.items():
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


# generate's own bookkeeping in the model kwargs (the cache's ``seen`` says the same)
GENERATE_STATE = ("is_first_iteration", "cache_position")


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


def _refuse(name: str, why: str):
    raise ConfigError(f"{name} is not supported by PhaseloopForCausalLM: {why}")


class PhaseloopForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = PhaseloopConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True  # the cache cannot be cropped: no assisted decoding
    _supports_sdpa = True
    accepts_loss_kwargs = False  # transformers.Trainer: the loss is the model's own (mean, + ACT's ponder cost)

    def __init__(self, config: PhaseloopConfig):
        super().__init__(config)
        self.model = DecoderLM(config.model_config)
        self.apply_depth()
        if config.tie_word_embeddings:
            self._tied_weights_keys = {"model.head.weight": "model.embed.tok.weight"}
        self._built = True  # DecoderLM initialised itself: post_init has nothing to add
        self.post_init()
        self._built = False

    def apply_depth(self) -> None:
        """Run the trunk at ``config.phaseloop_depth`` (set by ``export --depth``)."""
        if getattr(self.config, "phaseloop_depth", None) is not None:

            set_model_depth(self.model, self.config.phaseloop_depth,
                            getattr(self.config, "phaseloop_extend_loops", None))

    def save_pretrained(self, *args, **kwargs):
        """Refused on packed ``--quantized`` weights: their codes would be written under names no
        loader maps back (the folder reloaded with random layers); ``push_to_hub`` calls this too.
        Refused too while the trunk runs an exit rule or a shared KV cache, which the folder
        does not record: reloaded, it would compute another function."""
        if any(isinstance(m, PackedLinear) for m in self.modules()):
            _refuse("save_pretrained on packed --quantized weights", "their int8/int4 codes are not weights a "
                    "loader reads back; `phaseloop export RUN --quantized FILE` writes the model they compute")
        trunk = getattr(self.model, "trunk", None)
        for attr, how in (("exits", "early_exit.set_exit(model, None)"), ("kv_share", "set_kv_share(model, None)")):
            if getattr(trunk, attr, None) is not None:
                _refuse(f"save_pretrained with the trunk's {attr} set", "a saved folder does not record it, so "
                        f"the model reloaded would compute another function; clear it ({how}) before saving")
        return super().save_pretrained(*args, **kwargs)

    @classmethod
    def from_decoder(cls, model: DecoderLM) -> PhaseloopForCausalLM:
        """Wrap an existing DecoderLM (its weights, no copy) in eval mode, at the depth it runs
        at (``config.phaseloop_depth``, so a saved folder reloads at that depth too)."""
        depth, extend = depth_setting(model)
        with torch.device("meta"):  # the placeholder DecoderLM allocates nothing
            hf = cls(PhaseloopConfig(phaseloop=model.cfg.to_dict(), phaseloop_depth=depth,
                                     phaseloop_extend_loops=extend))
        hf.model = model
        return hf.eval()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _validate_generation_mode(self, generation_mode, *args, **kwargs):
        """Assisted and prompt-lookup decoding are refused here, in every transformers version:
        they crop the cache back to the accepted tokens, and this one cannot be cropped (one
        KVCache per padding length; under UT+ACT the halted positions' step inputs).
        transformers up to 5.24 refused stateful models itself; 5.25 no longer does."""
        if str(getattr(generation_mode, "value", generation_mode)) == "assisted_generation":
            _refuse("assisted generation (assistant_model, prompt_lookup_num_tokens)",
                    "its cache cannot be cropped back to the accepted tokens (a stateful model); "
                    "phaseloop's own speculative decoding is `phaseloop generate --speculative D`")
        return super()._validate_generation_mode(generation_mode, *args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, *args, **kwargs):
        """``cache_implementation`` (static, offloaded, quantized, ...) is refused, not left
        to transformers' one-time "will be ignored" warning: the cache is phaseloop's own
        (``PhaseloopCache``, module docstring), made by ``forward``."""
        if generation_config.cache_implementation is not None:
            _refuse(f"cache_implementation={generation_config.cache_implementation!r}",
                    "the cache is phaseloop's own (one KVCache per left-padding length, a slot per "
                    "application of an attention layer), not a transformers Cache; leave it unset")
        return super()._prepare_cache_for_generation(generation_config, *args, **kwargs)

    def initialize_weights(self):
        self.__dict__["_initializing"] = True
        try:
            super().initialize_weights()
        finally:
            self.__dict__.pop("_initializing", None)
            self.__dict__.pop("_fresh", None)

    def _init_weights(self, module):
        """Parameters transformers reports missing (a partial checkpoint,
        ``ignore_mismatched_sizes``) get phaseloop's own initialisation, whatever the
        architecture: copied from a freshly built ``DecoderLM`` of the same config (on the
        CPU; built once per ``initialize_weights``). Derived, non-persistent buffers are
        recomputed. Parameters transformers marks loaded are kept."""
        if isinstance(module, DerivedBuffers):
            module.reset_buffers()
        if getattr(self, "_built", False):
            return
        todo = [(n, p) for n, p in module.named_parameters(recurse=False)
                if not getattr(p, "_is_hf_initialized", False) and p.device.type != "meta"]
        if not todo:
            return
        cached = self.__dict__.get("_fresh")
        names = cached[1] if cached else {id(m): n for n, m in self.named_modules()}
        name = names.get(id(module))
        if name is None or not (name == "model" or name.startswith("model.")):
            return  # not (yet) part of this model: e.g. resize_token_embeddings' new module
        if cached is None:
            with torch.device("cpu"):
                cached = (dict(DecoderLM(self.config.model_config).named_modules()), names)
            if self.__dict__.get("_initializing"):
                self.__dict__["_fresh"] = cached
        src = cached[0].get(name[len("model."):] if name != "model" else "")
        with torch.no_grad():
            for n, p in todo:
                q = getattr(src, n, None) if src is not None else None
                if q is not None and q.shape == p.shape:
                    p.copy_(q.to(p.dtype))

    def get_input_embeddings(self):
        return self.model.embed.tok

    def set_input_embeddings(self, value):
        self.model.embed.tok = value

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value):
        self.model.head = value

    def resize_token_embeddings(self, *args, **kwargs):
        """transformers' resize, then ``config.phaseloop`` follows (save/load round trips)."""
        out = super().resize_token_embeddings(*args, **kwargs)
        self.model.cfg = self.config.model_config
        return out

    def prepare_inputs_for_generation(self, input_ids, next_sequence_length=None, cache=None,
                                      attention_mask=None, inputs_embeds=None, **kwargs):
        """The new tokens only once a cache holds the rest (``cache.seen`` columns). With
        ``inputs_embeds`` (generate's prompt as vectors, E columns) the sequence so far is
        the E prompt vectors then the G generated tokens, which are the last G of
        ``input_ids`` (generate passes the prompt's ids too when it was given them, else
        the generated ones only); G = the sequence's length (the mask's or the
        position_ids' columns) - E. The columns not yet consumed are taken from both. Other
        keyword arguments go to ``forward``, which supports or refuses each."""
        seen = cache.seen if cache is not None else 0
        first = kwargs.get("is_first_iteration")
        out = {k: v for k, v in kwargs.items() if v is not None and k not in GENERATE_STATE}
        out.update(cache=cache, attention_mask=attention_mask, use_cache=kwargs.get("use_cache", True))
        E = inputs_embeds.shape[1] if inputs_embeds is not None else 0
        if E:
            pos = out.get("position_ids")
            N = (attention_mask.shape[1] if attention_mask is not None else pos.shape[-1] if pos is not None
                 else E if first else E + input_ids.shape[1])
            input_ids = input_ids[:, input_ids.shape[1] - (N - E):]  # the generated tokens
        if E > seen:
            emb = inputs_embeds[:, seen:]
            if input_ids.shape[1]:
                emb = torch.cat([emb, self.get_input_embeddings()(input_ids)], 1)
            out["inputs_embeds"] = emb
        else:
            out["input_ids"] = input_ids[:, seen - E:]
        if out.get("position_ids") is not None:  # generate keeps them for every column so far
            out["position_ids"] = out["position_ids"][..., seen:]
        return out

    def forward(self, input_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None,
                cache: PhaseloopCache | None = None, use_cache: bool | None = None,
                labels: torch.LongTensor | None = None, return_dict: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, inputs_embeds: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, output_attentions: bool | None = None,
                output_hidden_states: bool | None = None, **kwargs):
        """``labels``: the loss is phaseloop's own (cross-entropy of the shifted labels,
        -100 ignored, plus the auxiliary losses: ACT's ponder cost). A left-padded batch
        runs as one sub-batch per padding length (each exactly as those rows alone); under
        torch.export / torch.compile (no cache: ``use_cache`` is off while tracing) as one
        batch, each row rotated to start at position 0. Refused, each with a ConfigError naming why:
        ``output_attentions`` / ``output_hidden_states`` (True), ``position_ids`` other
        than the tokens' own positions, masks with padding not on the left, any other
        keyword argument."""
        if kwargs:
            raise TypeError(f"PhaseloopForCausalLM.forward() got unsupported keyword argument(s) "
                            f"{', '.join(sorted(kwargs))}")
        if output_attentions or (output_attentions is None and self.config.output_attentions):
            _refuse("output_attentions", "attention runs in fused SDPA kernels, which return no "
                    "weights, and looped or universal trunks apply a layer several times")
        if output_hidden_states or (output_hidden_states is None and self.config.output_hidden_states):
            _refuse("output_hidden_states", "the trunks have no common per-layer state (a looped "
                    "trunk applies a layer several times, Hyperloop / mHC carry several "
                    "streams, UT+ACT halts per position)")
        if (input_ids is None) == (inputs_embeds is None):
            raise ConfigError("pass exactly one of input_ids and inputs_embeds")
        x = input_ids if inputs_embeds is None else inputs_embeds
        return_dict = self.config.return_dict if return_dict is None else return_dict
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None and not (self.training or _tracing()):
            cache = PhaseloopCache()
        B, T = x.shape[:2]
        seen = cache.seen if cache is not None else 0
        if position_ids is not None:
            self._check_positions(position_ids, attention_mask, B, seen, T)
        aux: dict = {}
        if cache is None and (attention_mask is None or _tracing()):
            logits = self._forward_batch(input_ids, inputs_embeds, attention_mask, aux)
        else:
            logits = self._forward_groups(input_ids, inputs_embeds, attention_mask, cache, aux)
        if cache is not None:
            cache.seen += T
        loss = None
        if labels is not None:  # transformers' convention: labels = input_ids, shifted here
            shift = labels[:, 1:]
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), shift.flatten(), ignore_index=-100)
            loss = loss + sum(aux.values())
        if isinstance(logits_to_keep, int):
            if logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        else:
            logits = logits[:, logits_to_keep]
        out = CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)
        return out if return_dict else out.to_tuple()

    def _check_positions(self, position_ids, attention_mask, B, seen, T):
        """position_ids are accepted when they are the tokens' own positions (counted from
        each row's first real token); phaseloop computes them itself."""
        if _tracing():
            return
        if attention_mask is None:
            want = torch.arange(seen, seen + T, device=position_ids.device).expand(B, T)
            real = torch.ones(B, T, dtype=torch.bool, device=position_ids.device)
        else:
            m = attention_mask.long()
            want = (m.cumsum(-1) - 1)[:, -T:]
            real = m[:, -T:].bool()
        if position_ids.shape[-1] != T or not bool((position_ids.expand(B, T) == want)[real].all()):
            _refuse("position_ids other than the tokens' positions", "RoPE, the 3PT horn and UT's "
                    "coordinate signal read each token's position from the sequence itself (rows "
                    "start at position 0 after their left padding)")

    def _forward_batch(self, input_ids, inputs_embeds, attention_mask, aux):
        """No cache, no mask, or a mask under torch.export / torch.compile: the whole batch
        at once. A left-padded row is rotated so that its tokens start at position 0 (its
        padding moves to the end, where causal attention keeps it out of every real
        token's view), then rotated back; pad positions get logits 0. The same function as
        one sub-batch per padding length (``_forward_groups``, the eager path) up to
        float rounding of a longer batch; traceable: no data-dependent branch, no
        ``.tolist()`` (the left-padding check is skipped under tracing)."""
        if attention_mask is None:
            out = self.model(input_ids, embeds_BTD=inputs_embeds)
            aux.update(out.aux_losses)
            return out.logits
        x = input_ids if inputs_embeds is None else inputs_embeds
        B, S = x.shape[:2]
        if attention_mask.shape != (B, S):
            raise ConfigError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected "
                              f"{(B, S)} (a 2-D mask over the whole sequence so far)")
        if not _tracing():
            _pads(attention_mask, B, S)  # refuses padding that is not on the left
        m = attention_mask.bool()
        pads = S - m.long().sum(1, keepdim=True)  # [B, 1]
        cols = torch.arange(S, device=x.device).unsqueeze(0)
        fwd = (cols + pads) % S  # row b's column j <- original column (j + pad) mod S
        back = (cols - pads) % S
        if inputs_embeds is None:
            out = self.model(input_ids.gather(1, fwd))
        else:
            idx = fwd.unsqueeze(-1).expand(-1, -1, inputs_embeds.shape[-1])
            out = self.model(None, embeds_BTD=inputs_embeds.gather(1, idx))
        aux.update(out.aux_losses)
        logits = out.logits.gather(1, back.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1]))
        return logits * m.unsqueeze(-1).to(logits.dtype)

    def _forward_groups(self, input_ids, inputs_embeds, attention_mask, cache, aux):
        """One sub-batch per left-padding length (with a cache: one KVCache each), each
        exactly as those rows alone: the eager path of a padded batch."""
        x = input_ids if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        seen = cache.seen if cache is not None else 0
        pads = _pads(attention_mask, B, seen + T)
        groups = cache.groups if cache is not None else {}
        if not groups:
            for p in sorted(set(pads)):
                rows = torch.tensor([b for b in range(B) if pads[b] == p], device=x.device)
                groups[p] = (rows, KVCache() if cache is not None else None)
        logits = None
        for p, (rows, kv) in groups.items():
            lo = max(p - seen, 0)  # this call's first real column of these rows
            if lo >= T:
                continue
            sub = x if len(rows) == B else x[rows]
            if inputs_embeds is None:
                out = self.model(sub[:, lo:], cache=kv)
            else:
                out = self.model(None, cache=kv, embeds_BTD=sub[:, lo:])
            for k, v in out.aux_losses.items():  # weighted by the group's share of rows
                aux[k] = aux.get(k, 0) + v * (len(rows) / B)
            if len(rows) == B and lo == 0:
                return out.logits
            if logits is None:
                logits = out.logits.new_zeros(B, T, out.logits.shape[-1])
            logits[rows, lo:] = out.logits
        return logits


AutoConfig.register("phaseloop", PhaseloopConfig, exist_ok=True)
AutoModelForCausalLM.register(PhaseloopConfig, PhaseloopForCausalLM, exist_ok=True)
