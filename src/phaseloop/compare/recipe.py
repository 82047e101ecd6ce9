"""Comparison recipes and variant specs: what to train (see the package docstring)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from phaseloop import registry
from phaseloop.compare.options import EvalOptions, LaunchOptions, RecipeError, Tune, check_keys, suggest
from phaseloop.config import MAX_SEED, PRESETS, ModelConfig, merged
from phaseloop.engine import TrainConfig
from phaseloop.errors import ConfigError
from phaseloop.files import parse_toml, why_missing
from phaseloop.validation import check_types

MATCH_KINDS = ("none", "params", "flops", "depth")
MATCH_BY = ("width", "depth")
# [train] fields every variant shares: the budget (equal steps and tokens, so budget
# matching and the step speedup compare like with like), the seed pairing and what the
# validation loss is measured on. A variant's own ``train`` may set any other field.
SHARED_TRAIN = ("seed", "steps", "batch_size", "grad_accum", "seq_len", "val_fraction",
                "eval_every", "eval_windows", "device")


# A variant names an architecture (its name or an alias, ``ArchSpec.aliases``), which
# picks the first "<prefix>-<scale>" preset of its ``preset_prefixes``, and "+modifiers"
# (``ArchSpec.modifiers``): all from the registry.
KEY_ALIASES = {"N": "n_phases", "L": "n_layers", "D": "d_model"}


def _example() -> str:
    return registry.default_arch()


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        low = text.lower()
        return {"true": True, "false": False}.get(low, text)


def parse_spec(spec: str) -> tuple[str, list[str], dict]:
    """'ARCH+MOD N=3' -> ('ARCH', ['MOD'], {'n_phases': 3})."""
    tokens = str(spec).split()
    if not tokens:
        raise RecipeError(f"empty variant spec; write e.g. {_example()!r} or '{_example()} d_model=64' "
                          "(phaseloop archs lists the architectures)")
    base, *mods = tokens[0].split("+")
    overrides = {}
    for tok in tokens[1:]:
        key, sep, val = tok.partition("=")
        if not sep or not key or not val:
            raise RecipeError(f"variant {spec!r}: bad token {tok!r}; write KEY=VALUE, e.g. N=3")
        overrides[KEY_ALIASES.get(key, key)] = _parse_value(val)
    return base, mods, overrides


def slugify(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "-", name.replace("=", "")).strip("-.")
    return slug or "variant"


@dataclass
class Variant:
    name: str
    spec: str
    set: dict = field(default_factory=dict)  # ModelConfig overrides applied last
    match: str | None = None  # None -> the recipe's budget
    match_to: str | None = None  # None -> the reference variant
    train: dict = field(default_factory=dict)  # this variant's TrainConfig fields over [train]
    control: str | None = None  # a second variant it is t-tested against (the report's "vs control")

    @property
    def slug(self) -> str:
        return slugify(self.name)

    @classmethod
    def from_item(cls, item, where: str) -> Variant:
        if isinstance(item, str):
            return cls(name=item, spec=item)
        if not isinstance(item, dict):
            raise RecipeError(f"{where}: a variant is a spec string or a table, got {item!r}")
        check_keys(cls, item, where, "variant key")
        if "spec" not in item:
            raise RecipeError(f"{where}: variant table needs spec = 'ARCH ...' (e.g. {_example()!r})")
        for k, what in (("set", "ModelConfig"), ("train", "TrainConfig")):
            if not isinstance(item.get(k, {}), dict):
                raise RecipeError(f"{where}: {k} must be a table of {what} fields")
        v = cls(name=str(item.get("name", item["spec"])), spec=str(item["spec"]),
                set=dict(item.get("set") or {}), match=item.get("match"),
                match_to=item.get("match_to"), train=_variant_train(item.get("train") or {}, where),
                control=item.get("control"))
        if v.match is not None and v.match not in MATCH_KINDS:
            raise RecipeError(f"{where}: match={v.match!r}; choose one of {', '.join(MATCH_KINDS)}")
        return v


def _variant_train(table, where: str) -> dict:
    """A variant's own training settings: TrainConfig fields (typos named), none of the
    shared ones (``SHARED_TRAIN``); values are checked with [train] in ``Recipe.validate``."""
    if not isinstance(table, dict):
        raise RecipeError(f"{where}: train must be a table of TrainConfig fields, e.g. "
                          "train = { lr = 3e-3, warmup_steps = 50 }")
    check_keys(TrainConfig, table, f"{where} train", "key")
    for k in table:
        if k in SHARED_TRAIN:
            raise RecipeError(f"{where} train: {k} is shared by every variant (the budget, the seeds and "
                              f"the validation split must match); set it in [train]")
    return dict(table)


def _check_spec_keys(v: Variant) -> None:
    """Refuse a variant whose KEY=VALUE or set keys are no ModelConfig field."""
    known = ModelConfig.field_names()
    base, _, overrides = parse_spec(v.spec)
    for k in [*overrides, *v.set]:
        if k not in known and base not in PRESETS and registry.by_alias(base) is None:  # a plugin not here
            raise RecipeError(f"variant {v.name!r}: {registry.unknown_arch(base)}")  # said first: not its keys
        if k not in known:
            raise RecipeError(f"variant {v.name!r}: unknown field {k!r}{suggest(k, known)}; "
                              f"fields: {', '.join(known)} (or {', '.join(KEY_ALIASES)})")


def resolve_variant(v: Variant, scale: str, vocab_size: int | None = None):
    """Variant -> ModelConfig. Errors name the variant and the fix."""
    base, mods, overrides = parse_spec(v.spec)
    where = f"variant {v.name!r}"
    spec = registry.by_alias(base)
    extra: dict = {}
    if base in PRESETS:
        preset = base
    elif spec is not None:
        # a preset for the composition (e.g. "<prefix>-act-small" for +act) beats base + overrides
        prefixes = tuple(dict.fromkeys((base, *spec.prefixes)))  # "transformer-small" first
        tags = [f"{p}-{'-'.join(mods)}-{scale}" for p in prefixes] if mods else []
        found = [n for n in tags + [f"{p}-{scale}" for p in prefixes] if n in PRESETS]
        baseline = registry.get_arch(registry.default_arch()).prefixes[0]
        if found:
            preset = found[0]
        elif f"{baseline}-{scale}" in PRESETS:  # an arch without its own preset: the baseline's shapes
            preset, extra = f"{baseline}-{scale}", {"arch": spec.name}
        else:
            scales = sorted({n.rsplit("-", 1)[1] for n in PRESETS if n.startswith(baseline + "-")})
            raise RecipeError(f"{where}: no preset {prefixes[0]}-{scale}; set scale to one of "
                              f"{', '.join(scales)} or name a preset")
    else:
        names = [n for s in registry.all_archs() for n in (s.name, *s.aliases)]
        options = sorted(set(names) | set(PRESETS))
        raise RecipeError(f"{where}: unknown architecture or preset {base!r}"
                          f"{suggest(base, options)}; use one of {', '.join(options)} (a plugin "
                          f"adds more: docs/extending.md)")
    modifiers = registry.modifiers()
    mod_overrides: dict = {}
    for m in mods:
        if m not in modifiers:
            raise RecipeError(f"{where}: unknown modifier +{m}{suggest(m, modifiers)}; "
                              f"known: {', '.join('+' + k for k in modifiers)}")
        mod_overrides.update(modifiers[m])
    d = merged(PRESETS[preset], extra, mod_overrides, overrides, v.set)
    if vocab_size is not None and "vocab_size" not in {**overrides, **v.set}:
        d["vocab_size"] = vocab_size
    try:
        return ModelConfig.from_dict(d)
    except ConfigError as e:
        raise RecipeError(f"{where}: {e}") from None


@dataclass
class Recipe:
    variants: list[Variant]
    name: str = "comparison"
    description: str = ""
    data: str = "stdlib"
    tokenizer: str = "bytes"  # bytes | a tokenizer.json / folder | a trained name
    text_column: str = "text"  # for .jsonl / .parquet / hf: data
    doc_sep: str | None = None  # one token between documents in the token store (--doc-sep)
    seeds: list[int] = field(default_factory=lambda: [0])
    scale: str = "small"  # which <prefix>-<scale> presets the aliases pick
    reference: str | None = None  # None -> the first variant
    match: str = "none"  # none | params | flops | depth
    match_by: str = "width"  # width (d_model, d_ff ratio kept) | depth (n_layers)
    match_tolerance: float = 0.1  # largest relative miss of a matched budget
    alpha: float = 0.05  # significance level of the paired t-test
    train: dict = field(default_factory=dict)  # TrainConfig fields (all but seed)
    # lm-eval tasks scored on every finished run (the hf extra), e.g. ["lambada_local"];
    # eval_limit: examples per task (None: all)
    eval_tasks: list[str] = field(default_factory=list)
    eval_limit: int | None = None
    # what the paper reports for this comparison (free-form; printed in report.md beside
    # the measured table), e.g. {source = "...", ppl = {baseline = 17.31, "mine N=3" = 16.06}}
    paper: dict = field(default_factory=dict)
    # downstream tasks on every finished run (``options.EvalOptions``); empty: none
    eval: dict = field(default_factory=dict)
    # learning-rate tuning before the reported runs (``tune.Tune``); empty: none
    tune: dict = field(default_factory=dict)
    # who runs the grid (compare.launch.LaunchOptions): launcher = "local", jobs = 8, or
    # launcher = "slurm", partition = ..., time = 120, gpus_per_task = 1, sbatch = [...]
    launcher: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        try:
            check_types(self, "recipe")
        except ConfigError as e:
            raise RecipeError(str(e)) from None
        if not self.variants:
            raise RecipeError(f"recipe has no variants; add e.g. variants = {registry.arch_names()[:2]!r}")
        names = [v.name for v in self.variants]
        for n in names:
            if names.count(n) > 1:
                raise RecipeError(f"recipe names variant {n!r} twice; give each a distinct name")
        slugs = [v.slug for v in self.variants]
        for v in self.variants:
            if slugs.count(v.slug) > 1:
                raise RecipeError(f"variant names {v.name!r} and another map to the same run "
                                  f"folder {v.slug!r}; rename one")
            for key in ("match_to", "control"):
                other = getattr(v, key)
                if other is not None and (other not in names or other == v.name):
                    raise RecipeError(f"variant {v.name!r}: {key}={other!r} names no other variant"
                                      f"{suggest(other, [n for n in names if n != v.name])}")
            _check_spec_keys(v)  # a typo in a spec is named before anything that follows from it
        if self.reference is None:
            self.reference = names[0]
        if self.reference not in names:
            raise RecipeError(f"reference={self.reference!r} is not a variant"
                              f"{suggest(self.reference, names)}; choose one of "
                              f"{', '.join(names)}")
        if (not isinstance(self.seeds, list) or not self.seeds
                or any(not isinstance(s, int) or isinstance(s, bool) or not 0 <= s <= MAX_SEED for s in self.seeds)
                or len(set(self.seeds)) != len(self.seeds)):
            raise RecipeError(f"seeds={self.seeds!r}: must be a non-empty list of distinct "
                              "integers from 0 to 2^63 - 1, e.g. [0, 1]")
        if self.match not in MATCH_KINDS:
            raise RecipeError(f"match={self.match!r}: choose one of {', '.join(MATCH_KINDS)}")
        if self.match_by not in MATCH_BY:
            raise RecipeError(f"match_by={self.match_by!r}: choose one of {', '.join(MATCH_BY)}")
        if not 0 < self.match_tolerance < 1:
            raise RecipeError(f"match_tolerance={self.match_tolerance!r}: must be in (0, 1)")
        if not 0 < self.alpha < 1:
            raise RecipeError(f"alpha={self.alpha!r}: must be in (0, 1)")
        for k in ("data", "tokenizer", "text_column"):
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise RecipeError(f"{k}={getattr(self, k)!r}: must be a non-empty string (data: a path, "
                                  "stdlib, shakespeare or hf:NAME; tokenizer: bytes or a tokenizer)")
        if not isinstance(self.train, dict):
            raise RecipeError("train must be a table of TrainConfig fields")
        if not isinstance(self.eval_tasks, list) or any(not isinstance(t, str) or not t for t in self.eval_tasks):
            raise RecipeError(f"eval_tasks={self.eval_tasks!r}: must be a list of lm-eval task names, "
                              "e.g. ['lambada_local', 'wikitext2_local']")
        if not isinstance(self.paper, dict):
            raise RecipeError("paper must be a table of the paper's numbers, e.g. "
                              "paper = { source = \"arXiv ...\", ppl = { VARIANT = 17.31 } }")
        if self.eval_limit is not None and (not isinstance(self.eval_limit, int) or self.eval_limit < 1):
            raise RecipeError(f"eval_limit={self.eval_limit!r}: must be a positive integer (examples per task)")
        if not isinstance(self.launcher, dict):
            raise RecipeError("launcher must be a table, e.g. [launcher] launcher = \"local\", jobs = 8")
        LaunchOptions.resolve(self.launcher)
        self.eval = EvalOptions.parse(self.eval)
        if "seed" in self.train:
            raise RecipeError("train.seed is set per run from seeds; use seeds = [...] instead")
        try:
            self.train = {k: v for k, v in TrainConfig.from_dict(self.train).to_dict().items()
                          if k != "seed"}
        except ConfigError as e:
            raise RecipeError(f"recipe [train]: {e}") from None
        for v in self.variants:
            try:
                TrainConfig.from_dict({**self.train, **v.train})
            except ConfigError as e:
                raise RecipeError(f"variant {v.name!r} train: {e}") from None
        self.tune = Tune.parse(self).to_dict() if self.tune else {}

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def train_config(self, seed: int, variant: Variant | None = None, **tuned):
        """[train], then the variant's own settings, then ``tuned`` ones, at ``seed``."""
        return TrainConfig.from_dict({**self.train, **(variant.train if variant else {}), **tuned,
                                      "seed": seed})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["variants"] = [dataclasses.asdict(v) for v in self.variants]
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "recipe") -> Recipe:
        if not isinstance(d, dict):
            raise RecipeError(f"{source}: a recipe is a table of keys")
        check_keys(cls, d, source, "key")
        if "variants" not in d:
            raise RecipeError(f"{source}: no variants; add e.g. variants = {registry.arch_names()[:2]!r}")
        items = d["variants"]
        if isinstance(items, dict):  # [variants.NAME] tables (and [variants.NAME.train]); spec defaults to NAME
            items = [{"spec": k, **v, "name": k} if isinstance(v, dict) else {"name": k, "spec": v}
                     for k, v in items.items()]
        if not isinstance(items, list):
            raise RecipeError(f"{source}: variants must be a list, or tables [variants.NAME]")
        variants = [Variant.from_item(it, f"{source}: variants[{i}]") for i, it in enumerate(items)]
        return cls(**{**d, "variants": variants})


