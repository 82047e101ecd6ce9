"""`phaseloop compare`: train model variants over seeds on the same data and budget, then
report losses, speedups and whether each difference from the reference exceeds seed noise.

A *recipe* (TOML or JSON; see ``QUICK_TOML`` and ``recipes/``) names the data, the
variants, the seeds and the budget. A variant is a name plus a spec string::

    BASE[+MODIFIER...] [KEY=VALUE ...]      e.g. "three_phase N=1", "universal+act"

BASE is an architecture alias (``ALIASES``: rope, three_phase/3pt, universal, looped,
hyperloop, mhc, or any registered arch), resolved to its ``<prefix>-<scale>`` preset,
or a preset name. MODIFIERs add overrides (``MODIFIERS``: act, 3pt, paper). KEY is a
``ModelConfig`` field or a short name (``KEY_ALIASES``: N, L, D). Everything resolves
lazily, at plan time, so a recipe naming an unregistered architecture fails with one
clear error before anything is trained or written.

Every (variant, seed) run goes through ``phaseloop.train.train`` into
``OUT/runs/<variant>-s<seed>/``; a finished run (``summary.json``) is skipped and a
half-done one resumed from its last checkpoint. Same seed = same init RNG and the same
data order for every variant, so the noise test pairs runs by seed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import platform
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import ConfigError, PhaseloopError

MATCH_KINDS = ("none", "params", "flops", "depth")
MATCH_BY = ("width", "depth")


class RecipeError(PhaseloopError):
    """A bad comparison recipe, variant, budget or comparison folder (one line)."""


def _check_keys(cls, table: dict, where: str, what: str) -> None:
    """Refuse keys that are not fields of ``cls`` (typos), suggesting the closest one."""
    known = [f.name for f in dataclasses.fields(cls)]
    for k in table:
        if k not in known:
            raise RecipeError(f"{where}: unknown {what} {k!r}{_suggest(k, known)}; "
                              f"known: {', '.join(known)}")


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ============================================================================ variants
# alias -> (arch, preset prefixes tried as "<prefix>-<scale>", extra overrides)
ALIASES: dict[str, tuple[str, tuple[str, ...], dict]] = {
    "rope": ("rope", ("rope",), {}),
    "transformer": ("rope", ("transformer", "rope"), {}),
    "three_phase": ("three_phase", ("3pt", "three_phase"), {}),
    "3pt": ("three_phase", ("3pt", "three_phase"), {}),
    "universal": ("universal", ("universal", "ut"), {}),
    "ut": ("universal", ("universal", "ut"), {}),
    "looped": ("looped", ("looped",), {}),
    "hyperloop": ("hyperloop", ("hyperloop",), {}),
    "mhc": ("mhc", ("mhc",), {}),
}
# "+modifier" -> ModelConfig overrides
MODIFIERS: dict[str, dict] = {
    "act": {"act": True},  # Universal Transformer with ACT halting (Dehghani et al. 2019 §2.2)
    # the 3PT phase structure on any trunk built from Block (Abu Ayyash 2026, mods 1-5)
    "3pt": {"n_phases": 3, "phase_rotation": True, "phase_norm": True,
            "phase_aligned_gqa": True, "horn": True},
    # the 3PT paper's RoPE-only baseline: N(0, 1) embedding times sqrt(d_model)
    "paper": {"embed_scale": True, "embed_init_std": 1.0},
}
MODIFIERS["three_phase"] = MODIFIERS["3pt"]
KEY_ALIASES = {"N": "n_phases", "L": "n_layers", "D": "d_model"}


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        low = text.lower()
        return {"true": True, "false": False}.get(low, text)


def parse_spec(spec: str) -> tuple[str, list[str], dict]:
    """'three_phase+act N=3 lr=..' -> ('three_phase', ['act'], {'n_phases': 3})."""
    tokens = str(spec).split()
    if not tokens:
        raise RecipeError("empty variant spec; write e.g. 'rope' or 'three_phase N=3'")
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

    @property
    def slug(self) -> str:
        return slugify(self.name)

    @classmethod
    def from_item(cls, item, where: str) -> "Variant":
        if isinstance(item, str):
            return cls(name=item, spec=item)
        if not isinstance(item, dict):
            raise RecipeError(f"{where}: a variant is a spec string or a table, got {item!r}")
        _check_keys(cls, item, where, "variant key")
        if "spec" not in item:
            raise RecipeError(f"{where}: variant table needs spec = 'ARCH ...' (e.g. 'rope')")
        if not isinstance(item.get("set", {}), dict):
            raise RecipeError(f"{where}: set must be a table of ModelConfig fields")
        v = cls(name=str(item.get("name", item["spec"])), spec=str(item["spec"]),
                set=dict(item.get("set") or {}), match=item.get("match"),
                match_to=item.get("match_to"))
        if v.match is not None and v.match not in MATCH_KINDS:
            raise RecipeError(f"{where}: match={v.match!r}; choose one of {', '.join(MATCH_KINDS)}")
        return v


def resolve_variant(v: Variant, scale: str, vocab_size: int | None = None):
    """Variant -> ModelConfig. Errors name the variant and the fix."""
    from . import config
    from .config import PRESETS, ModelConfig

    base, mods, overrides = parse_spec(v.spec)
    where = f"variant {v.name!r}"
    if base in PRESETS:
        preset, extra = base, {}
    elif base in ALIASES or base in config.ARCHS:
        arch, prefixes, extra = ALIASES.get(base, (base, (base,), {}))
        if arch not in config.ARCHS:
            raise RecipeError(f"{where}: architecture {arch!r} is not registered in this "
                              f"phaseloop (registered: {', '.join(config.ARCHS)}); remove the "
                              "variant or use a version that has it")
        # a preset for the composition (e.g. universal-act-small) beats base + overrides
        tags = [f"{p}-{'-'.join(mods)}-{scale}" for p in prefixes] if mods else []
        found = [n for n in tags + [f"{p}-{scale}" for p in prefixes] if n in PRESETS]
        if found:
            preset = found[0]
        elif f"rope-{scale}" in PRESETS:  # an arch without its own preset: rope's shapes
            preset, extra = f"rope-{scale}", {**extra, "arch": arch}
        else:
            scales = sorted({n.rsplit("-", 1)[1] for n in PRESETS if n.startswith("rope-")})
            raise RecipeError(f"{where}: no preset {prefixes[0]}-{scale}; set scale to one of "
                              f"{', '.join(scales)} or name a preset")
    else:
        options = sorted(set(ALIASES) | set(config.ARCHS) | set(PRESETS))
        raise RecipeError(f"{where}: unknown architecture or preset {base!r}"
                          f"{_suggest(base, options)}; use one of {', '.join(options)}")
    mod_overrides: dict = {}
    for m in mods:
        if m not in MODIFIERS:
            raise RecipeError(f"{where}: unknown modifier +{m}{_suggest(m, MODIFIERS)}; "
                              f"known: {', '.join('+' + k for k in MODIFIERS)}")
        mod_overrides.update(MODIFIERS[m])
    d = {**PRESETS[preset], **extra, **mod_overrides, **overrides, **v.set}
    if vocab_size is not None and "vocab_size" not in {**overrides, **v.set}:
        d["vocab_size"] = vocab_size
    try:
        return ModelConfig.from_dict(d)
    except ConfigError as e:
        raise RecipeError(f"{where}: {e}") from None


# ============================================================================ recipes
@dataclass
class Recipe:
    variants: list[Variant]
    name: str = "comparison"
    description: str = ""
    data: str = "stdlib"
    seeds: list[int] = field(default_factory=lambda: [0])
    scale: str = "small"  # which <prefix>-<scale> presets the aliases pick
    reference: str | None = None  # None -> the first variant
    match: str = "none"  # none | params | flops | depth
    match_by: str = "width"  # width (d_model, d_ff ratio kept) | depth (n_layers)
    match_tolerance: float = 0.1  # largest relative miss of a matched budget
    alpha: float = 0.05  # significance level of the paired t-test
    train: dict = field(default_factory=dict)  # TrainConfig fields (all but seed)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        from .train import TrainConfig

        if not self.variants:
            raise RecipeError("recipe has no variants; add e.g. variants = ['rope', 'three_phase']")
        names = [v.name for v in self.variants]
        for n in names:
            if names.count(n) > 1:
                raise RecipeError(f"recipe names variant {n!r} twice; give each a distinct name")
        slugs = [v.slug for v in self.variants]
        for v in self.variants:
            if slugs.count(v.slug) > 1:
                raise RecipeError(f"variant names {v.name!r} and another map to the same run "
                                  f"folder {v.slug!r}; rename one")
            if v.match_to is not None and v.match_to not in names:
                raise RecipeError(f"variant {v.name!r}: match_to={v.match_to!r} names no variant"
                                  f"{_suggest(v.match_to, names)}")
        if self.reference is None:
            self.reference = names[0]
        if self.reference not in names:
            raise RecipeError(f"reference={self.reference!r} is not a variant"
                              f"{_suggest(self.reference, names)}; choose one of "
                              f"{', '.join(names)}")
        if (not isinstance(self.seeds, list) or not self.seeds
                or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in self.seeds)
                or len(set(self.seeds)) != len(self.seeds)):
            raise RecipeError(f"seeds={self.seeds!r}: must be a non-empty list of distinct "
                              "non-negative integers, e.g. [0, 1]")
        if self.match not in MATCH_KINDS:
            raise RecipeError(f"match={self.match!r}: choose one of {', '.join(MATCH_KINDS)}")
        if self.match_by not in MATCH_BY:
            raise RecipeError(f"match_by={self.match_by!r}: choose one of {', '.join(MATCH_BY)}")
        if not 0 < self.match_tolerance < 1:
            raise RecipeError(f"match_tolerance={self.match_tolerance!r}: must be in (0, 1)")
        if not 0 < self.alpha < 1:
            raise RecipeError(f"alpha={self.alpha!r}: must be in (0, 1)")
        if not isinstance(self.data, str) or not self.data:
            raise RecipeError(f"data={self.data!r}: a path or one of stdlib, shakespeare")
        if not isinstance(self.train, dict):
            raise RecipeError("train must be a table of TrainConfig fields")
        if "seed" in self.train:
            raise RecipeError("train.seed is set per run from seeds; use seeds = [...] instead")
        try:
            self.train = {k: v for k, v in TrainConfig.from_dict(self.train).to_dict().items()
                          if k != "seed"}
        except ConfigError as e:
            raise RecipeError(f"recipe [train]: {e}") from None

    def train_config(self, seed: int):
        from .train import TrainConfig

        return TrainConfig.from_dict({**self.train, "seed": seed})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["variants"] = [dataclasses.asdict(v) for v in self.variants]
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "recipe") -> "Recipe":
        if not isinstance(d, dict):
            raise RecipeError(f"{source}: a recipe is a table of keys")
        _check_keys(cls, d, source, "key")
        if "variants" not in d:
            raise RecipeError(f"{source}: no variants; add e.g. variants = ['rope', 'three_phase']")
        items = d["variants"]
        if not isinstance(items, list):
            raise RecipeError(f"{source}: variants must be a list")
        variants = [Variant.from_item(it, f"{source}: variants[{i}]") for i, it in enumerate(items)]
        return cls(**{**d, "variants": variants})


# Built-in default: the README's main job (`phaseloop compare` with no recipe). Kept equal
# to recipes/quick.toml by a test.
QUICK_TOML = """\
# The README's main job: the RoPE-only baseline vs the Three-Phase Transformer vs
# Hyperloop, small byte-level models on the built-in corpus (the Python standard
# library), equal steps and tokens, 2 seeds: about 10 minutes on 2 CPU cores.
name = "quick"
description = "RoPE-only vs Three-Phase Transformer (N=3) vs Hyperloop, small byte-level models"
data = "stdlib"
scale = "small"
seeds = [0, 1]
reference = "rope"
variants = ["rope", "three_phase N=3", "hyperloop"]

