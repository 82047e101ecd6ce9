"""The architecture registry: the one place that knows which architectures exist.

An architecture is a plugin: one ``ArchSpec`` given to ``register_arch``. The built-in
ones register on import (``archs/``: ``rope.py``, ``three_phase.py``, ``universal.py``,
``hyperloop.py``); a third-party package adds an entry point to the group
``phaseloop.architectures`` (docs/extending.md), loaded the first time the registry is
asked about an architecture it does not hold, or for the full list. ``ModelConfig``, the
model skeleton, the CLI, ``compare``, the task runner and the exporters ask the registry;
none of them names an architecture.

Options: a plugin's own fields are *option groups*, small dataclasses with their own
defaults and checks (``validate(self, cfg)``); an arch lists the groups it uses
(``ArchSpec.options``), and ``register_options(cls)`` adds a group that composes with
every architecture (3PT's phase structure).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from phaseloop.errors import ConfigError

ENTRY_POINT_GROUP = "phaseloop.architectures"


@dataclass(frozen=True)
class ArchSpec:
    """Everything phaseloop needs to know about one architecture."""

    name: str  # the value of ModelConfig.arch
    trunk: Callable  # trunk class: trunk(cfg) -> a ``trunk.Trunk``
    options: tuple[type, ...] = ()  # option groups only this arch (and others listing them) use
    defaults: Mapping[str, Any] = field(default_factory=dict)  # field values this arch changes
    presets: Mapping[str, dict] = field(default_factory=dict)  # name -> fields (arch filled in)
    layers: str = "distinct layers, applied once each"  # what the layer count counts
    # the name under which this arch's layer count (ModelConfig.n_layers) is written and
    # read; "n_layers" is accepted too (what 0.1 wrote)
    layers_name: str = "n_layers"
    paper: str = ""  # the citation, for listings
    # comparison recipes: other spellings of the arch, the "<prefix>-<scale>" preset names an
    # alias picks (default: the name), and "+modifier" -> field overrides
    aliases: tuple[str, ...] = ()
    preset_prefixes: tuple[str, ...] = ()
    modifiers: Mapping[str, dict] = field(default_factory=dict)
    shrink: Callable | None = None  # dry run: cfg -> overrides for a CPU-test size of this arch
    # task runs: the encoder-decoder of this arch (class(cfg, pad_id=...)) under --arch NAME
    seq2seq: Callable | None = None
    seq2seq_name: str | None = None
    seq2seq_defaults: Callable | None = None  # d_model -> fields its task seq2seq preset needs
    task_offsets: bool = False  # --paper task runs train with random position offsets (UT §4)
    default: bool = False  # the architecture of ModelConfig() (one built-in baseline)
    default_preset: str | None = None  # the preset of `phaseloop train` without --preset
    # its own subcommands (3PT: angles): "module:function" (or the function), called as
    # function(subparsers) when the CLI builds its parser; the arch file imports no CLI code
    commands: str | Callable | None = None
    # diagnostics(model, stats) -> {name: float}: its own quantities, logged at evaluation steps
    # (``stats``: name -> every process's tensor of the last training micro-batch's
    # ModelOutput.stats; the model's parameters whole); an option group may define the same
    # as a staticmethod ``diagnostics`` (3PT's angles, on any trunk)
    diagnostics: Callable | None = None
    # probe(model, recording) -> {name: JSON-able}: what explore's Inside page shows of this
    # arch (``analysis.probe.Recording``: the streams, attention, stream mixing); an option
    # group may define the same as a staticmethod ``probe`` (3PT's stripes and angles)
    probe: Callable | None = None

    @property
    def prefixes(self) -> tuple[str, ...]:
        return self.preset_prefixes or (self.name,)


ARCHS: dict[str, ArchSpec] = {}
COMPOSABLE: list[type] = []  # option groups every architecture carries
# name -> ModelConfig fields (each names its arch); each ArchSpec adds its ``presets``
PRESETS: dict[str, dict] = {}
# ModelConfig's own field and attribute names, which no option group may reuse (config.py
# reserves them when it defines ModelConfig, before any architecture registers)
RESERVED: set[str] = set()
CORE_FIELDS: set[str] = set()
_loaded_entry_points = False
_loaded_eps: set[str] = set()  # entry points loaded (a retry after another one failed skips them)
PROVIDERS: dict[str, str] = {}  # arch -> "distribution version" of the plugin whose entry point registered it


class UnknownArch(ConfigError):
    """An architecture no installed package registers (``name``: the one asked for)."""

    def __init__(self, message: str, name: str | None = None):  # name optional: unpickles from args
        super().__init__(message)
        self.name = name


def provider(name: str) -> str | None:
    """The installed package ("distribution version") whose entry point registered arch
    ``name``; None for a built-in one or one registered by code (a notebook, a test)."""
    return PROVIDERS.get(name)


def missing_plugin(name: str, plugin: str | None = None) -> str:
    """What to install for arch ``name`` that is not registered here (``plugin``: the
    package recorded where it was trained or exported, when known)."""
    which = f"the package that registered it where it was made: {plugin}" if plugin else \
        f"a package registering {name!r} through the entry-point group {ENTRY_POINT_GROUP!r}"
    return f"install the plugin that provides arch {name!r} ({which}) where phaseloop runs, then run this again"


def reserve(core_fields, attributes) -> None:
    """ModelConfig's core fields and attributes (called once, by config.py)."""
    CORE_FIELDS.update(core_fields)
    RESERVED.update(core_fields, attributes)


