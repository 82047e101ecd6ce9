"""ModelConfig.replace: the same config as building from scratch with the same explicit
fields (derived values are derived again), checked by hand and by hypothesis."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaseloop import ConfigError, ModelConfig
from phaseloop import build_model, registry

ARCHS = registry.arch_names()


def test_replace_rederives_what_was_derived():
    assert ModelConfig(arch="rope", d_model=128).replace(d_model=256).d_ff == ModelConfig(d_model=256).d_ff
    assert ModelConfig(arch="rope", d_model=128).replace(d_model=256) == ModelConfig(arch="rope", d_model=256)
    tp = ModelConfig(arch="rope", d_model=96, n_heads=6).replace(arch="three_phase")
    assert tp == ModelConfig(arch="three_phase", d_model=96, n_heads=6)
    assert tp.n_phases == 3 and tp.phase_rotation and tp.phase_norm and tp.horn
    assert ModelConfig(n_heads=4).replace(n_heads=8).n_kv_heads == 8
    # explicit values stay explicit
    assert ModelConfig(d_model=128, d_ff=100).replace(d_model=256).d_ff == 100
    assert ModelConfig(n_heads=4, n_kv_heads=2).replace(n_heads=8).n_kv_heads == 2
    assert ModelConfig.from_preset("3pt-small").replace(n_layers=2).d_ff == 512


def test_replace_keeps_explicit_values_that_equal_the_derived_ones():
    """d_ff given explicitly equal to its derived value is still explicit."""
    c = ModelConfig(d_model=128, d_ff=ModelConfig(d_model=128).d_ff)
    assert c.replace(d_model=256).d_ff == c.d_ff


FIELDS = {
    "arch": st.sampled_from(ARCHS),
    "d_model": st.sampled_from([48, 96, 128, 192]),
    "n_heads": st.sampled_from([2, 4, 6, 8]),
    "n_kv_heads": st.none() | st.sampled_from([1, 2, 3]),
    "d_ff": st.none() | st.integers(1, 300),
    "n_layers": st.sampled_from([1, 2, 4]),
    "n_phases": st.none() | st.sampled_from([1, 2, 3, 6]),
    "phase_rotation": st.none() | st.booleans(),
    "phase_norm": st.none() | st.booleans(),
    "phase_aligned_gqa": st.none() | st.booleans(),
    "horn": st.none() | st.booleans(),
    "act": st.booleans(),
    "n_loops": st.sampled_from([2, 3]),
}


def _build(d):
    try:
        return ModelConfig(**d)
    except ConfigError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional=FIELDS), st.fixed_dictionaries({}, optional=FIELDS))
def test_replace_equals_building_from_scratch(explicit, overrides):
    base = _build({k: v for k, v in explicit.items() if v is not None})
    if base is None:
        return
    want = _build({**{k: v for k, v in explicit.items() if v is not None}, **overrides})
    if want is None:
        with pytest.raises(ConfigError):
            base.replace(**overrides)
    else:
        assert base.replace(**overrides) == want


@pytest.mark.parametrize("arch", ARCHS)
def test_every_registered_arch_builds_from_its_defaults(arch):
    """A newcomer's first line works: ModelConfig(arch=X) is valid and builds, and its
    dict round-trips (flat: the core, then the option groups the arch carries)."""
    cfg = ModelConfig(arch=arch)
    model = build_model(cfg, device="meta")
    assert model.trunk.depth >= 1 and model.trunk.blocks()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    groups = registry.groups_of(registry.get_arch(arch))
    layers = registry.get_arch(arch).layers_name  # n_layers under the arch's own name for it
    want = [layers if f.name == "n_layers" else f.name for f in dataclasses.fields(ModelConfig)] + [
        f.name for g in groups for f in dataclasses.fields(g)]
    assert list(cfg.to_dict()) == want


def test_option_fields_of_another_arch():
    """Set to a non-default value they are refused by name (they would be ignored); at
    their default they load (every config.json of earlier versions holds them all); read,
    they give the default."""
    with pytest.raises(ConfigError, match=r"n_loops=5: has no effect with arch='rope'.*looped, hyperloop"):
        ModelConfig(arch="rope", n_loops=5)
    with pytest.raises(ConfigError, match=r"act=True: has no effect.*universal"):
        ModelConfig(arch="looped", act=True)
    cfg = ModelConfig(arch="rope", n_loops=3, act=False, n_streams=4)
    assert "n_loops" not in cfg.to_dict() and cfg.n_loops == 3 and cfg.act is False
    assert cfg == ModelConfig(arch="rope")
    with pytest.raises(AttributeError, match="no field 'frobnicate'"):
        cfg.frobnicate  # noqa: B018


def test_unknown_arch_and_field_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"arch='nope': unknown architecture; registered: rope"):
        ModelConfig(arch="nope")
    with pytest.raises(ConfigError, match=r"unknown field\(s\) n_loop \(did you mean 'n_loops'\?\)"):
        ModelConfig(arch="looped", n_loop=2)
    with pytest.raises(ConfigError, match="arch=3: must be a string"):
        ModelConfig(arch=3)


def test_arch_defaults_are_derived_again_by_replace():
    tp = ModelConfig(arch="three_phase")
    assert (tp.d_model, tp.n_heads, tp.n_phases, tp.horn) == (120, 6, 3, True)
    rope = tp.replace(arch="rope")
    assert rope == ModelConfig(arch="rope") and rope.n_phases == 1 and not rope.horn
    assert ModelConfig(arch="universal").n_layers == 1
    assert ModelConfig(arch="mhc").hc_res_form == "sinkhorn" == ModelConfig(arch="mhc", hc_res=None).hc_res


def test_copy_and_pickle_keep_what_was_explicit():
    import copy
    import pickle

    cfg = ModelConfig(arch="hyperloop", d_model=64, n_loops=2)
    for twin in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert twin == cfg
        assert twin.replace(d_model=128).d_ff == cfg.replace(d_model=128).d_ff  # d_ff re-derived
    twin = copy.copy(cfg)
    twin.n_loops = 3  # option fields are assignable like core ones
    assert twin.n_loops == 3 and twin.to_dict()["n_loops"] == 3