[train]
steps = 300
batch_size = 16
seq_len = 128
lr = 0.002
warmup_steps = 25
eval_every = 25
eval_windows = 32
ckpt_every = 50
log_every = 5
"""
BUILTIN_RECIPES = {"quick": QUICK_TOML}


def _load_toml(text: str, source: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise RecipeError("reading TOML recipes on Python 3.10 needs tomli (pip install "
                              "tomli); or pass a JSON recipe") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{source} is not valid TOML: {e}") from None


def load_recipe(spec: str | os.PathLike | None = None) -> Recipe:
    """A .toml / .json file, or a built-in name (default: quick)."""
    spec = "quick" if spec is None else str(spec)
    p = Path(spec).expanduser()
    if p.is_file():
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise RecipeError(f"cannot read recipe {spec}: {e.__class__.__name__}") from None
        if p.suffix == ".json":
            try:
                d = json.loads(text)
            except json.JSONDecodeError as e:
                raise RecipeError(f"{spec} is not valid JSON: {e}") from None
            d = d.get("recipe", d) if isinstance(d, dict) else d  # a stored recipe.json
        else:
            d = _load_toml(text, spec)
        d = dict(d) if isinstance(d, dict) else d
        if isinstance(d, dict):
            d.setdefault("name", p.stem)
        return Recipe.from_dict(d, spec)
    if spec in BUILTIN_RECIPES:
        return Recipe.from_dict(_load_toml(BUILTIN_RECIPES[spec], spec), spec)
    raise RecipeError(f"recipe {spec!r} not found; pass a .toml/.json file (see recipes/) or "
                      f"a built-in name: {', '.join(BUILTIN_RECIPES)}")


def apply_overrides(recipe: Recipe, variants: list[str] | None = None,
                    seeds: str | list | None = None, steps: int | None = None,
                    data: str | None = None, match: str | None = None,
                    log: Callable[[str], None] | None = None) -> Recipe:
    """CLI flags on top of a recipe. ``variants`` items are recipe variant names or new
    spec strings; when ``steps`` shrinks below the eval interval the interval follows."""
    d = recipe.to_dict()
    if variants:
        by_name = {v["name"]: v for v in d["variants"]}
        d["variants"] = [by_name.get(item, item) for item in variants]
        names = [v["name"] if isinstance(v, dict) else v for v in d["variants"]]
        if d["reference"] not in names:
            d["reference"] = names[0]
    if seeds is not None:
        if isinstance(seeds, str):
            try:
                seeds = [int(s) for s in seeds.split(",") if s.strip()]
            except ValueError:
                raise RecipeError(f"--seeds {seeds!r}: write integers separated by commas, "
                                  "e.g. --seeds 0,1") from None
        d["seeds"] = list(seeds)
    if steps is not None:
        d["train"]["steps"] = steps
        for k in ("eval_every", "ckpt_every", "warmup_steps"):
            if d["train"][k] > max(1, steps // 5):
                d["train"][k] = max(1, steps // 10) if k != "warmup_steps" else steps // 10
                if log:
                    log(f"note: train.{k} -> {d['train'][k]} for --steps {steps}")
    if data is not None:
        d["data"] = data
    if match is not None:
        d["match"] = match
    return Recipe.from_dict(d, "recipe with command-line options")


# ============================================================================ budgets
@dataclass
class Planned:
    variant: Variant
    cfg: Any  # ModelConfig
    counts: dict  # count_params() of cfg at the training sequence length
    matched: dict | None = None  # what budget matching chose

    @property
    def name(self) -> str:
        return self.variant.name


def measure(cfg, seq_len: int) -> dict:
    """count_params on the meta device; FLOPs None when an arch cannot trace on meta."""
    from .model import build_model
    from .params import count_params

    try:
        return count_params(cfg, seq_len)
    except PhaseloopError:
        raise
    except Exception as e:  # e.g. data-dependent halting loops on meta tensors
        model = build_model(cfg, device="meta")
        total = sum(p.numel() for p in model.parameters())
        return {"arch": cfg.arch, "total": int(total), "flops_per_token": None, "seq_len": seq_len,
                "depth": int(getattr(model.trunk, "depth", cfg.n_layers)),
                "flops_error": f"{e.__class__.__name__}: {str(e)[:120]}"}


def _metric(counts: dict, kind: str):
    return {"params": counts["total"], "flops": counts["flops_per_token"],
            "depth": counts["depth"]}[kind]


def _probe(cfg, kind: str, seq_len: int):
    """One budget metric; params and depth need only a meta-device build (no FLOP trace)."""
    if kind == "flops":
        return measure(cfg, seq_len)["flops_per_token"]
    from .model import build_model

    model = build_model(cfg, device="meta")
    if kind == "params":
        return sum(p.numel() for p in model.parameters())
    return int(getattr(model.trunk, "depth", cfg.n_layers))


def _width_candidates(cfg) -> list:
    """Configs with d_model scaled (n_heads, n_kv_heads fixed; d_ff / d_model kept)."""
    from math import lcm

    step = lcm(2 * cfg.n_heads, 2 * cfg.n_phases)  # even head dim; N | D with even d_phase
    ratio = cfg.d_ff / cfg.d_model
    out = []
    for d in range(step, max(8 * cfg.d_model, 2048) + 1, step):
        try:
            out.append(cfg.replace(d_model=d, d_ff=max(1, round(ratio * d))))
        except ConfigError:
            continue
    return out


def _depth_candidates(cfg) -> list:
    out = []
    for n in range(1, max(4 * cfg.n_layers, 64) + 1):
        try:
            out.append(cfg.replace(n_layers=n))
        except ConfigError:
            continue
    return out


def match_budget(cfg, target: float, kind: str, by: str, seq_len: int, tolerance: float,
                 name: str = "variant"):
    """Resize ``cfg`` (width or depth) so its params / FLOPs per token / effective depth
    come closest to ``target``; metrics grow monotonically with both, so binary search.
    Returns (cfg, counts, info); raises RecipeError when the closest misses by more than
    ``tolerance`` (``depth`` must match exactly)."""
    if kind == "depth":
        by = "depth"
    cands = _width_candidates(cfg) if by == "width" else _depth_candidates(cfg)
    if not cands:
        raise RecipeError(f"variant {name!r}: no valid {by} to resize for matched {kind}")
    cache: dict[int, Any] = {}

    def value(i: int):
        if i not in cache:
            cache[i] = _probe(cands[i], kind, seq_len)
        if cache[i] is None:
            raise RecipeError(f"variant {name!r}: FLOPs cannot be counted for arch "
                              f"{cfg.arch!r}; match params instead")
        return cache[i]

    # Galloping search from the current size (probes stay near it, so they are cheap):
    # bracket the first candidate whose value >= target, then bisect.
    attr = "d_model" if by == "width" else "n_layers"
    start = min(range(len(cands)), key=lambda i: abs(getattr(cands[i], attr) - getattr(cfg, attr)))
    lo, hi, step = start, start, 1
    if value(start) >= target:
        while lo > 0 and value(lo) >= target:
            hi, lo, step = lo, max(0, lo - step), 2 * step
        if value(lo) >= target:
            hi = lo
    else:
        while hi < len(cands) - 1 and value(hi) < target:
            lo, hi, step = hi, min(len(cands) - 1, hi + step), 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if value(mid) >= target:
            hi = mid
        else:
            lo = mid
    best = min({lo, hi}, key=lambda i: (abs(value(i) - target), i))
    got = value(best)
    rel = (got - target) / target
    info = {"kind": kind, "by": by, "target": target, "value": got, "rel_diff": rel,
            attr: getattr(cands[best], attr), f"{attr}_before": getattr(cfg, attr)}
    if by == "width":
        info.update(d_ff=cands[best].d_ff, d_ff_before=cfg.d_ff)
    if (kind == "depth" and got != target) or abs(rel) > tolerance:
        raise RecipeError(
            f"variant {name!r}: matched {kind} unreachable by {by}: the closest, {attr}="
            f"{getattr(cands[best], attr)}, gives {got:,} vs the target {target:,} "
            f"({rel:+.1%}, tolerance {tolerance:.0%}); try match_by = "
            f"'{'depth' if by == 'width' else 'width'}', a larger match_tolerance, or another "
            "variant")
    return cands[best], measure(cands[best], seq_len), info


def plan_variants(recipe: Recipe, vocab_size: int | None = None,
                  log: Callable[[str], None] | None = None) -> list[Planned]:
    """Resolve every variant and apply budget matching; nothing is trained or written."""
    seq_len = recipe.train.get("seq_len")
    plans: dict[str, Planned] = {}
    for v in recipe.variants:
        cfg = resolve_variant(v, recipe.scale, vocab_size)
        plans[v.name] = Planned(v, cfg, measure(cfg, seq_len or cfg.max_seq_len))
    def matched(x: Variant) -> bool:
        return (x.match or recipe.match) != "none" and (x.match_to or recipe.reference) != x.name

    by_name = {v.name: v for v in recipe.variants}
    for v in recipe.variants:
        if not matched(v):
            continue
        kind, target_name = v.match or recipe.match, v.match_to or recipe.reference
        if matched(by_name[target_name]):
            raise RecipeError(f"variant {v.name!r}: match_to={target_name!r} is itself matched; "
                              "match to an unmatched variant")
        p, ref = plans[v.name], plans[target_name]
        target = _metric(ref.counts, kind)
        if target is None:
            raise RecipeError(f"variant {target_name!r}: FLOPs cannot be counted "
                              f"({ref.counts.get('flops_error')}); match params instead")
        cfg, counts, info = match_budget(p.cfg, target, kind, recipe.match_by,
                                         seq_len or p.cfg.max_seq_len, recipe.match_tolerance,
                                         v.name)
        info["to"] = target_name
        plans[v.name] = Planned(v, cfg, counts, info)
        if log:
            log(f"match {kind}: {v.name}: " + _describe_match(info))
    return list(plans.values())


def _describe_match(info: dict) -> str:
    if info["by"] == "width":
        size = (f"d_model {info['d_model_before']} -> {info['d_model']}, "
                f"d_ff {info['d_ff_before']} -> {info['d_ff']}")
    else:
        size = f"n_layers {info['n_layers_before']} -> {info['n_layers']}"
    return (f"{size} ({info['kind']} {info['value']:,} vs {info['target']:,} of "
            f"{info['to']}, {info['rel_diff']:+.1%})")


# ============================================================================ statistics
def first_reach(xs: list[float], ys: list[float], target: float) -> float | None:
    """First x at which the curve reaches y <= target, interpolating linearly between
    the evaluation before and the evaluation at the first crossing; None if never.
    (Before the first evaluation nothing is known, so a first point already at or below
    the target counts at its own x.)"""
    for i, (x, y) in enumerate(zip(xs, ys)):
        if y <= target:
            if i == 0 or ys[i - 1] == y:
                return float(x)
            x0, y0 = xs[i - 1], ys[i - 1]
            return float(x0 + (y0 - target) / (y0 - y) * (x - x0))
    return None


def speedup(ref_x: float | None, var_x: float | None) -> float | None:
    """3PT paper: (reference's steps to its final loss) / (variant's steps to it)."""
    if ref_x is None or var_x is None or var_x <= 0:
        return None
    return ref_x / var_x


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with integer df, exact closed forms of
    Abramowitz & Stegun 26.7.3 (no scipy): with θ = atan(|t|/√df), A = P(|T| < |t|) is
    2/π [θ + sinθ (cosθ + 2/3 cos³θ + ...)] for odd df and sinθ [1 + 1/2 cos²θ + ...]
    for even df."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if math.isinf(t):
        return 0.0
    th = math.atan(abs(t) / math.sqrt(df))
    s, c = math.sin(th), math.cos(th)
    if df % 2:
        term, acc = c, (c if df > 1 else 0.0)
        for k in range(3, df - 1, 2):  # terms cos^{k}θ · (2·4···(k-1))/(1·3···k)
            term *= c * c * (k - 1) / k
            acc += term
        a = 2 / math.pi * (th + s * acc)
    else:
        term, acc = 1.0, 1.0
        for k in range(2, df - 1, 2):  # terms cos^{k}θ · (1·3···(k-1))/(2·4···k)
            term *= c * c * (k - 1) / k
            acc += term
        a = s * acc
    return min(1.0, max(0.0, 1.0 - a))


def paired_t_test(ref: list[float], var: list[float], alpha: float = 0.05) -> dict:
    """Paired t-test of var - ref over seeds; verdict better / worse (lower / higher
    loss, p < alpha) or indistinguishable. One pair: no noise estimate ("n/a")."""
    d = [v - r for r, v in zip(ref, var)]
    n = len(d)
    mean = sum(d) / n if n else float("nan")
    out = {"n": n, "mean_diff": mean, "t": None, "df": n - 1, "p": None}
    if n < 2:
        return {**out, "verdict": "n/a", "note": "one seed: no noise estimate"}
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    if sd == 0:  # identical differences: no noise at all (t undefined, kept out of JSON)
        t, p = None, 1.0 if mean == 0 else 0.0
    else:
        t = mean / (sd / math.sqrt(n))
        p = t_two_sided_p(t, n - 1)
    verdict = "indistinguishable" if p >= alpha else ("better" if mean < 0 else "worse")
    note = ("2 seeds: 1 degree of freedom, only large consistent differences count"
            if n == 2 else "")
    return {**out, "t": t, "p": p, "verdict": verdict, "note": note}


def _mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
    return m, sd


def read_curves(run_dir: Path) -> dict:
    """Evaluation records of a run: steps, val_loss, elapsed_s (training time)."""
    steps, loss, elapsed = [], [], []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.strip():
            r = json.loads(line)
            if "val_loss" in r:
                steps.append(r["step"])
                loss.append(r["val_loss"])
                elapsed.append(r.get("elapsed_s", float("nan")))
    return {"step": steps, "val_loss": loss, "elapsed_s": elapsed}


def _mean_curve(curves: list[dict]) -> dict:
    """Seed-mean curve over the evaluation steps all seeds share, with min/max bands."""
    common = sorted(set.intersection(*(set(c["step"]) for c in curves)))
    out = {"step": common, "val_loss": [], "lo": [], "hi": [], "elapsed_s": []}
    for s in common:
        ls = [c["val_loss"][c["step"].index(s)] for c in curves]
        es = [c["elapsed_s"][c["step"].index(s)] for c in curves]
        out["val_loss"].append(sum(ls) / len(ls))
        out["lo"].append(min(ls))
        out["hi"].append(max(ls))
        out["elapsed_s"].append(sum(es) / len(es))
    return out


# ============================================================================ runner
def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _claim_folder(out: Path, recipe: Recipe) -> None:
    """Store the recipe on first start; refuse a folder holding anything else."""
    from .checkpoint import read_json, write_json

    stored = out / "recipe.json"
    want = json.loads(json.dumps(recipe.to_dict()))
    if stored.exists():
        have = read_json(stored).get("recipe", {})
        if have != want:
            keys = sorted(set(have) | set(want), key=str)
            k = next(k for k in keys if have.get(k) != want.get(k))
            raise RecipeError(f"{out} holds a different comparison ({k}: {have.get(k)!r} there, "
                              f"{want.get(k)!r} now); rerun with the same recipe and options "
                              "to resume it, or choose another --out")
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RecipeError(f"{out} exists and holds no comparison; choose another --out")
    write_json(stored, {"recipe": want})


def _reset_peak_memory(device) -> bool:
    """Peak memory per run: CUDA's allocator peak, or Linux's peak RSS (VmHWM, which
    getrusage reports) reset by writing 5 to /proc/self/clear_refs."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _steps_done(run_dir: Path, steps: int) -> int:
    from .checkpoint import checkpoint_dir, read_json

    if (run_dir / "summary.json").exists():
        return steps
    ckpt = checkpoint_dir(run_dir)
    return int(read_json(ckpt / "trainer.json")["step"]) if ckpt is not None else 0