# Built-in default: the README's main job (`phaseloop compare` with no recipe), the file
# quick.toml beside this one. Kept equal to recipes/quick.toml by a test.
QUICK_TOML = (resources.files(__package__) / "quick.toml").read_text()  # package data
BUILTIN_RECIPES = {"quick": QUICK_TOML}


def load_recipe(spec: str | os.PathLike | None = None) -> Recipe:
    """A .toml / .json file, or a built-in name (default: quick)."""
    spec = "quick" if spec is None else str(spec)
    p = Path(spec).expanduser()
    if p.is_file():
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            line = p.read_bytes()[: e.start].count(b"\n") + 1
            raise RecipeError(f"recipe {spec} is not UTF-8 (byte 0x{e.object[e.start]:02x} on line {line}); "
                              "save it as UTF-8 (e.g. iconv -t UTF-8)") from None
        except OSError as e:
            raise RecipeError(f"cannot read recipe {spec}: {e.strerror or e.__class__.__name__}; check the "
                              "path and its permissions") from None
        if p.suffix == ".json":
            try:
                d = json.loads(text)
            except json.JSONDecodeError as e:
                raise RecipeError(f"{spec} is not valid JSON: {e}") from None
            d = d.get("recipe", d) if isinstance(d, dict) else d  # a stored recipe.json
        else:
            d = parse_toml(text, spec, RecipeError)
        d = dict(d) if isinstance(d, dict) else d
        if isinstance(d, dict):
            d.setdefault("name", p.stem)
        return Recipe.from_dict(d, spec)
    if spec in BUILTIN_RECIPES:
        return Recipe.from_dict(parse_toml(BUILTIN_RECIPES[spec], spec, RecipeError), spec)
    if p.is_dir() or p.is_symlink():
        why = "is a folder, not a recipe file" if p.is_dir() else why_missing(p)
        raise RecipeError(f"recipe {spec!r} {why}; pass a .toml/.json file (see recipes/)")
    raise RecipeError(f"recipe {spec!r} not found; pass a .toml/.json file (see recipes/) or "
                      f"a built-in name: {', '.join(BUILTIN_RECIPES)}")


