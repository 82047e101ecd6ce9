"""``generate --compile`` (deploy/compiled.py): the one-token step compiled by inductor with
frozen, prepacked weights decodes what eager decoding does — each step's logits within
1e-4 of the largest (fp32 summation order only) on the same tokens, greedy tokens equal —
for every built-in architecture (RoPE, 3PT, mHC, UT, UT + ACT, Looped, Hyperloop) and packed
int4 weights, UT + ACT with each token stopping where it halts (the steps it ran = eager's);
what it cannot run is one line, exit 2."""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from conftest import tiny_model_config, tiny_run

import phaseloop.deploy.compiled as compiled
from phaseloop.cli import main
from phaseloop.decoding import decode
from phaseloop.deploy.compiled import CompiledDecoder, check, generate
from phaseloop.early_exit import ExitRule
from phaseloop.errors import ConfigError
from phaseloop.inference import Options
from phaseloop.inference import generate as generate_eager
from phaseloop.kvcache import KVCache
from phaseloop.model import build_model
from phaseloop.quant import PackedLinear, QuantizedWeight, quantize_rtn

TOL = 1e-4  # relative to the largest logit: the compiled products sum in another order


def _model(arch: str, **over):
    torch.manual_seed(0)
    return build_model(tiny_model_config(arch, **over)).eval()


def _packed_int4(model):
    """``model`` with every Linear whose width 32 divides as packed int4 (group 32)."""
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear) and child.in_features % 32 == 0:
                q, scale, zero = quantize_rtn(child.weight.detach(), 4, 32)
                setattr(mod, child_name, PackedLinear(QuantizedWeight.from_codes(q, scale, zero, 4), child.bias))
    assert any(isinstance(m, PackedLinear) and m.kernel == "int4" for m in model.modules())
    return model


def _halting_apart(model):
    """UT + ACT whose positions halt at different steps (rows caught up at a step)."""
    with torch.no_grad():
        model.trunk.halting.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(4))
    return model


CASES = {  # every built-in trunk kind, and packed int4 weights
    "rope": lambda: _model("rope"),
    "three_phase": lambda: _model("three_phase"),
    "mhc": lambda: _model("mhc"),
    "universal": lambda: _model("universal"),
    "universal+act": lambda: _halting_apart(_model("universal", act=True, act_max_steps=3)),
    "looped": lambda: _model("looped"),
    "hyperloop": lambda: _model("hyperloop"),
    "rope-int4": lambda: _packed_int4(_model("rope", d_model=64)),
}


@pytest.mark.parametrize("case", CASES)
def test_compiled_steps_equal_eager_steps(case, monkeypatch):
    model = CASES[case]()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompt = torch.tensor([[3, 1, 4, 1, 5]])
        eager = generate_eager(model, prompt, Options(max_new_tokens=10, temperature=0.0))
        dec = CompiledDecoder(model, 16)  # one compile per case: generate, greedy, teacher-forced
        assert dec.compile_seconds > 0
        monkeypatch.setattr(compiled, "CompiledDecoder", lambda m, n: dec)  # generate on this decoder
        g = generate(model, prompt, Options(max_new_tokens=10, temperature=0.0))
        assert g.tokens.tolist() == eager.tokens.tolist() and g.seconds > 0
        assert g.passes == eager.passes  # UT + ACT: the steps each token ran (ActHost), as eager's
        if case == "universal+act":
            assert set(g.passes) == {1.0, 2.0, 3.0}  # a token that stopped early is caught up later
        dec.reset()
        assert decode(dec.step, prompt, 10).tolist() == eager.ids.tolist()
        # teacher-forced on eager's tokens: every step's logits, compiled vs eager
        dec.reset()
        cache, ids = KVCache(), eager.ids[0].tolist()
        with torch.no_grad():
            want = model(prompt, cache=cache).logits[:, -1]
            got = dec.step(prompt).logits[:, -1]
            worst = 0.0
            for tok in ids[5:-1]:
                x = torch.tensor([[tok]])
                want, got = model(x, cache=cache).logits[:, -1], dec.step(x).logits[:, -1]
                worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        assert worst <= TOL, worst
        if case == "rope":  # freezing is on (the prepacked GEMMs need it): a change after the
            # compile does not reach the compiled step, while the eager forward sees it
            _weights_are_frozen(model, dec, prompt)
            _guards_run_once_per_prompt(dec, prompt)
        if case == "universal+act":
            _act_failure_starts_a_new_sequence(dec, prompt, eager.ids)
            ref = weakref.ref(dec)
            monkeypatch.undo()
            del dec
            assert ref() is None  # freed at once: its host holds no reference back (no cycle to collect)
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def _act_failure_starts_a_new_sequence(dec, prompt, ids):
    """A call the step cannot take is refused before anything runs; one that fails midway (a
    token past the vocabulary) leaves decoder and host at a new sequence, which then decodes
    as before."""
    dec.reset()
    dec.step(prompt)
    with pytest.raises(ConfigError, match=r"shape \[1, T\]; got \(2, 1\)"):
        dec.step(torch.tensor([[7], [7]]))
    assert dec.pos == dec.act.pos == 5
    with pytest.raises(IndexError):
        dec.step(torch.tensor([[10 ** 6]]))
    assert dec.pos == dec.act.pos == 0 and not dec.act.pending
    assert decode(dec.step, prompt, 10).tolist() == ids.tolist()


