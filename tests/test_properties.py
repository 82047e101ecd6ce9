"""Property-based (hypothesis): any generated model config, train config or recipe either
builds or raises phaseloop's own one-line error (PhaseloopError), never another
exception; a built config's model runs a forward pass."""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phaseloop import registry
from phaseloop.compare import Recipe, plan_variants
from phaseloop.config import PRESETS, ModelConfig
from phaseloop.engine import TrainConfig
from phaseloop.errors import PhaseloopError
from phaseloop.model import build_model

ARCHS = registry.arch_names()  # loads the installed plugins (their presets join PRESETS)
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

# values of every JSON type, near and far from the valid ranges
ANY = st.one_of(
    st.integers(-2, 12), st.sampled_from([0, 1, 2, 3, 4, 6, 8, 16, 64, 96, 256, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 1e-6, -1.0]),
    st.booleans(), st.none(), st.text(max_size=8),
    st.sampled_from([*ARCHS, "basic",
                     "accumulated", "sinusoid", "learned", "hc", "sinkhorn", "diagonal", "identity",
                     "pooled_mlp", "none"]),
    st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))
MODEL_FIELDS = ModelConfig.field_names()  # every registered architecture's options too
TINY_PRESETS = sorted(n for n in PRESETS if n.endswith("-tiny"))


def _small(cfg: ModelConfig) -> bool:
    """Small enough for a real forward pass on 2 cores."""
    return (cfg.d_model * max(cfg.n_layers, 1) <= 4096 and cfg.vocab_size <= 4096 and cfg.d_model <= 512
            and (cfg.d_ff or 4 * cfg.d_model) <= 2048 and cfg.n_streams <= 8 and cfg.n_loops <= 6
            and cfg.n_steps <= 8 and cfg.max_seq_len >= 4)


@SETTINGS
@given(preset=st.sampled_from(TINY_PRESETS),
       changes=st.dictionaries(st.sampled_from(MODEL_FIELDS + ["bogus", "n_layerz"]), ANY, max_size=4))
def test_any_model_config_builds_or_is_refused(preset, changes):
    try:
        cfg = ModelConfig.from_dict({**PRESETS[preset], **changes})
        model = build_model(cfg, "meta")
        assert sum(p.numel() for p in model.parameters()) > 0
    except PhaseloopError:
        return
    if _small(cfg):
        torch.manual_seed(0)
        out = build_model(cfg)(torch.randint(0, cfg.vocab_size, (1, 4)))
        assert out.logits.shape == (1, 4, cfg.vocab_size)


TRAIN_FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(TRAIN_FIELDS + ["stpes"]), ANY, max_size=4))
def test_any_train_config_builds_or_is_refused(changes):
    try:
        tc = TrainConfig.from_dict(changes)
    except PhaseloopError:
        return
    assert math.isfinite(tc.lr) and tc.lr > 0 and tc.steps >= 1 and tc.batch_size >= 1


SPEC = st.builds(
    lambda base, mods, kv: " ".join([base + "".join("+" + m for m in mods), *kv]),
    st.sampled_from(["rope", "three_phase", "3pt", "universal", "ut", "looped", "hyperloop", "mhc",
                     "rope-tiny", "ropee", "", "transformer"]),
    st.lists(st.sampled_from(["act", "3pt", "paper", "actt"]), max_size=2),
    st.lists(st.sampled_from(["N=3", "N=4", "L=2", "D=64", "n_layerz=3", "N", "=3", "n_heads=5",
                              "act_type=accumulated", "hc_res=sinkhorn", "n_loops=0"]), max_size=2))
RECIPE = st.fixed_dictionaries({"variants": st.lists(st.one_of(SPEC, st.dictionaries(
    st.sampled_from(["spec", "name", "set", "match", "match_to", "sett"]), st.one_of(SPEC, ANY), max_size=3)),
    max_size=3)}, optional={
    "name": ANY, "reference": st.one_of(SPEC, ANY), "seeds": ANY, "scale": st.sampled_from(["tiny", "small", "huge"]),
    "match": st.one_of(st.sampled_from(["none", "params", "flops", "depth"]), ANY),
    "match_by": st.sampled_from(["width", "depth", "height"]), "match_tolerance": ANY, "alpha": ANY,
    "train": st.dictionaries(st.sampled_from(TRAIN_FIELDS + ["stpes"]), ANY, max_size=3),
    "data": ANY, "tokenizer": ANY, "text_column": ANY, "seed": ANY})


@SETTINGS
@given(d=RECIPE)
def test_any_recipe_plans_or_is_refused(d):
    try:
        recipe = Recipe.from_dict(d, "generated")
        plan = plan_variants(recipe, 256)
    except PhaseloopError:
        return
    assert [p.name for p in plan] == [v.name for v in recipe.variants]


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_tiny_preset_builds(preset):
    build_model(ModelConfig.from_preset(preset), "meta")
