"""``PhaseloopConfig``: a transformers ``PretrainedConfig`` carrying the whole
``ModelConfig`` (``config.phaseloop``, the one source of truth), with transformers' usual
names as properties over it."""

from __future__ import annotations

from transformers import PretrainedConfig

from phaseloop import registry
from phaseloop.config import ModelConfig
from phaseloop.errors import ConfigError

# transformers' names for ModelConfig fields; num_hidden_layers is the arch's layer field
# (ArchSpec.layers_name). Properties over ``config.phaseloop``: one source of truth.
TOP_LEVEL = {"vocab_size": "vocab_size", "hidden_size": "d_model", "num_hidden_layers": None,
             "num_attention_heads": "n_heads", "max_position_embeddings": "max_seq_len"}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _field(cfg: dict, name: str) -> str:
    if TOP_LEVEL[name] is not None:
        return TOP_LEVEL[name]
    return registry.get_arch(cfg["arch"]).layers_name


class PhaseloopConfig(PretrainedConfig):
    """``phaseloop``: the whole ``ModelConfig`` (its ``to_dict``), the source of truth.
    ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` and
    ``max_position_embeddings`` read and write it (a value the architecture refuses
    raises ``ConfigError``); passed to ``__init__`` (or ``from_pretrained``) they
    override its fields. ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``: None by
    default (phaseloop models train on raw text, with no special tokens).
    ``phaseloop_arch_plugin`` (an export of a plugin's architecture: the package that
    registered it) names what to install where the plugin is missing."""

    model_type = "phaseloop"

    def __init__(self, phaseloop: dict | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 phaseloop_depth: int | None = None, phaseloop_extend_loops: str | None = None,
                 **kwargs):
        try:
            d = ModelConfig.from_dict(phaseloop or {}).to_dict()
        except registry.UnknownArch as e:  # an export of a plugin's architecture, without the plugin
            plugin = kwargs.get("phaseloop_arch_plugin")
            raise ConfigError(f"this Hugging Face folder holds a phaseloop model of arch {e.name!r}, which no "
                              "package installed here registers; "
                              + registry.missing_plugin(e.name, plugin if isinstance(plugin, str) else None)
                              .replace("run this again", "load the folder again")) from None
        # depth at inference (``Trunk.set_depth``): None = the trained depth
        if phaseloop_depth is not None or phaseloop_extend_loops is not None:
            self.phaseloop_depth, self.phaseloop_extend_loops = phaseloop_depth, phaseloop_extend_loops
        top = {k: kwargs.pop(k) for k in TOP_LEVEL if k in kwargs}
        for k, v in top.items():
            d[_field(d, k)] = v
        cfg = ModelConfig.from_dict(d)
        self.phaseloop = cfg.to_dict()
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        kwargs.setdefault("tie_word_embeddings", cfg.tie_embeddings)
        self.use_cache = kwargs.pop("use_cache", True)
        super().__init__(**kwargs)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.phaseloop)

    def to_dict(self) -> dict:
        """With the usual names (other tools read config.json: lm-eval's max length)."""
        out = super().to_dict()
        out.update({k: getattr(self, k) for k in TOP_LEVEL})
        return out


def _top_level(name: str) -> property:
    def get(self):
        return self.phaseloop[_field(self.phaseloop, name)]

    def set(self, value):
        d = dict(self.phaseloop)
        d[_field(d, name)] = value
        self.phaseloop = ModelConfig.from_dict(d).to_dict()  # refuses what the arch refuses

    return property(get, set, doc=f"``phaseloop``'s field for transformers' {name}")


for _name in TOP_LEVEL:
    setattr(PhaseloopConfig, _name, _top_level(_name))
