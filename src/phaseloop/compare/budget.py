"""Budget matching: resize a variant (width or depth) to the reference's parameters,
FLOPs per token or effective depth, measured on the meta device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import lcm

from phaseloop.analysis.params import measure
from phaseloop.compare.recipe import Recipe, RecipeError, Variant, resolve_variant
from phaseloop.config import ModelConfig
from phaseloop.errors import ConfigError
from phaseloop.model import build_model


@dataclass
class Planned:
    variant: Variant
    cfg: ModelConfig
    counts: dict  # count_params() of cfg at the training sequence length
    matched: dict | None = None  # what budget matching chose

    @property
    def name(self) -> str:
        return self.variant.name


def _metric(counts: dict, kind: str):
    return {"params": counts["total"], "flops": counts["flops_per_token"],
            "depth": counts["depth"]}[kind]


def _probe(cfg, kind: str, seq_len: int):
    """One budget metric; params and depth need only a meta-device build (no FLOP trace)."""
    if kind == "flops":
        return measure(cfg, seq_len)["flops_per_token"]
    model = build_model(cfg, device="meta")
    if kind == "params":
        return sum(p.numel() for p in model.parameters())
    return int(model.trunk.depth)


def _width_candidates(cfg) -> list:
    """Configs with d_model scaled (n_heads, n_kv_heads fixed; d_ff / d_model kept)."""
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
    cache: dict[int, float | None] = {}

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
            f"({rel:+.1%}, tolerance {tolerance:.0%}); "
            + ("match = 'depth' sets the layers to the target's applied depth, which this variant's "
               "layers cannot give: match it to another variant (match_to) or match params instead"
               if kind == "depth" else
               f"try match_by = '{'depth' if by == 'width' else 'width'}', a larger match_tolerance, or "
               "another variant"))
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
        if v.match_to is not None and (v.match or recipe.match) == "none":  # else silently unmatched
            raise RecipeError(f"variant {v.name!r}: match_to={v.match_to!r} with no budget to match (match = "
                              "'none'); add match = 'params', 'flops' or 'depth' to the variant or the recipe, "
                              "or drop match_to")
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
            log(f"match {kind}: {v.name}: " + describe_match(info))
    return list(plans.values())


def describe_match(info: dict) -> str:
    if info["by"] == "width":
        size = (f"d_model {info['d_model_before']} -> {info['d_model']}, "
                f"d_ff {info['d_ff_before']} -> {info['d_ff']}")
    else:
        size = f"n_layers {info['n_layers_before']} -> {info['n_layers']}"
    return (f"{size} ({info['kind']} {info['value']:,} vs {info['target']:,} of "
            f"{info['to']}, {info['rel_diff']:+.1%})")
