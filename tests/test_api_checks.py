"""The library's Python API refuses what its command line refuses (docs/reliability.md,
round 8): a config field written after construction, decoding options of
``generate`` / ``DecoderLM.generate``, a UT's step count, fields that would be ignored,
and a Hugging Face wrapper saved at another depth or with an exit rule."""

import copy
import pickle

import pytest
import torch

from phaseloop import ConfigError, ModelConfig, build_model
from phaseloop.depth import set_model_depth
from phaseloop.early_exit import parse_exit, set_exit, set_kv_share
from phaseloop.engine import TrainConfig
from phaseloop.inference import Options, generate


# ------------------------------------------------------------------ config fields written later
def test_an_assigned_field_is_checked_and_leaves_the_config_as_it_was():
    c = ModelConfig.from_preset("rope-tiny")
    before = c.to_dict()
    with pytest.raises(ConfigError, match="n_kv_heads=3: must divide n_heads=4"):
        c.n_heads = 4  # the preset's 3 kv heads no longer divide it
    with pytest.raises(ConfigError, match="n_heads=5: must divide d_model=96"):
        c.n_heads = 5
    with pytest.raises(ConfigError, match="n_heads"):
        c.n_heads = "6"
    assert c.to_dict() == before
    with pytest.raises(ConfigError, match=r"use replace\(arch=...\)"):
        c.arch = "looped"


def test_derived_fields_follow_an_assigned_field_as_in_a_copy():
    c = ModelConfig()
    c.n_heads, c.ffn = 8, "relu"
    assert (c.n_kv_heads, c.d_ff) == (8, 4 * c.d_model)  # derived again, not the values of before
    for twin in (copy.deepcopy(c), pickle.loads(pickle.dumps(c)), c.replace()):
        assert twin == c
    n = sum(p.numel() for p in build_model(c).parameters())
    assert n == sum(p.numel() for p in build_model(copy.deepcopy(c)).parameters())
    looped = ModelConfig(arch="looped")
    looped.n_loops = 5
    assert looped.n_loops == 5 and looped.to_dict()["n_loops"] == 5  # an option field is assignable too
    looped.n_unique_layers = 6
    assert looped.n_layers == 6 and copy.copy(looped) == looped


def test_a_derived_field_a_preset_would_replace_is_written(tmp_path):
    """rope-tiny gives 3 kv heads; asked to derive them (6), the file must say 6, as left out
    it would read back as the preset's 3."""
    from phaseloop.lm.runconfig import resolve_run

    spec = resolve_run(preset="rope-tiny", model={"n_kv_heads": None})
    assert spec.model.n_kv_heads == 6 and "\nn_kv_heads = 6\n" in spec.to_toml()
    f = tmp_path / "r.toml"
    f.write_text(spec.to_toml())
    assert resolve_run(f).model.n_kv_heads == 6


def test_derived_fields_print_as_comments_and_follow_a_later_set(tmp_path):
    from phaseloop.lm.runconfig import read_config, resolve_run

    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    spec = resolve_run(arch="rope", data={"source": str(tmp_path / "t.txt")})
    text = spec.to_toml()
    assert "# n_kv_heads = 4  (derived)" in text and "# d_ff = 352  (derived)" in text
    f = tmp_path / "r.toml"
    f.write_text(text)
    assert "d_ff" not in read_config(f)["model"]
    again = resolve_run(f, model={"n_heads": 8, "d_model": 256})
    assert (again.model.n_kv_heads, again.model.d_ff) == (8, 704)  # as --arch rope --set ... gives
    assert resolve_run(f).to_toml() == text
    given = resolve_run(arch="rope", model={"d_ff": 352}, data={"source": str(tmp_path / "t.txt")}).to_toml()
    assert "\nd_ff = 352\n" in given  # a value given is written as one


def test_a_train_config_field_assigned_later_is_checked_before_the_run_folder(tmp_path):
    from phaseloop.lm.train import train

    (tmp_path / "t.txt").write_text("hello world\n" * 200)
    tc = TrainConfig(steps=1, batch_size=2, seq_len=16, eval_windows=1)
    tc.lr = -0.5
    with pytest.raises(ConfigError, match="lr=-0.5: must be > 0"):
        train(ModelConfig.from_preset("rope-tiny"), tc, str(tmp_path / "t.txt"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ fields kept though without effect
def test_fields_without_effect_still_load():
    """Not refused, so that a run saved with them loads, resumes and serves: sinkhorn_iters under
    a diagonal H_res, hc_alpha_init with the pooled-MLP variant, n_phases with every phase switch
    off (the 3PT paper's modification 1 alone, which explore prices), rope_base beside
    use_rope=False (what an --init-from run changes one field at a time)."""
    for arch, over in (("hyperloop", dict(sinkhorn_iters=5)), ("hyperloop", dict(hc_transition="pooled_mlp",
                                                                                   hc_alpha_init=0.1)),
                       ("rope", dict(n_phases=2)), ("universal", dict(use_rope=False, rope_base=500.0))):
        cfg = ModelConfig(arch=arch, **over)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg


# ------------------------------------------------------------------ decoding options
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_preset("looped-tiny")).eval()


@pytest.mark.parametrize("kw, says", [
    (dict(temperature=1.0, top_k=0), "top_k=0: must be an integer >= 1"),
    (dict(temperature=1.0, top_k=-3), "top_k=-3"),
    (dict(temperature=float("nan")), "temperature=nan: must be a finite number >= 0"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(max_new_tokens=-5), "max_new_tokens=-5: must be an integer >= 0"),
])
def test_decoding_options_are_refused_by_both_generate_calls(tiny, kw, says):
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ConfigError, match=says):
        generate(tiny, prompt, Options(**{"max_new_tokens": 2, **kw}))
    with pytest.raises(ConfigError, match=says):
        tiny.generate(prompt, **{"max_new_tokens": 2, **kw})


