"""ModelConfig.replace: the same config as building from scratch with the same explicit
fields (derived values are derived again), checked by hand and by hypothesis."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaseloop import ConfigError, ModelConfig, build_model, registry

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


def test_the_layer_count_under_either_name_over_a_preset():
    """A preset stores n_layers; a later layer naming the count under the arch's own name
    (--set, a --print-config file, a recipe) replaces it rather than conflicting."""
    from phaseloop.compare.recipe import Variant, resolve_variant
    from phaseloop.lm.runconfig import resolve_run

    assert ModelConfig.from_preset("looped-tiny", n_unique_layers=6).n_layers == 6
    assert resolve_variant(Variant("v", "looped n_unique_layers=6"), "tiny").n_layers == 6
    assert resolve_run({"model": {"preset": "looped-tiny", "n_unique_layers": 6}}).model.n_layers == 6
    assert resolve_run({"model": {"preset": "looped-tiny", "n_unique_layers": 6}},
                       model={"n_layers": 5}).model.n_unique_layers == 5
    with pytest.raises(ConfigError, match="name the same count"):  # both in one layer: ambiguous
        ModelConfig(arch="looped", n_layers=4, n_unique_layers=6)


def test_assigned_fields_are_kept_by_copies_and_replace():
    import copy
    import pickle

    c = ModelConfig()
    c.n_layers = 8
    assert (copy.deepcopy(c).n_layers == pickle.loads(pickle.dumps(c)).n_layers
            == c.replace(vocab_size=300).n_layers == 8)
    looped = ModelConfig(arch="looped")
    looped.n_loops, looped.n_unique_layers = 7, 6
    assert copy.copy(looped) == looped and looped.to_dict()["n_unique_layers"] == 6 and looped.n_layers == 6
    with pytest.raises(ConfigError, match="n_loops: not a field of arch='rope'"):
        ModelConfig().n_loops = 9


def test_none_only_where_a_field_derives_from_it():
    with pytest.raises(ConfigError, match="d_model=None"):
        ModelConfig.from_preset("rope-small", d_model=None)
    with pytest.raises(ConfigError, match="n_loops=None: has no effect"):
        ModelConfig(arch="rope", n_loops=None)
    assert ModelConfig(n_heads=6, d_model=96, n_kv_heads=None).n_kv_heads == 6  # derived
    assert ModelConfig(arch="three_phase", phase_rotation=None).phase_rotation  # the arch's value
    assert ModelConfig(arch="mhc", hc_res=None).hc_res == "sinkhorn"


def test_re_registering_an_arch_with_new_group_classes(monkeypatch):
    """Reloading a plugin (a notebook cell run again) replaces its spec when it asks to."""
    from dataclasses import make_dataclass

    from phaseloop.model import Stack

    monkeypatch.setattr(registry, "ARCHS", dict(registry.ARCHS))
    for _ in range(2):
        group = make_dataclass("ReloadOptions", [("reload_k", int, 1)])
        registry.register_arch(registry.ArchSpec(name="reloaded", trunk=Stack, options=(group,)), replace=True)
    assert ModelConfig(arch="reloaded", reload_k=3).reload_k == 3
    with pytest.raises(TypeError, match="reuses ModelConfig names"):
        registry.register_arch(registry.ArchSpec(name="clash", trunk=Stack, options=(
            make_dataclass("ClashOptions", [("head_dim", int, 1)]),)))
    with pytest.raises(ValueError, match="defaults for \\['n_loopz'\\]"):
        registry.register_arch(registry.ArchSpec(name="typo", trunk=Stack, defaults={"n_loopz": 2}))


def test_a_second_registration_of_a_name_is_refused(monkeypatch):
    """Two plugins (or a plugin and a built-in) naming one arch: the second is refused, the
    first keeps the name, unless replace=True says it is meant."""
    from phaseloop.model import Stack

    monkeypatch.setattr(registry, "ARCHS", dict(registry.ARCHS))
    rope = registry.ARCHS["rope"]
    with pytest.raises(ValueError, match="arch 'rope' is registered already .*replace=True"):
        registry.register_arch(registry.ArchSpec(name="rope", trunk=Stack))
    assert registry.get_arch("rope") is rope
    spec = registry.register_arch(registry.ArchSpec(name="rope", trunk=Stack), replace=True)
    assert registry.get_arch("rope") is spec
    monkeypatch.setattr(registry, "PRESETS", dict(registry.PRESETS))  # a preset name taken by another arch
    with pytest.raises(ValueError, match="preset 'looped-tiny' is 'looped''s already"):
        registry.register_arch(registry.ArchSpec(name="evil", trunk=Stack, presets={"looped-tiny": {}}))
    assert registry.PRESETS["looped-tiny"]["arch"] == "looped" and "evil" not in registry.ARCHS


def test_option_fields_written_with_typing_optional_are_checked(monkeypatch):
    """``Optional[int]`` is not a ``types.UnionType``: its field was never type-checked
    ('abc' reached a comparison as a traceback; true and 1.5 were taken)."""
    from dataclasses import make_dataclass
    from typing import Optional, Union

    from phaseloop.model import Stack

    monkeypatch.setattr(registry, "ARCHS", dict(registry.ARCHS))
    group = make_dataclass("OptOptions", [("opt_every", Optional[int], None), ("opt_width", Union[int, None], None)])  # noqa: UP007, UP045
    registry.register_arch(registry.ArchSpec(name="optarch", trunk=Stack, options=(group,)), replace=True)
    assert ModelConfig(arch="optarch", opt_every=None).opt_every is None
    assert ModelConfig(arch="optarch", opt_every=3).opt_every == 3
    for bad in ("abc", True, 1.5):
        with pytest.raises(ConfigError, match="opt_every"):
            ModelConfig(arch="optarch", opt_every=bad)
    with pytest.raises(ConfigError, match="opt_width"):
        ModelConfig(arch="optarch", opt_width="x")


def test_a_layer_count_named_like_a_field_is_refused(monkeypatch):
    from phaseloop.model import Stack

    monkeypatch.setattr(registry, "ARCHS", dict(registry.ARCHS))
    for name in ("d_model", "n_loops", "not an identifier"):
        with pytest.raises(ValueError, match="layers_name"):
            registry.register_arch(registry.ArchSpec(name="bad1", trunk=Stack, layers_name=name))
    assert ModelConfig(arch="rope", d_model=64).d_model == 64


def test_an_odd_head_dim_is_refused_only_with_rope():
    """RoPE rotates pairs of a head's dims; without it (sinusoids, the UT paper's models) any
    head dim builds, and a cached decode equals the full pass."""
    import torch

    from phaseloop import build_model
    from phaseloop.layers import KVCache

    with pytest.raises(ConfigError, match="head dim d_model/n_heads=3 must be even for RoPE"):
        ModelConfig(arch="rope", d_model=6, n_heads=2, n_kv_heads=2, d_ff=12)
    for arch in ("rope", "universal"):
        torch.manual_seed(0)
        m = build_model(ModelConfig(arch=arch, vocab_size=32, d_model=6, n_heads=2, n_kv_heads=2, d_ff=12,
                                    max_seq_len=16, use_rope=False)).eval().double()
        x = torch.randint(0, 32, (1, 8))
        cache = KVCache()
        parts = [m(x[:, :5], cache=cache).logits, m(x[:, 5:], cache=cache).logits]
        torch.testing.assert_close(torch.cat(parts, 1), m(x).logits, rtol=0, atol=1e-12)
