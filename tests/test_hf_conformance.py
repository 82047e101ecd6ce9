"""Issue 31, items 1-7: what transformers' common model tests (tests/test_hf_common.py)
and a user found in the transformers wrapper, each fixed or refused clearly, with its own
test here (no sdist needed): token ids in the config; refused outputs and keyword
arguments; return_dict=False; logits_to_keep; position_ids; missing weights get
phaseloop's init; the config as the source of truth; UT+ACT's loss with its ponder cost;
inputs_embeds; torch.export and torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from phaseloop import ModelConfig, registry
from phaseloop.errors import ConfigError
from phaseloop.hf.modeling import PhaseloopConfig, PhaseloopForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")

# transformers' tester sizes; per-arch changes where the arch asks for them
BASE = {"vocab_size": 99, "d_model": 32, "n_heads": 4, "max_seq_len": 64}
PER_ARCH = {
    "three_phase": {"n_phases": 2},  # its default 3 does not divide d_model 32
    "universal": {"n_steps": 2},  # one shared block (n_layers 1), applied n_steps times
}
VARIANTS = [(a, {}) for a in registry.arch_names()] + [("universal", {"act": True})]


def tiny_config(arch: str, **over) -> dict:
    """transformers' tester sizes with 2 layers; without the layer count where the arch
    fixes it (UT: one block, ``n_steps`` applications); a plugin's arch with other
    constraints at its own defaults, vocab 99."""
    spec = registry.get_arch(arch)
    d = {**BASE, spec.layers_name: 2, **PER_ARCH.get(arch, {}), **over}
    for attempt in (d, {k: v for k, v in d.items() if k != spec.layers_name}, {"vocab_size": 99, **over}):
        try:
            return ModelConfig(arch=arch, **attempt).to_dict()
        except ConfigError:
            continue
    return ModelConfig(arch=arch, **over).to_dict()


# ------------------------------------------------------------ issue 31, items 1-7
IDS = [a + "".join(f"+{k}" for k in o) for a, o in VARIANTS]


def _model(arch="rope", seed=0, **over) -> PhaseloopForCausalLM:
    torch.manual_seed(seed)
    return PhaseloopForCausalLM(PhaseloopConfig(phaseloop=tiny_config(arch, **over))).eval()


def _ids(B=3, T=9, seed=1):
    return torch.randint(0, 99, (B, T), generator=torch.Generator().manual_seed(seed))


def _left_mask(x):
    m = torch.ones_like(x)
    m[0, :3] = 0
    m[1, :1] = 0
    return m


def test_token_ids_in_config(tmp_path):
    """Item 1: bos/eos/pad ids are config fields (None by default: raw-text models), kept
    through save/load, and generate stops rows at the EOS and pads them."""
    c = PhaseloopConfig()
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (None, None, None)
    m = _model()
    x = _ids(B=2)
    free = m.generate(x, max_new_tokens=6, do_sample=False)
    eos = int(free[0, 9 + 2])  # row 0's third new token
    m.config.eos_token_id, m.config.pad_token_id = eos, 0
    m.save_pretrained(tmp_path)
    back = PhaseloopForCausalLM.from_pretrained(tmp_path)
    assert (back.config.eos_token_id, back.config.pad_token_id) == (eos, 0)
    out = m.generate(x, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0)
    k = (free[0, 9:] == eos).nonzero()[0].item()  # the first EOS of row 0
    assert torch.equal(out[0, :9 + k + 1], free[0, :9 + k + 1])
    assert (out[0, 9 + k + 1:] == 0).all()


def test_refused_outputs_are_errors():
    """Item 2: output_attentions / output_hidden_states (argument or config), other
    position_ids and unknown keyword arguments are refused, each with its reason."""
    m, x = _model(), _ids()
    for kw in ("output_attentions", "output_hidden_states"):
        with pytest.raises(ConfigError, match=f"{kw} is not supported"):
            m(x, **{kw: True})
    m.config.output_hidden_states = True
    with pytest.raises(ConfigError, match="output_hidden_states is not supported"):
        m(x)
    m.config.output_hidden_states = False
    assert m(x, output_attentions=False, output_hidden_states=False).logits.shape == (3, 9, 99)
    with pytest.raises(TypeError, match="unsupported keyword argument.*token_type_ids"):
        m(x, token_type_ids=torch.zeros_like(x))


def test_position_ids_accepted_when_they_are_the_positions():
    """Item 2: position_ids equal to the tokens' own positions (left padding: counted
    from each row's first token, as transformers computes them) change nothing; others
    are refused."""
    m, x = _model(), _ids()
    mask = _left_mask(x)
    want = m(x, attention_mask=mask).logits
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert torch.equal(m(x, attention_mask=mask, position_ids=pos).logits, want)
    assert torch.equal(m(x, position_ids=torch.arange(9)[None]).logits, m(x).logits)
    with pytest.raises(ConfigError, match="position_ids other than"):
        m(x, position_ids=torch.arange(9)[None] + 5)


def test_return_dict_false_is_a_tuple():
    """Item 2: return_dict=False (argument or config) gives the ModelOutput's tuple."""
    m, x = _model(), _ids()
    d = m(x, labels=x, use_cache=False)
    loss, logits = m(x, labels=x, use_cache=False, return_dict=False)
    assert torch.equal(loss, d.loss) and torch.equal(logits, d.logits)
    m.config.return_dict = False
    assert isinstance(m(x), tuple)