def test_numpy_numbers_are_taken_as_python_ones(tiny):
    import numpy as np

    prompt = torch.tensor([[1, 2, 3]])
    want = generate(tiny, prompt, Options(max_new_tokens=3, temperature=0.7, top_k=5, seed=1)).tokens
    got = generate(tiny, prompt, Options(max_new_tokens=np.int64(3), temperature=np.float32(0.7), top_k=np.int64(5),
                                         seed=1)).tokens
    assert torch.equal(got, want)
    assert tiny.generate(prompt, np.int64(2), temperature=np.float64(0.0)).shape == (1, 5)
    with pytest.raises(ConfigError, match="max_new_tokens=True"):
        tiny.generate(prompt, True)


def test_a_prompt_outside_the_vocabulary_or_of_floats_is_refused(tiny):
    V = tiny.cfg.vocab_size
    for bad, says in ((torch.tensor([[1, V]]), f"token id {V}, outside the model's vocabulary 0 .. {V - 1}"),
                      (torch.tensor([[-1, 2]]), "token id -1"),
                      (torch.tensor([[1.0, 2.0]]), "integer token ids")):
        with pytest.raises(ConfigError, match=says):
            generate(tiny, bad, Options(max_new_tokens=1))
        with pytest.raises(ConfigError, match=says):
            tiny.generate(bad, 1)
    assert generate(tiny, torch.tensor([[0, V - 1]]), Options(max_new_tokens=0)).tokens.shape == (1, 0)


def test_speculative_at_one_pass_names_the_depth(tiny):
    set_model_depth(tiny, 1)
    try:
        with pytest.raises(ConfigError, match="it runs 1: decode at --depth 2 or more"):
            generate(tiny, torch.tensor([[1, 2]]), Options(max_new_tokens=2, speculative=1))
    finally:
        tiny.trunk.reset_depth()


def test_a_universal_transformers_steps_are_bounded_like_loops():
    from phaseloop.config import MAX_DEPTH

    ut = build_model(ModelConfig.from_preset("universal-act-tiny"))
    with pytest.raises(ConfigError, match=f"at most {MAX_DEPTH} steps"):
        set_model_depth(ut, MAX_DEPTH + 1)
    set_model_depth(ut, MAX_DEPTH)
    assert ut.trunk.passes == MAX_DEPTH


# ------------------------------------------------------------------ a Hugging Face wrapper saved
@pytest.mark.parametrize("preset, depth", [("looped-tiny", 1), ("hyperloop-tiny", 5), ("universal-act-tiny", 2)])
def test_a_wrapper_saved_at_another_depth_reloads_at_it(tmp_path, preset, depth):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from phaseloop.hf.modeling import PhaseloopForCausalLM

    torch.manual_seed(0)
    m = build_model(ModelConfig.from_preset(preset)).eval()
    extend = "last" if depth > m.trunk.passes else None
    set_model_depth(m, depth, extend)
    x = torch.randint(0, m.cfg.vocab_size, (1, 9))
    want = m(x).logits
    w = PhaseloopForCausalLM.from_decoder(m)
    assert (w.config.phaseloop_depth, getattr(w.config, "phaseloop_extend_loops", None)) == (depth, extend)
    w.save_pretrained(tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(back(x).logits, want)
    m.trunk.reset_depth()
    assert getattr(PhaseloopForCausalLM.from_decoder(m).config, "phaseloop_depth", None) is None


def test_a_wrapper_with_an_exit_rule_or_shared_cache_is_not_saved(tmp_path):
    pytest.importorskip("transformers")
    from phaseloop.hf.modeling import PhaseloopForCausalLM

    m = build_model(ModelConfig.from_preset("looped-tiny")).eval()
    set_exit(m, parse_exit("state:0.9")[0])
    with pytest.raises(ConfigError, match="trunk's exits set.*clear it"):
        PhaseloopForCausalLM.from_decoder(m).save_pretrained(tmp_path / "a")
    set_exit(m, None)
    set_kv_share(m, 1)
    with pytest.raises(ConfigError, match="trunk's kv_share set"):
        PhaseloopForCausalLM.from_decoder(m).save_pretrained(tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_decoding_runs_without_autograd(tiny):
    """DecoderLM.generate / decoding.decode decode under no_grad (the KV cache would otherwise keep
    every forward's graph alive)."""
    grads = []
    tiny.generate(torch.tensor([[1, 2, 3]]), 3, temperature=0, on_output=lambda o: grads.append(o.logits.requires_grad))
    assert grads == [False] * 3


def test_a_joined_batch_preallocates_no_more_than_one_cache():
    from phaseloop.decoding import join_rows
    from phaseloop.kvcache import PREALLOCATE, KVCache

    c = KVCache(capacity=10)
    c.update("s", torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    c.pos = 3
    joined = join_rows([c, c], capacity=10**6)
    assert joined.capacity == PREALLOCATE and joined.buffers["s"][0].shape[2] == PREALLOCATE


def test_depth_setting_leaves_a_plugin_trunk_that_cannot_say_its_depth_alone():
    from types import SimpleNamespace

    from phaseloop.depth import depth_setting
    from phaseloop.trunk import Trunk

    class Loop(Trunk):  # set_depth without reset_depth or passes: documented as enough for --depth
        dynamic_depth = True

        def set_depth(self, n, extend=None):
            self.n = n

    assert depth_setting(SimpleNamespace(trunk=Loop())) == (None, None)