def apply_overrides(recipe: Recipe, variants: list[str] | None = None,
                    seeds: str | list | None = None, steps: int | None = None,
                    data: str | None = None, match: str | None = None,
                    log: Callable[[str], None] | None = None, tokenizer: str | None = None) -> Recipe:
    """CLI flags on top of a recipe. ``variants`` items are recipe variant names or new
    spec strings; when ``steps`` shrinks below the eval interval the interval follows."""
    d = recipe.to_dict()
    if variants:
        by_name = {v["name"]: v for v in d["variants"]}
        d["variants"] = [by_name.get(item, item) for item in variants]
        names = [v["name"] if isinstance(v, dict) else v for v in d["variants"]]
        if d["reference"] not in names:
            d["reference"] = names[0]
        for v in d["variants"]:  # a control left out: the variant keeps only its verdict vs the reference
            if isinstance(v, dict) and v.get("control") not in (None, *names):
                if log:
                    log(f"note: variant {v['name']!r}: its control {v['control']!r} is not among --variants; "
                        "no vs-control verdict")
                v["control"] = None
    if seeds is not None:
        if isinstance(seeds, str):
            try:
                seeds = [int(s) for s in seeds.split(",") if s.strip()]
            except ValueError:
                raise RecipeError(f"--seeds {seeds!r}: write integers separated by commas, "
                                  "e.g. --seeds 0,1") from None
        d["seeds"] = list(seeds)
    if steps is not None:
        if not isinstance(steps, int) or steps < 1:
            raise RecipeError(f"--steps {steps}: must be a positive integer")
        shrunk, d["train"]["steps"] = steps < d["train"]["steps"], steps
        if d["tune"] and d["tune"].get("steps") and d["tune"]["steps"] > steps:
            d["tune"]["steps"] = steps
        for k in ("eval_every", "ckpt_every", "warmup_steps") if shrunk else ():  # the recipe's own steps: as it is
            if d["train"][k] > max(1, steps // 5):
                d["train"][k] = max(1, steps // 10) if k != "warmup_steps" else steps // 10
                if log:
                    log(f"note: train.{k} -> {d['train'][k]} for --steps {steps}")
    if data is not None:
        d["data"] = data
    if tokenizer is not None:
        d["tokenizer"] = tokenizer
    if match is not None:
        d["match"] = match
    return Recipe.from_dict(d, "recipe with command-line options")