def register_presets(presets: dict[str, dict]) -> None:
    """Add presets (each names its arch); an ArchSpec's ``presets`` come here too."""
    PRESETS.update(presets)


def _check_group(cls: type, replacing: ArchSpec | None = None) -> None:
    """A dataclass whose field names no other group, no ModelConfig field or attribute and no
    arch's name for its layer count holds (a spec being re-registered does not count)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"option group {cls.__name__} must be a dataclass")
    mine = {f.name for f in dataclasses.fields(cls)}
    stale = set(replacing.options) if replacing is not None else set()
    others = [*COMPOSABLE, *(g for s in ARCHS.values() for g in s.options if g not in stale)]
    for other in [o for o in others if o.__qualname__ != cls.__qualname__ or o.__module__ != cls.__module__]:
        if other is not cls and mine & {f.name for f in dataclasses.fields(other)}:
            raise TypeError(f"option group {cls.__name__} reuses fields of {other.__name__}: "
                            f"{sorted(mine & {f.name for f in dataclasses.fields(other)})}")
    clash = mine & (RESERVED | {s.layers_name for s in ARCHS.values()})
    if clash:
        raise TypeError(f"option group {cls.__name__} reuses ModelConfig names {sorted(clash)}")


def register_options(cls: type) -> type:
    """Add an option group that composes with every architecture (usable as a decorator)."""
    _check_group(cls)
    if cls not in COMPOSABLE:
        COMPOSABLE.append(cls)
    return cls


def register_arch(spec: ArchSpec, replace: bool = False) -> ArchSpec:
    """Register an architecture (its presets too). A name already registered is refused
    unless ``replace=True`` (a plugin reloaded in a notebook passes it)."""
    if not spec.name.isidentifier():
        raise ValueError(f"arch name {spec.name!r} must be an identifier (letters, digits, _)")
    if spec.name in ARCHS and not replace:
        old = ARCHS[spec.name]
        raise ValueError(f"arch {spec.name!r} is registered already (by {old.trunk.__module__}); pick "
                         "another name, or pass replace=True to register_arch to replace it")
    if spec.layers_name != "n_layers":  # its own count's name: no field of the config or of any group
        fields_ = {f.name for g in (*COMPOSABLE, *(g for s in ARCHS.values() for g in s.options), *spec.options)
                   for f in dataclasses.fields(g)}
        if not spec.layers_name.isidentifier() or spec.layers_name in RESERVED | fields_:
            raise ValueError(f"arch {spec.name!r}: layers_name {spec.layers_name!r} names a field of ModelConfig or "
                             "of an option group (or is no identifier); name the layer count otherwise")
    for group in spec.options:
        _check_group(group, replacing=ARCHS.get(spec.name))
    known = {*CORE_FIELDS, *(f.name for g in (*COMPOSABLE, *spec.options) for f in dataclasses.fields(g))}
    if set(spec.defaults) - known:
        raise ValueError(f"arch {spec.name!r}: defaults for {sorted(set(spec.defaults) - known)}, "
                         "which are not fields of ModelConfig or of its option groups")

    taken = [n for n in spec.presets if n in PRESETS and PRESETS[n].get("arch") != spec.name and not replace]
    if taken:
        raise ValueError(f"arch {spec.name!r}: preset {taken[0]!r} is {PRESETS[taken[0]].get('arch')!r}'s already; "
                         "name yours otherwise, or pass replace=True to register_arch to replace it")
    for name, fields_ in spec.presets.items():
        PRESETS[name] = {"arch": spec.name, **fields_}
    ARCHS[spec.name] = spec
    return spec


def _load_entry_points() -> None:
    """Import the third-party architectures installed in this environment (once)."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _loaded_entry_points = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.value in _loaded_eps:  # loaded before another one failed: registering again would fail
            continue
        before = set(ARCHS)
        try:  # a module registers on import; an ArchSpec or a function may be given instead
            obj = ep.load()
            if isinstance(obj, ArchSpec):
                if ARCHS.get(obj.name) is not obj:  # its module may have registered it already
                    register_arch(obj)
            elif callable(obj) and not isinstance(obj, type):
                obj()
            elif not isinstance(obj, types.ModuleType):
                raise TypeError(f"it names a {type(obj).__name__}, not a module, an ArchSpec or a function")
        except Exception as e:
            _loaded_entry_points = False  # asked again, it fails again (never half-loaded quietly)
            raise ConfigError(f"the architecture plugin {ep.name!r} ({ep.value}) failed to load: "
                              f"{type(e).__name__}: {e}; reinstall or uninstall it") from None
        _loaded_eps.add(ep.value)
        dist = getattr(ep, "dist", None)
        for name in set(ARCHS) - before if dist is not None else ():
            PROVIDERS[name] = f"{dist.metadata['Name']} {dist.version}"


