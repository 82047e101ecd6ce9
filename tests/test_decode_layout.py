"""inference.decode_layout (issue 40): fp32 Linear weights at least as wide out as in are
stored column-major for one-row products; the function of every architecture is unchanged
(logits within 1e-5 relative, greedy tokens equal), ties and shapes stay, and what it must
not touch (narrower outputs, other dtypes, packed layers) is left as it was."""

import pytest
import torch
from torch import nn

from phaseloop import ModelConfig, build_model
from phaseloop.inference import Options, decode_layout, generate
from phaseloop.quant import PackedLinear, QuantizedWeight, quantize_rtn

PRESETS = ("rope-tiny", "3pt-tiny", "universal-act-tiny", "looped-tiny", "hyperloop-tiny", "mhc-tiny")


def _model(name, **kw):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_preset(name, **kw)).eval()


@pytest.mark.parametrize("name", PRESETS)
def test_the_function_is_unchanged(name):
    model = _model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    prompt = x[:1, :5]
    with torch.no_grad():
        ref = model(x).logits
    greedy = generate(model, prompt, Options(max_new_tokens=12, temperature=0)).tokens
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    laid = decode_layout(model)
    wide = {id(m.weight) for m in linears if m.out_features >= m.in_features}
    assert laid == len(wide) > 0
    for m in linears:
        w = m.weight
        if id(w) in wide:  # a view of a contiguous [K, N] tensor
            assert not w.is_contiguous() and w.t().is_contiguous()
        else:  # narrower outputs stream faster row-major
            assert w.is_contiguous()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():
        got = model(x).logits
    assert torch.allclose(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(generate(model, prompt, Options(max_new_tokens=12, temperature=0)).tokens, greedy)
    assert decode_layout(model) == laid  # laid out already: nothing moves
    assert all(w.t().is_contiguous() for w in (m.weight for m in linears) if id(w) in wide)


def test_a_tied_head_stays_tied():
    model = _model("rope-tiny", tie_embeddings=True)
    assert model.head.weight is model.embed.tok.weight
    x = torch.randint(0, model.cfg.vocab_size, (1, 9))
    with torch.no_grad():
        ref = model(x).logits
        decode_layout(model)
        got = model(x).logits
    assert model.head.weight is model.embed.tok.weight and model.head.weight.t().is_contiguous()
    assert torch.allclose(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_what_it_leaves_alone():
    model = _model("rope-tiny").to(torch.bfloat16)
    assert decode_layout(model) == 0 and all(p.is_contiguous() for p in model.parameters())
    torch.manual_seed(0)
    lin, narrow = nn.Linear(32, 64), nn.Linear(64, 32)
    q, s, z = quantize_rtn(torch.randn(32, 32) * 0.02, 4, 32)
    packed = PackedLinear(QuantizedWeight.from_codes(q, s, z, 4))  # its codes keep the kernel's layout
    holder = nn.Sequential(lin, narrow, packed)
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref = holder(x)
        codes = packed.codes.clone()
        assert decode_layout(holder) == 1
        assert torch.allclose(holder(x), ref, rtol=0, atol=1e-6)
    assert lin.weight.t().is_contiguous() and narrow.weight.is_contiguous()
    assert packed.codes.is_contiguous() and torch.equal(packed.codes, codes)


def test_generate_and_serve_lay_out_what_they_load(tmp_path, monkeypatch, capsys):
    """`phaseloop generate` and `serve`'s loader run the laid-out model; export does not (a
    safetensors file takes contiguous tensors), and the run's checkpoint is untouched."""
    pytest.importorskip("starlette")
    from conftest import tiny_runs

    from phaseloop.cli import main, run_cmds
    from phaseloop.serve.loading import load

    run = tiny_runs(tmp_path, ("rope-tiny",))["rope-tiny"]
    weights = sorted(run.rglob("model.safetensors"))
    before = [w.read_bytes() for w in weights]
    served = load(run)
    assert served.model.head.weight.t().is_contiguous()
    seen = []
    real = run_cmds.decode_layout
    monkeypatch.setattr(run_cmds, "decode_layout", lambda m: seen.append(real(m)) or seen[-1])
    assert main(["generate", str(run), "--max-new-tokens", "3", "--temperature", "0", "--device", "cpu"]) == 0
    assert seen and seen[0] > 0
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert weights and [w.read_bytes() for w in weights] == before