def devices_for(name: str) -> list[str]:
    """Devices to spread runs over: every GPU when there are several (device auto or
    cuda), else just the recipe's device."""
    import torch

    if name in ("auto", "cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [name]


def run_comparison(recipe: Recipe, out_dir: str | Path, *, progress: bool = True,
                   on_step: Callable[[str, int, dict], None] | None = None,
                   log: Callable[[str], None] | None = _stderr,
                   command: str | None = None) -> dict:
    """Train every (variant, seed) run not yet finished, then write the report.

    Runs go seed-major (every variant of seed 0, then seed 1, ...), so an interrupted
    comparison already holds complete pairs; one at a time, or one per device when
    there are several GPUs. ``on_step(run_name, step, record)`` receives every logged
    record (tests interrupt through it)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor, as_completed
    from queue import Queue

    from .data import load_corpus
    from .train import resolve_device, train

    out = Path(out_dir)
    for v in recipe.variants:  # cheap spec check before the data is read
        resolve_variant(v, recipe.scale)
    corpus = load_corpus(recipe.data)
    plan = plan_variants(recipe, corpus.tokenizer.vocab_size, log)
    devices = devices_for(recipe.train["device"])
    for d in devices:
        resolve_device(d)
    _claim_folder(out, recipe)

    steps = recipe.train["steps"]
    runs = [(p, seed, out / "runs" / f"{p.variant.slug}-s{seed}")
            for seed in recipe.seeds for p in plan]
    pending = [r for r in runs if not (r[2] / "summary.json").exists()]
    if log and len(pending) < len(runs):
        log(f"{out}: {len(runs) - len(pending)} of {len(runs)} runs already finished; continuing")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps * len(runs), initial=sum(_steps_done(d, steps) for *_, d in runs),
                   unit="step", dynamic_ncols=True, desc=f"compare {recipe.name}")
    lock, stop = threading.Lock(), threading.Event()
    # train() seeds torch's global RNG, then initialises the model from it: concurrent
    # runs take turns from the seed to their first logged step, so inits stay per-seed.
    init_lock = threading.Lock()

    def one(p: Planned, seed: int, run_dir: Path, device: str) -> None:
        last = [_steps_done(run_dir, steps)]

        def _on_step(step: int, rec: dict) -> None:
            if init_lock.locked() and holding[0]:
                holding[0] = False
                init_lock.release()
            if stop.is_set():  # another run failed or was interrupted
                raise KeyboardInterrupt
            with lock:
                if bar is not None and step > last[0]:
                    bar.update(step - last[0])
                    if "loss" in rec:
                        bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                last[0] = max(last[0], step)
            if on_step is not None:
                on_step(run_dir.name, step, rec)

        if bar is not None and len(devices) == 1:
            bar.set_description(run_dir.name)
        if not _reset_peak_memory(resolve_device(device)) and log:
            log("note: cannot reset peak memory between runs; it is the process peak")
        tc = dataclasses.replace(recipe.train_config(seed), device=device)
        holding = [len(devices) > 1]
        if holding[0]:
            init_lock.acquire()
        try:
            train(p.cfg, tc, corpus, run_dir, resume=(run_dir / "config.json").exists(),
                  progress=False, on_step=_on_step)
        finally:
            if holding[0]:
                init_lock.release()

    try:
        if len(devices) == 1:
            for r in pending:
                one(*r, devices[0])
        else:
            free: Queue = Queue()
            for d in devices:
                free.put(d)

            def worker(r) -> None:
                d = free.get()
                try:
                    if not stop.is_set():
                        one(*r, d)
                finally:
                    free.put(d)

            with ThreadPoolExecutor(len(devices)) as ex:
                futures = [ex.submit(worker, r) for r in pending]
                try:
                    for f in as_completed(futures):
                        f.result()  # re-raises the first failure or interruption
                except BaseException:
                    stop.set()  # running workers stop at their next logged step
                    for f in futures:
                        f.cancel()
                    raise
    finally:
        if bar is not None:
            bar.close()
    return write_report(out, recipe, plan, corpus.describe(), command, log)


# ============================================================================ report
def summarize(out: Path, recipe: Recipe, plan: list[Planned]) -> dict:
    """Per-variant statistics from the finished runs in ``out/runs``."""
    from .checkpoint import read_json

    rows = {}
    for p in plan:
        seeds, sums, curves = [], [], []
        for seed in recipe.seeds:
            d = out / "runs" / f"{p.variant.slug}-s{seed}"
            if (d / "summary.json").exists():
                seeds.append(seed)
                sums.append(read_json(d / "summary.json"))
                curves.append(read_curves(d))
        rows[p.name] = {"seeds": seeds, "summaries": sums, "curves": curves}
    ref = rows[recipe.reference]
    if not ref["seeds"]:
        raise RecipeError(f"no finished run of the reference {recipe.reference!r} in {out}")
    ref_mean = _mean_curve(ref["curves"])
    target = ref_mean["val_loss"][-1]  # reference's final validation loss (seed mean)
    ref_step = first_reach(ref_mean["step"], ref_mean["val_loss"], target)
    ref_time = first_reach(ref_mean["elapsed_s"], ref_mean["val_loss"], target)
    ref_final = {s: x["val_loss"] for s, x in zip(ref["seeds"], ref["summaries"])}

    variants = []
    for p in plan:
        r = rows[p.name]
        if not r["seeds"]:
            variants.append({"name": p.name, "spec": p.variant.spec, "finished_seeds": []})
            continue
        mc = _mean_curve(r["curves"])
        at_step = first_reach(mc["step"], mc["val_loss"], target)
        at_time = first_reach(mc["elapsed_s"], mc["val_loss"], target)
        stat = {}
        for k in ("val_loss", "val_bpb", "val_ppl", "tok_per_s", "peak_memory_mb", "elapsed_s"):
            m, sd = _mean_std([s.get(k) for s in r["summaries"]])
            stat[k] = {"mean": m, "std": sd}
        paired = [s for s in r["seeds"] if s in ref_final]
        test = (None if p.name == recipe.reference else paired_t_test(
            [ref_final[s] for s in paired],
            [r["summaries"][r["seeds"].index(s)]["val_loss"] for s in paired], recipe.alpha))
        variants.append({
            "name": p.name, "spec": p.variant.spec, "slug": p.variant.slug,
            "model": p.cfg.to_dict(), "matched": p.matched,
            "params": p.counts["total"], "non_embedding_params": p.counts.get("non_embedding"),
            "depth": p.counts["depth"], "flops_per_token": p.counts["flops_per_token"],
            "finished_seeds": r["seeds"],
            "final": {s: {k: x.get(k) for k in ("val_loss", "val_bpb", "val_ppl")}
                      for s, x in zip(r["seeds"], r["summaries"])},
            **stat,
            "reach_step": at_step, "reach_elapsed_s": at_time,
            "step_speedup": speedup(ref_step, at_step),
            "wallclock_speedup": speedup(ref_time, at_time),
            "vs_reference": test, "curve": mc,
        })
    total = sum(x.get("elapsed_s", 0.0) for r in rows.values() for x in r["summaries"])
    return {"reference": recipe.reference, "target_val_loss": target,
            "train_time_s": total, "variants": variants}


def _machine(device) -> dict:
    import torch

    m = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
         "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
         "device": str(device)}
    if device.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(device)
    return m


def _fmt(m, sd=None, digits=3) -> str:
    if m is None:
        return "n/a"
    s = f"{m:.{digits}f}"
    return s + (f" ± {sd:.{digits}f}" if sd is not None else "")


def _speed(x) -> str:
    return "not reached" if x is None else f"{x:.2f}x"


def _verdict(t: dict | None) -> str:
    if t is None:
        return "reference"
    if t["p"] is None:
        return "n/a (1 seed)"
    return f"{t['verdict']} (p={t['p']:.3f})"


def format_table(summary: dict) -> str:
    from .params import format_count

    head = ("| variant | params | depth | MFLOP/tok | tok/s | peak MB | val loss | BPB | PPL "
            "| step speedup | wall speedup | vs reference |")
    lines = [head, "|" + "---|" * 12]
    for v in summary["variants"]:
        if not v["finished_seeds"]:
            lines.append(f"| {v['name']} | not run |" + " |" * 10)
            continue
        fl = v["flops_per_token"]
        lines.append(
            f"| {v['name']} | {format_count(v['params'])} | {v['depth']} | "
            f"{'n/a' if fl is None else f'{fl / 1e6:.2f}'} | "
            f"{_fmt(v['tok_per_s']['mean'], None, 0)} | "
            f"{_fmt(v['peak_memory_mb']['mean'], None, 0)} | "
            f"{_fmt(v['val_loss']['mean'], v['val_loss']['std'])} | "
            f"{_fmt(v['val_bpb']['mean'], v['val_bpb']['std'])} | "
            f"{_fmt(v['val_ppl']['mean'], v['val_ppl']['std'], 2)} | "
            f"{_speed(v['step_speedup'])} | {_speed(v['wallclock_speedup'])} | "
            f"{_verdict(v['vs_reference'])} |")
    return "\n".join(lines)


def write_plots(out: Path, summary: dict) -> list[str] | str:
    """PNG files written, or a one-line reason when matplotlib is missing."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return "matplotlib is not installed (pip install 'phaseloop[plot]'); no plots written"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [v for v in summary["variants"] if v["finished_seeds"]]
    written = []
    for key, xlabel, fname in (("step", "training step", "val_loss_vs_step.png"),
                               ("elapsed_s", "training wall-clock time (s)",
                                "val_loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for v in done:
            c = v["curve"]
            line, = ax.plot(c[key], c["val_loss"], marker=".", label=v["name"])
            if len(v["finished_seeds"]) > 1:
                ax.fill_between(c[key], c["lo"], c["hi"], color=line.get_color(), alpha=0.2)
        ax.axhline(summary["target_val_loss"], color="grey", ls=":", lw=1,
                   label=f"target ({summary['reference']} final)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title("validation loss (seed mean; band = min..max over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        written.append(fname)
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for v in done:
        ax.errorbar([v["params"]], [v["val_loss"]["mean"]], yerr=[v["val_loss"]["std"] or 0],
                    fmt="o", capsize=3, label=v["name"])
    ps = [v["params"] for v in done]
    if ps and max(ps) > 4 * min(ps):
        ax.set_xscale("log")
    ax.set_xlabel("parameters (unique)")
    ax.set_ylabel("final validation loss")
    ax.set_title("parameters vs final loss (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "params_vs_loss.png", dpi=110)
    plt.close(fig)
    written.append("params_vs_loss.png")
    return written


def write_report(out: Path, recipe: Recipe, plan: list[Planned], data: dict,
                 command: str | None = None, log: Callable[[str], None] | None = None) -> dict:
    """summary.json, report.md and the plots."""
    from .checkpoint import write_json
    from .train import resolve_device, software_versions

    s = summarize(out, recipe, plan)
    machine = _machine(resolve_device(recipe.train["device"]))
    s.update(recipe=recipe.to_dict(), data=data, machine=machine, software=software_versions(),
             command=command, reproduce=f"phaseloop compare {shlex.quote(str(out / 'recipe.json'))}"
             f" --out {shlex.quote(str(out) + '-repro')}")
    plots = write_plots(out, s)
    s["plots"] = plots if isinstance(plots, list) else []
    write_json(out / "summary.json", s)
    if isinstance(plots, str) and log:
        log(f"note: {plots}")

    table = format_table(s)
    notes = [v for v in s["variants"] if v.get("matched")]
    tests = [v["vs_reference"] for v in s["variants"] if v.get("vs_reference")]
    md = [f"# Comparison: {recipe.name}", "", recipe.description, "",
          f"Data: `{data['source']}` ({data['tokens']:,} tokens, {data['tokenizer']} tokenizer), "
          f"seeds {recipe.seeds}, {recipe.train['steps']} steps of "
          f"{recipe.train['batch_size'] * recipe.train['grad_accum']} x "
          f"{recipe.train['seq_len'] or 'max_seq_len'} tokens per run; reference: "
          f"**{recipe.reference}**; training time of all runs {s['train_time_s'] / 60:.1f} min "
          "(evaluation excluded).", "", table, "",
          f"- Target = the reference's final validation loss (seed mean), "
          f"{s['target_val_loss']:.4f}. Step speedup (3PT paper's definition) = the "
          "reference's first step reaching the target / the variant's, on seed-mean "
          "curves, interpolating linearly between evaluations; wall-clock speedup likewise "
          "with training time (evaluation excluded). A variant whose curve never reaches the "
          "target shows \"not reached\".",
          f"- vs reference: paired t-test over seeds on the final validation loss "
          f"(alpha={recipe.alpha}); better / worse = lower / higher loss beyond seed noise."]
    if any(t.get("note") for t in tests):
        md.append(f"- Note: {next(t['note'] for t in tests if t.get('note'))}.")
    md.append("- Peak memory: the run's peak RSS (CPU; reset between runs) or peak CUDA "
              "allocation; MFLOP/tok: forward FLOPs per token at the training length.")
    if notes:
        md += ["", "## Budget matching", ""]
        md += [f"- {v['name']}: {_describe_match(v['matched'])}" for v in notes]
    md += ["", "## Plots", ""]
    md += ([f"![{f}]({f})" for f in s["plots"]] if s["plots"] else [f"({plots})"])
    md += ["", "## Recipe", "", "```json", json.dumps(recipe.to_dict(), indent=2), "```", "",
           "## Data", "", "```json", json.dumps(data, indent=2), "```", "",
           "## Machine and software", "", "```json",
           json.dumps({"machine": machine, "software": s["software"]}, indent=2), "```", "",
           "## Reproduce", "", "```sh", s["reproduce"], "```"]
    if command:
        md += ["", f"Invoked as: `{command}`"]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return s
