"""Model configuration: the core every architecture shares, plus each architecture's own
option groups (``registry``), in one validated object, and the presets.

``ModelConfig`` holds the fields of the shared skeleton and block (below); the fields of
an architecture's option groups (the 3PT phases, the loop split, the UT steps and ACT,
...) are read and written as if they were its own (``cfg.n_loops``) and are serialised
flat beside the core (``to_dict``), so every config.json and preset is one flat table.
A field of a group the chosen architecture does not carry is refused unless it holds
the group's default (it would be silently ignored); read, it gives that default.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, fields
from typing import Any

from phaseloop import registry
from phaseloop.errors import ConfigError
from phaseloop.validation import (  # noqa: F401
    MAX_DEPTH,
    MAX_INT,
    MAX_LAYERS,
    MAX_SEED,
    MAX_SEQ_LEN,
    check_ints,
    check_types,
    union_args,
)


def _fail(name: str, value: Any, why: str) -> None:
    raise ConfigError.invalid(f"{name}={value!r}: {why}")


def fail(name: str, value: Any, why: str) -> None:
    """The one-line error of an invalid field (for the option groups' ``validate``)."""
    _fail(name, value, why)


def _defaults(cls) -> dict:
    return {f.name: f.default for f in fields(cls)}


def _nullable(cls) -> set[str]:
    """The fields of a dataclass whose annotation allows None (None means "derived")."""
    import typing

    return {n for n, tp in typing.get_type_hints(cls).items() if type(None) in union_args(tp)}


def merged(*layers: dict) -> dict:
    """Field tables, each over the ones before; the layer count is one field under either
    of its names (``n_layers`` or an arch's ``ArchSpec.layers_name``), so a later layer
    that names it replaces an earlier one's however each spelt it."""
    names = {"n_layers", *registry.layer_names()}
    out: dict = {}
    for d in layers:
        if names & set(d):
            for n in names:
                out.pop(n, None)
        out.update(d)
    return out


@dataclass(init=False, eq=False, repr=False)
class ModelConfig:
    """Decoder-only LM configuration; ``arch`` defaults to the registry's baseline (the
    Llama-style decoder). ``ModelConfig(arch=..., **fields)`` takes core and option-group
    fields alike; an architecture's ``ArchSpec.defaults`` replace the defaults below."""

    arch: str = None  # type: ignore[assignment]  # None -> registry.default_arch()
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4  # what it counts is the architecture's: ArchSpec.layers, and its name
    # in config.json / --set is ArchSpec.layers_name (looped archs: n_unique_layers)
    n_heads: int = 4
    n_kv_heads: int | None = None  # None -> n_heads (plain multi-head attention)
    d_ff: int | None = None  # None -> 8/3 * d_model rounded up to 32 (SwiGLU); 4 * d_model (relu)
    max_seq_len: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0
    tie_embeddings: bool = False
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model)
    embed_init_std: float = 0.02  # the 3PT paper's baseline uses PyTorch's default N(0, 1)
    init_std: float = 0.02  # residual projections get init_std / sqrt(2 * depth); under init=torch it
    # still sets the hyper-connections' W and ACT's halting unit (the other Linears take torch's default)
    init: str = "normal"  # linear layers: normal (N(0, init_std)) | torch (nn.Linear's default)
    use_rope: bool = True  # False drops RoPE (e.g. the published UT: its sinusoids only)
    # The shared block (layers.py); the published UT / Transformer switch all three on.
    ffn: str = "swiglu"  # transition: swiglu (Shazeer 2020) | relu (max(0, xW1+b1)W2+b2, Vaswani)
    norm: str = "rms"  # every norm site: rms (RMSNorm, gain) | layer (LayerNorm, gain + bias)
    bias: bool = False  # biases on the attention (q, kv, o) and FFN projections

    def __init__(self, arch: str | None = None, **kw: Any) -> None:
        if arch is not None and not isinstance(arch, str):
            _fail("arch", arch, "must be a string naming a registered architecture")
        spec = registry.get_arch(registry.default_arch() if arch is None else arch)
        kw = _layers_by_name(spec, kw)
        groups = registry.groups_of(spec)
        core = _defaults(ModelConfig)
        own = {name: g for g in groups for name in _defaults(g)}
        foreign = {name: g for g in registry.all_groups() if g not in groups for name in _defaults(g)}
        unknown = sorted(set(kw) - set(core) - set(own) - set(foreign))
        if unknown:
            known = sorted([*core, *own, *foreign, *registry.layer_names()])
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError.invalid(f"unknown field(s) {', '.join(unknown)}{hint}; "
                              f"known fields: {', '.join(known)}")
        for name, value in kw.items():  # another arch's option: it would be silently ignored
            if name in foreign and value != _defaults(foreign[name])[name]:
                users = ", ".join(registry.users_of(foreign[name]))
                _fail(name, value, f"has no effect with arch={spec.name!r}; drop it or pick an arch "
                      f"that uses it ({users})")
        # None means "derived" where a field allows it; elsewhere check_types refuses it
        nullable = _nullable(ModelConfig).union(*(_nullable(g) for g in groups))
        given = {k: v for k, v in kw.items() if k not in foreign and not (v is None and k in nullable)}
        values = {**core, **spec.defaults, **given, "arch": spec.name}
        for name in core:
            object.__setattr__(self, name, values[name])
        object.__setattr__(self, "_given", frozenset(given))
        object.__setattr__(self, "_groups", {})
        for g in groups:
            inst = g(**{k: values[k] for k in _defaults(g) if k in values})
            object.__setattr__(inst, "_cfg", self)
            self._groups[g] = inst
        check_types(self, "config")
        for inst in self._groups.values():
            check_types(inst, "config")
        object.__setattr__(self, "_derived", frozenset(n for n in ("n_kv_heads", "d_ff") if getattr(self, n) is None))
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)  # derived: not "given"
        if self.d_ff is None:  # 4d for the ReLU FFN (Vaswani), 8/3 d for SwiGLU (same params)
            object.__setattr__(self, "d_ff", 4 * self.d_model if self.ffn == "relu"
                               else 32 * math.ceil(8 * self.d_model / 3 / 32))
        self.validate()

    # ------------------------------------------------------------------ option fields
    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name == self.spec.layers_name:  # e.g. cfg.n_unique_layers of a looped arch
            return self.n_layers
        for inst in self.__dict__.get("_groups", {}).values():
            if name in inst.__dataclass_fields__ or hasattr(type(inst), name):
                return getattr(inst, name)
        for g in registry.all_groups():  # a group this arch does not carry reads as its default
            if name in g.__dataclass_fields__ or hasattr(g, name):
                inst = g()
                object.__setattr__(inst, "_cfg", self)
                return getattr(inst, name)
        raise AttributeError(f"ModelConfig has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        """An assigned field counts as given (copies, pickles and replace() keep it): the
        config is built again from its given fields and this one (``replace``), so the value
        is checked as at construction (a one-line ConfigError, the config unchanged) and the
        derived fields (d_ff, n_kv_heads) follow it as they do in a copy. A field of an option
        group this arch does not carry, or no field at all, is refused."""
        if name.startswith("_") or "_groups" not in self.__dict__:  # plain attributes; __init__
            object.__setattr__(self, name, value)
            return
        if name == self.spec.layers_name:
            name = "n_layers"
        if name == "arch":
            raise ConfigError.invalid("arch: an architecture is chosen when a config is built; "
                              "use replace(arch=...)")
        if name not in self.__dataclass_fields__ and not any(name in g.__dataclass_fields__
                                                                 for g in self._groups.values()):
            raise ConfigError.invalid(f"{name}: not a field of arch={self.arch!r} "
                              "(phaseloop archs lists its options); use replace() to change the arch")
        self._adopt(self.replace(**{name: value}))

    def _adopt(self, other: ModelConfig) -> None:
        """Take ``other``'s fields (same arch) in place."""
        for f in fields(ModelConfig):
            object.__setattr__(self, f.name, getattr(other, f.name))
        object.__setattr__(self, "_given", other._given)
        object.__setattr__(self, "_derived", other._derived)
        for inst in other._groups.values():
            object.__setattr__(inst, "_cfg", self)
        object.__setattr__(self, "_groups", other._groups)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ModelConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, like a dataclass with eq

    def __repr__(self) -> str:
        return f"ModelConfig({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __getstate__(self) -> dict:  # copy / pickle: the explicit fields, derived again
        return self._explicit()

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def spec(self) -> registry.ArchSpec:
        return registry.get_arch(self.arch)

    @classmethod
    def field_names(cls, load: bool = True) -> list[str]:
        """Every field a config can hold: the core, then every registered option group's (and
        the architectures' own names of n_layers)."""
        return [*_defaults(cls), *(n for g in registry.all_groups(load) for n in _defaults(g)),
                *registry.layer_names(load)]

    @classmethod
    def default_of(cls, name: str) -> Any:
        """The plain default of a field (before any architecture's defaults)."""
        for c in (cls, *registry.all_groups()):
            if name in c.__dataclass_fields__:
                return c.__dataclass_fields__[name].default
        raise KeyError(name)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        check_ints(self, ("vocab_size", "d_model", self.spec.layers_name, "n_heads", "n_kv_heads",
                          "d_ff", "max_seq_len"), "config")
        if self.n_layers > MAX_LAYERS:  # refused before anything is built (params, train, compare, tasks)
            _fail(self.spec.layers_name, self.n_layers, f"at most {MAX_LAYERS} layers: a model is built layer "
                  "by layer (on the meta device too, to count it), so more take minutes before anything "
                  "runs, and no device trains them; use fewer")
        if self.max_seq_len > MAX_SEQ_LEN:
            _fail("max_seq_len", self.max_seq_len, f"at most {MAX_SEQ_LEN:,} (2^24) positions: the T x T "
                  "attention scores of a longer context overflow torch's tensor sizes; use fewer")
        if self.d_model % self.n_heads:
            _fail("n_heads", self.n_heads, f"must divide d_model={self.d_model}")
        if self.head_dim % 2 and self.use_rope:  # rotations act on pairs of dims; without RoPE any head dim works
            _fail("n_heads", self.n_heads,
                  f"head dim d_model/n_heads={self.head_dim} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            _fail("n_kv_heads", self.n_kv_heads, f"must divide n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            _fail("dropout", self.dropout, "must be in [0, 1)")
        for name in ("rope_base", "norm_eps", "embed_init_std", "init_std"):
            if not getattr(self, name) > 0:
                _fail(name, getattr(self, name), "must be > 0")
        if self.init not in ("normal", "torch"):
            _fail("init", self.init, "choose normal (N(0, init_std), residual projections scaled) "
                  "or torch (PyTorch's nn.Linear default, U(±1/sqrt(fan_in)))")
        if self.ffn not in ("swiglu", "relu"):
            _fail("ffn", self.ffn, "choose swiglu or relu")
        if self.norm not in ("rms", "layer"):
            _fail("norm", self.norm, "choose rms or layer")
        for inst in self._groups.values():
            if hasattr(inst, "validate"):
                inst.validate(self)

    # ------------------------------------------------------------------ helpers
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        """Flat: the core fields (n_layers under the arch's name for it), then the fields of
        the option groups this arch carries."""
        name = self.spec.layers_name
        d = {(name if f.name == "n_layers" else f.name): getattr(self, f.name) for f in fields(ModelConfig)}
        for inst in self._groups.values():
            d.update(dataclasses.asdict(inst))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        if not isinstance(d, dict) or not all(isinstance(k, str) for k in d):
            raise ConfigError.invalid(f"expected a table of fields, got {type(d).__name__}")
        return cls(**d)

    def replace(self, **overrides) -> ModelConfig:
        """The config built from this one's explicit fields plus ``overrides``: values that
        were derived (d_ff, n_kv_heads, the architecture's defaults) are derived again."""
        return ModelConfig(**merged(self._explicit(), overrides))

    def derived(self) -> set[str]:
        """The core fields whose value was derived from others (d_ff, n_kv_heads left None)."""
        return set(self._derived)

    def _explicit(self) -> dict:
        """The fields given explicitly (core names), from which the rest is derived."""
        d = {f.name: getattr(self, f.name) for f in fields(ModelConfig)}
        for inst in self._groups.values():
            d.update(dataclasses.asdict(inst))
        return {k: v for k, v in d.items() if k in self._given or k == "arch"}

    @classmethod
    def from_preset(cls, name: str, **overrides) -> ModelConfig:
        registry.arch_names()  # a plugin's presets are known once it is loaded
        if name not in PRESETS:
            close = difflib.get_close_matches(name, list(PRESETS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown preset {name!r}{hint}; available: {', '.join(PRESETS)}")
        return cls.from_dict(merged(PRESETS[name], overrides))


def _layers_by_name(spec, kw: dict) -> dict:
    """n_layers given under the arch's own name for it (``ArchSpec.layers_name``), which
    must then not disagree with an n_layers given too; another arch's name is refused."""
    kw = dict(kw)
    for name, archs in registry.layer_names().items():
        if name not in kw:
            continue
        if name != spec.layers_name:
            _fail(name, kw[name], f"is the layer count of {', '.join(archs)}; arch={spec.name!r} "
                  f"counts {spec.layers} as {spec.layers_name}")
        value = kw.pop(name)
        if kw.get("n_layers", value) != value:
            _fail(name, value, f"and n_layers={kw['n_layers']!r} name the same count; give one")
        kw["n_layers"] = value
    return kw


# Core fields that leave the function of given weights as it is: positions are computed
# (RoPE; an architecture with learned positions changes a shape instead), dropout acts in
# training only, and the init fields set values the weights replace. Option groups say
# the same of theirs (``same_function``, registry.same_function_fields).
SAME_FUNCTION = ("max_seq_len", "dropout", "init", "init_std", "embed_init_std")


def same_function_fields(cfg: ModelConfig) -> set[str]:
    """The fields of ``cfg`` whose value leaves the function of given weights as it is."""
    return {*SAME_FUNCTION, *registry.same_function_fields(cfg.spec)}


registry.reserve([f.name for f in fields(ModelConfig)], dir(ModelConfig))
PRESETS = registry.PRESETS  # name -> ModelConfig fields; each architecture adds its own
register_presets = registry.register_presets