def get_arch(name: str) -> ArchSpec:
    """The spec of ``name``; a one-line ConfigError listing the registered ones otherwise."""
    if name not in ARCHS:
        _load_entry_points()
    if name not in ARCHS:
        raise unknown_arch(name)
    return ARCHS[name]


def unknown_arch(name: str) -> UnknownArch:
    """The refusal of an arch no installed package registers, naming the registered ones."""
    return UnknownArch(f"invalid config: arch={name!r}: unknown architecture; registered: "
                       f"{', '.join(arch_names())} (a plugin registers through the entry-point "
                       f"group {ENTRY_POINT_GROUP!r}: pip install it)", name)


def arch_names() -> list[str]:
    _load_entry_points()
    return list(ARCHS)


def all_archs() -> list[ArchSpec]:
    _load_entry_points()
    return list(ARCHS.values())


def default_arch() -> str:
    return next(s.name for s in ARCHS.values() if s.default)


def default_preset() -> str:
    """The preset of `phaseloop train` / `params` without --preset (the baseline's)."""
    return get_arch(default_arch()).default_preset


def groups_of(spec: ArchSpec) -> list[type]:
    """The option groups a config of this arch carries: the composable ones, then its own."""
    return [*COMPOSABLE, *(g for g in spec.options if g not in COMPOSABLE)]


def layer_names(load: bool = True) -> dict[str, list[str]]:
    """Each architecture-specific name of ModelConfig.n_layers -> the archs that use it."""
    out: dict[str, list[str]] = {}
    for s in (all_archs() if load else ARCHS.values()):
        if s.layers_name != "n_layers":
            out.setdefault(s.layers_name, []).append(s.name)
    return out


def all_groups(load: bool = True) -> list[type]:
    """Every registered option group (``load=False``: without importing plugins, e.g. while
    phaseloop itself is being imported)."""
    out = list(COMPOSABLE)
    for s in (all_archs() if load else ARCHS.values()):
        out += [g for g in s.options if g not in out]
    return out


def users_of(group: type) -> list[str]:
    """The architectures that carry an option group."""
    return [s.name for s in all_archs() if group in groups_of(s)]


def by_alias(word: str) -> ArchSpec | None:
    """The arch a recipe or task word names (its name or one of its aliases)."""
    for s in all_archs():
        if word == s.name or word in s.aliases:
            return s
    return None


def modifiers() -> dict[str, dict]:
    """Every registered "+modifier" of the comparison recipes."""
    out: dict[str, dict] = {}
    for s in all_archs():
        out.update(s.modifiers)
    return out


def seq2seq_archs() -> dict[str, ArchSpec]:
    """Task-run names of the encoder-decoders (e.g. "<alias>-seq2seq") -> their arch."""
    return {s.seq2seq_name: s for s in all_archs() if s.seq2seq is not None and s.seq2seq_name}


def _hooks(model, name: str) -> list:
    """The functions named ``name`` of ``model``'s option groups (staticmethods) and of its
    spec, in that order ([] for a model without a ModelConfig, or none defined)."""
    arch = getattr(getattr(model, "cfg", None), "arch", None)
    if not isinstance(arch, str):
        return []
    spec = get_arch(arch)
    fns = (*(getattr(g, name, None) for g in groups_of(spec)), getattr(spec, name))
    return [fn for fn in fns if fn is not None]


def diagnostic_fns(model) -> list:
    """The ``diagnostics`` functions of ``model``'s option groups and spec."""
    return _hooks(model, "diagnostics")


def probe_fns(model) -> list:
    """The ``probe`` functions of ``model``'s option groups and spec."""
    return _hooks(model, "probe")


def block_options(spec: ArchSpec) -> dict:
    """switch field -> ``layers.BlockOption`` of every option group ``spec`` carries: the
    modules an option group puts into the shared block and embedding (``block_options``, a
    class attribute of the group)."""
    out: dict = {}
    for g in groups_of(spec):
        out.update(getattr(g, "block_options", {}))
    return out


def same_function_fields(spec: ArchSpec) -> set[str]:
    """The option-group fields of ``spec`` that leave the function of given weights as it
    is (``same_function``, a class attribute of a group: initial values the weights
    replace, training-only terms, how the same output is computed); ``--init-from``
    reports a change of any other field as a change of the function."""
    return {name for g in groups_of(spec) for name in getattr(g, "same_function", ())}


def commands_of(spec: ArchSpec) -> Callable | None:
    """The function adding ``spec``'s own subcommands (``ArchSpec.commands``, resolved)."""
    if spec.commands is None or callable(spec.commands):
        return spec.commands
    module, _, name = spec.commands.partition(":")
    return getattr(importlib.import_module(module), name)


def diagnostics(model, stats: dict) -> dict[str, float]:
    """The architecture's own quantities of ``model`` (``diagnostic_fns``), for the
    evaluation records; {} where it defines none."""
    out: dict[str, float] = {}
    for fn in diagnostic_fns(model):
        out.update(fn(model, stats))
    return out