@torch.no_grad()
def _weights_are_frozen(model, dec, prompt):
    dec.reset()
    dec.step(prompt)
    before = dec.step(torch.tensor([[7]])).logits
    model.head.weight.add_(1.0)
    dec.reset()
    dec.step(prompt)
    after = dec.step(torch.tensor([[7]])).logits
    eager = model(torch.cat([prompt, torch.tensor([[7]])], 1)).logits[:, -1:]
    assert torch.equal(before, after) and (eager - after).abs().max() > 0.1


@torch.no_grad()
def _guards_run_once_per_prompt(dec, prompt):
    """Dynamo's guards run on the first compiled step after a prompt (eager code ran since the
    last check) and are skipped on the steps after it (0.6 ms a step at rope-123m)."""
    dec.reset()
    dec.step(prompt)
    dec.step(torch.tensor([[7]]))
    dec.program.train()  # a guarded attribute (the step reads .training) changes mid-sequence
    try:
        dec.step(torch.tensor([[8]]))  # skipped: the graph runs as compiled
        dec.reset()
        dec.step(prompt)
        with pytest.raises(RuntimeError, match="[Rr]ecompil"):  # checked after the prompt
            dec.step(torch.tensor([[7]]))
    finally:
        dec.program.eval()


def test_a_process_compiles_more_decoders_than_dynamos_recompile_limit():
    """Each decoder compiles its own graph (CI failed the ninth decoder of a worker process
    when they shared RunnerProgram.forward's cache); a dropped decoder leaves no compiled step behind."""
    import gc

    model = _model("rope", n_layers=1)
    limit = 2  # dynamo's default is 8: the same property, fewer compiles
    graphs = []
    with torch._dynamo.config.patch(recompile_limit=limit):
        for _ in range(limit + 1):
            graphs.append(_decoder_runs(model))
    gc.collect()
    assert sum(g() is not None for g in graphs) == 0


def _decoder_runs(model):
    """A decoder's prompt and one compiled step; a weak reference to its compiled step."""
    dec = CompiledDecoder(model, 4)
    with torch.no_grad():
        dec.step(torch.tensor([[1]]))
        assert dec.step(torch.tensor([[2]])).logits.shape == (1, 1, model.cfg.vocab_size)
    return weakref.ref(dec._graph)


def test_a_failing_autotuned_compile_falls_back_to_one_without_templates(monkeypatch):
    """When the autotuned compile fails (torch 2.13's CPU BMM template on mHC does), the step
    compiles again with frozen weights and no templates, and still decodes what eager does."""
    monkeypatch.setattr(compiled, "COMPILE_OPTIONS", {"freezing": True, "not_an_inductor_option": True})
    model, prompt = _model("rope", n_layers=1), torch.tensor([[3, 1, 4]])
    opts = Options(max_new_tokens=6, temperature=0.0)
    g = generate(model, prompt, opts)
    assert g.compile_autotuned is False and g.ids.tolist() == generate_eager(model, prompt, opts).ids.tolist()


def test_no_new_tokens_compiles_nothing(monkeypatch):
    monkeypatch.setattr(compiled, "CompiledDecoder", None)  # would fail if called
    g = generate(_model("rope"), torch.tensor([[1, 2]]), Options(max_new_tokens=0))
    assert g.tokens.shape == (1, 0) and g.ids.tolist() == [[1, 2]] and g.compile_seconds == 0.0


def test_what_the_compiled_step_cannot_run_is_refused():
    model, prompt = _model("universal"), torch.tensor([[1, 2, 3]])
    for opts, word in ((Options(exit=ExitRule("kl", 0.1)), "--exit"), (Options(kv_share=1), "--kv-share"),
                       (Options(speculative=1), "--speculative"), (Options(use_cache=False), "--no-cache"),
                       (Options(kv_fill="latest"), "--kv-fill")):
        with pytest.raises(ConfigError, match=word):
            check(model, opts, prompt)
    with pytest.raises(ConfigError, match="batch 1"):
        check(model, Options(), torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ConfigError, match="max_seq_len = 32"):
        check(model, Options(max_new_tokens=40), prompt)


def test_generate_compile_on_the_command_line(tmp_path, capsys, monkeypatch):
    run = tiny_run(tmp_path, 2, 2)["run"]
    capsys.readouterr()  # train's own output
    base = ["generate", str(run), "--json", "--max-new-tokens", "6", "--temperature", "0", "--prompt", "the"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--compile"]) == 0
    comp = json.loads(capsys.readouterr().out)
    assert comp["tokens"] == plain["tokens"] and comp["compile_seconds"] > 0 and "compile_seconds" not in plain
    assert isinstance(comp["compile_autotuned"], bool)
    for extra, word in ((["--speculative", "1"], "--speculative"), (["--max-new-tokens", "500"], "max_seq_len")):
        assert main([*base, "--compile", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert word in err and len(err.splitlines()) == 1, err
    # the fallback compile is said in a note
    monkeypatch.setattr(compiled, "COMPILE_OPTIONS", {"not_an_inductor_option": True})
    assert main([a for a in base if a != "--json"] + ["--compile"]) == 0
    assert "compiled without autotuning" in capsys.readouterr().err
