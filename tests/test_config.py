"""ModelConfig.replace: the same config as building from scratch with the same explicit
fields (derived values are derived again), checked by hand and by hypothesis."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaseloop import ConfigError, ModelConfig
from phaseloop.config import ARCHS


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