def test_logits_to_keep_reaches_forward():
    """Item 2: prepare_inputs_for_generation passes the other keyword arguments on
    (logits_to_keep among them); forward honours it; generate is unchanged by it."""
    m, x = _model(), _ids()
    inputs = m.prepare_inputs_for_generation(x, logits_to_keep=1, use_cache=False)
    assert inputs["logits_to_keep"] == 1
    out = m(**inputs)
    assert out.logits.shape == (3, 1, 99) and torch.equal(out.logits, m(x).logits[:, -1:])
    assert torch.equal(m.generate(x, max_new_tokens=4, do_sample=False, logits_to_keep=1),
                       m.generate(x, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("arch,over", VARIANTS, ids=IDS)
def test_missing_weights_get_phaseloops_init(tmp_path, arch, over):
    """Item 3: weights missing from a checkpoint get phaseloop's own initialisation (the
    values of a fresh build's distribution: finite, same std), loaded ones their values;
    ignore_mismatched_sizes re-initialises the mismatched ones the same way."""
    from safetensors.torch import load_file, save_file

    m = _model(arch, **over)
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    dropped = [k for k in sd if k.startswith("model.head") or ".trunk." in k and k.endswith("weight")][:4]
    assert dropped
    save_file({k: v for k, v in sd.items() if k not in dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    back = PhaseloopForCausalLM.from_pretrained(tmp_path)
    fresh = dict(m.named_parameters())
    for k, p in back.named_parameters():
        assert torch.isfinite(p).all(), k
        if k in dropped:
            assert p.abs().max() < 10 and abs(p.std() - fresh[k].std()) <= 0.5 * fresh[k].std() + 1e-6, k
        elif k in sd:
            assert torch.equal(p, sd[k]), k
    big = PhaseloopForCausalLM.from_pretrained(tmp_path, vocab_size=120, ignore_mismatched_sizes=True)
    w = big.get_input_embeddings().weight
    assert w.shape[0] == 120 and torch.isfinite(w).all() and abs(w.std() - 0.02) < 0.005


@pytest.mark.parametrize("arch,over", VARIANTS, ids=IDS)
def test_config_is_the_source_of_truth(tmp_path, arch, over):
    """Item 4: transformers' names read and write config.phaseloop: resize then
    save/load round trips; from_pretrained(..., num_hidden_layers=...) builds that model;
    a value the arch refuses is a ConfigError."""
    m = _model(arch, **over)
    m.resize_token_embeddings(120)
    assert m.config.vocab_size == m.config.phaseloop["vocab_size"] == 120
    m.save_pretrained(tmp_path)
    back = PhaseloopForCausalLM.from_pretrained(tmp_path).eval()
    x = _ids()
    assert back.config.vocab_size == 120 and torch.equal(back(x).logits, m(x).logits)
    c = back.config
    field = back.model.cfg.spec.layers_name
    assert c.num_hidden_layers == c.phaseloop[field]
    assert (c.hidden_size, c.num_attention_heads) == (c.phaseloop["d_model"], c.phaseloop["n_heads"])
    if arch == "universal":  # one shared block: more is refused, naming n_steps
        with pytest.raises(ConfigError, match="n_steps"):
            c.num_hidden_layers = 2
    else:
        one = PhaseloopForCausalLM.from_pretrained(tmp_path, num_hidden_layers=1)
        assert one.model.cfg.n_layers == 1 and one.config.phaseloop[field] == 1
    with pytest.raises(ConfigError):
        c.hidden_size = 30  # not a multiple of the heads


def test_act_loss_includes_ponder_cost():
    """Item 5: UT+ACT's loss for labels is phaseloop's own: cross-entropy + ponder cost."""
    m, x = _model("universal", act=True), _ids()
    got = m(x, labels=x).loss
    targets = torch.cat([x[:, 1:], torch.full((3, 1), -100)], 1)
    own = m.model(x, targets)
    assert own.aux_losses["ponder_loss"] > 0
    assert torch.allclose(got, own.loss, atol=1e-6) and not torch.allclose(got, own.ce_loss)


@pytest.mark.parametrize("arch,over", VARIANTS, ids=IDS)
def test_inputs_embeds(arch, over):
    """Item 6: inputs_embeds (the input embedding's output, or any vectors) in forward,
    with left padding, and in generate (with and without the cache)."""
    m, x = _model(arch, **over), _ids()
    e = m.get_input_embeddings()(x)
    with torch.no_grad():
        assert torch.equal(m(inputs_embeds=e).logits, m(x).logits)
        mask = _left_mask(x)
        assert torch.allclose(m(inputs_embeds=e, attention_mask=mask).logits,
                              m(x, attention_mask=mask).logits, atol=1e-6)
    full = m.generate(x, max_new_tokens=4, do_sample=False)
    want = full[:, 9:]
    assert torch.equal(m.generate(inputs_embeds=e, max_new_tokens=4, do_sample=False), want)
    assert torch.equal(m.generate(inputs_embeds=e, max_new_tokens=4, do_sample=False, use_cache=False), want)
    for use_cache in (True, False):  # the ids too: generate's input_ids then hold the prompt as well
        assert torch.equal(m.generate(x, inputs_embeds=e, max_new_tokens=4, do_sample=False,
                                      use_cache=use_cache), full)
    with pytest.raises(ConfigError, match="exactly one"):
        m(x, inputs_embeds=e)


def test_prepare_inputs_with_embeds_without_positions():
    """With inputs_embeds and neither a mask nor position_ids to give the sequence's length,
    input_ids hold the prompt's ids on the first step (the vectors are used) and the
    generated tokens after it (no cache: the prompt's vectors, then those tokens')."""
    m, x = _model(), _ids()
    e = m.get_input_embeddings()(x)
    first = m.prepare_inputs_for_generation(x, inputs_embeds=e, is_first_iteration=True, use_cache=False)
    assert torch.equal(first["inputs_embeds"], e) and "input_ids" not in first
    new = _ids(T=2, seed=5)
    later = m.prepare_inputs_for_generation(new, inputs_embeds=e, use_cache=False)
    assert torch.equal(later["inputs_embeds"], torch.cat([e, m.get_input_embeddings()(new)], 1))


def test_cache_implementation_refused():
    """generate's cache_implementation (static, offloaded, ...) is refused with the reason
    (transformers would warn once and ignore it: the cache is phaseloop's own)."""
    m, x = _model(), _ids()
    with pytest.raises(ConfigError, match="cache_implementation='static' is not supported.*phaseloop's own"):
        m.generate(x, max_new_tokens=2, cache_implementation="static")


@pytest.mark.parametrize("arch,over", VARIANTS, ids=IDS)
def test_torch_export_and_compile_fullgraph(arch, over):
    """Item 7: torch.export with a dynamic sequence length and torch.compile(fullgraph=True)
    capture the model with a left-padded mask (no data-dependent branch, no .tolist(),
    is_causal a plain bool); both equal eager at another length too. (compile's capture
    runs on the eager backend: inductor's codegen would take minutes on 2 cores.)"""
    m, x = _model(arch, **over), _ids()
    mask = _left_mask(x)
    x2 = _ids(T=13, seed=2)
    m2 = torch.ones_like(x2)
    m2[2, :6] = 0
    with torch.no_grad():
        T = torch.export.Dim("T", min=2, max=32)
        ep = torch.export.export(m, (), {"input_ids": x, "attention_mask": mask},
                                 dynamic_shapes={"input_ids": {1: T}, "attention_mask": {1: T}})
        for a, b in ((x, mask), (x2, m2)):
            assert torch.allclose(ep.module()(input_ids=a, attention_mask=b).logits,
                                  m(a, attention_mask=b, use_cache=False).logits, atol=1e-5)
        torch._dynamo.reset()
        c = torch.compile(m, fullgraph=True, dynamic=True, backend="eager")
        for a, b in ((x, mask), (x2, m2)):
            assert torch.allclose(c(input_ids=a, attention_mask=b).logits,
                                  m(a, attention_mask=b, use_cache=False).logits, atol=1e-5)


def test_right_padding_refused_without_tracing():
    """The documented contract that stays: a mask with padding not on the left is refused."""
    m, x = _model(), _ids()
    mask = torch.ones_like(x)
    mask[0, -2:] = 0
    for use_cache in (True, False):
        with pytest.raises(ConfigError, match="not on the left"):
            m(x, attention_mask=mask, use_cache=use_cache)


def test_batch_rows_equal_alone():
    """The traced path of a left-padded batch (one batch, rows rotated) equals each row
    alone and the eager path (one sub-batch per padding length)."""
    m, x = _model("three_phase"), _ids()
    mask = _left_mask(x)
    with torch.no_grad():
        batch = m._forward_batch(x, None, mask, {})
        groups = m(x, attention_mask=mask, use_cache=True).logits
        assert torch.allclose(batch, groups, atol=1e-6)
        for b in range(3):
            p = int((mask[b] == 0).sum())
            assert torch.allclose(batch[b, p:], m(x[b:b + 1, p:]).logits[0], atol=1e-6)
            assert (batch[b, :p] == 0).all()
