"""inference.decode_layout (issues 39, 40): fp32 CPU Linears run on oneDNN with their weight
prepacked (``PrepackedLinear``), or where torch has no oneDNN their wide weights are stored
column-major. The function of every architecture is unchanged (logits within 1e-5 of the
largest, greedy tokens equal), ties, names and parameters stay, a changed weight is packed
again, autograd and copies see plain Linears, and what it must not touch is left alone."""

import copy
import json
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from phaseloop import ModelConfig, build_model, inference
from phaseloop.inference import Options, PrepackedLinear, decode_layout, generate, onednn_linear, prepacked_bytes
from phaseloop.quant import PackedLinear, QuantizedWeight, quantize_rtn, weight_bytes

PRESETS = ("rope-tiny", "3pt-tiny", "universal-act-tiny", "looped-tiny", "hyperloop-tiny", "mhc-tiny")
needs_onednn = pytest.mark.skipif(not onednn_linear(), reason="this torch has no oneDNN inner product")


def _model(name, **kw):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_preset(name, **kw)).eval()


@pytest.fixture(params=["prepacked", "column-major"])
def layout(request, monkeypatch):
    if request.param == "prepacked" and not onednn_linear():
        pytest.skip("this torch has no oneDNN inner product")
    if request.param == "column-major":  # torch without oneDNN
        monkeypatch.setattr(inference, "onednn_linear", lambda: False)
    return request.param


@pytest.mark.parametrize("name", PRESETS)
def test_the_function_is_unchanged(name, layout):
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
    if layout == "prepacked":
        assert laid == len(linears) > 0 and all(type(m) is PrepackedLinear for m in linears)
    else:
        assert laid == len(wide) > 0 and not any(isinstance(m, PrepackedLinear) for m in linears)
    for m in linears:  # wide: a view of a contiguous [K, N] tensor; narrower outputs stay row-major
        assert m.weight.t().is_contiguous() and not m.weight.is_contiguous() if id(m.weight) in wide \
            else m.weight.is_contiguous()
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():
        got = model(x).logits
    assert torch.allclose(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(generate(model, prompt, Options(max_new_tokens=12, temperature=0)).tokens, greedy)
    assert decode_layout(model) == laid  # laid out already: nothing moves


def test_a_tied_head_stays_tied(layout):
    model = _model("rope-tiny", tie_embeddings=True)
    assert model.head.weight is model.embed.tok.weight
    x = torch.randint(0, model.cfg.vocab_size, (1, 9))
    with torch.no_grad():
        ref = model(x).logits
        decode_layout(model)
        got = model(x).logits
    assert model.head.weight is model.embed.tok.weight and model.head.weight.t().is_contiguous()
    assert isinstance(model.head, PrepackedLinear) == (layout == "prepacked")
    assert torch.allclose(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_what_it_leaves_alone(layout):
    model = _model("rope-tiny").to(torch.bfloat16)
    assert decode_layout(model) == 0 and all(p.is_contiguous() for p in model.parameters())
    assert not any(isinstance(m, PrepackedLinear) for m in model.modules())

    class Scaled(nn.Linear):  # a subclass keeps its forward: laid out column-major if wide
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    lin, narrow, sub = nn.Linear(32, 64), nn.Linear(64, 32), Scaled(32, 32)
    q, s, z = quantize_rtn(torch.randn(32, 32) * 0.02, 4, 32)
    packed = PackedLinear(QuantizedWeight.from_codes(q, s, z, 4))  # its codes keep the kernel's layout
    holder = nn.Sequential(lin, narrow, sub, packed)
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref, ref_fp32 = holder(x), holder[:3](x)
        codes = packed.codes.clone()
        assert decode_layout(holder) == (3 if layout == "prepacked" else 2)
        # the packed layer rounds its input to bf16 (quant.ACT_DTYPE): a last-bit change upstream shows
        assert torch.allclose(holder(x), ref, rtol=0, atol=1e-2 * ref.abs().max().item())
        assert torch.allclose(holder[:3](x), ref_fp32, rtol=0, atol=1e-5)
    assert type(sub) is Scaled and sub.weight.t().is_contiguous()
    assert type(packed) is PackedLinear and packed.codes.is_contiguous() and torch.equal(packed.codes, codes)
    assert lin.weight.t().is_contiguous() and narrow.weight.is_contiguous()
    assert (type(lin), type(narrow)) == ((PrepackedLinear,) * 2 if layout == "prepacked" else (nn.Linear,) * 2)


@needs_onednn
def test_a_changed_weight_is_packed_again():
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    decode_layout(lin)
    x = torch.randn(5, 16)
    with torch.no_grad():
        first = lin.packed()
        assert lin.packed() is first  # unchanged: the same copy
        lin.weight.mul_(2)  # in place: a new version
        assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)
        lin.load_state_dict({"weight": torch.randn(24, 16), "bias": torch.zeros(24)})
        assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)
        lin.weight.data = torch.randn(24, 16)  # new storage
        assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)  # a training step between two inferences
    lin(x).square().sum().backward()
    opt.step()
    with torch.no_grad():
        assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)


@needs_onednn
def test_a_reused_address_or_a_write_it_cannot_see():
    """The packed copy holds the weight's storage, so a new weight never lands at its address
    with its key (functional_call hands fresh tensors at version 0 every call); a write through
    ``.data`` keeps the version, and ``decode_layout`` again packs anew."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    decode_layout(lin)
    x = torch.randn(5, 16)
    with torch.no_grad():
        for _ in range(6):
            params = {"weight": torch.randn(24, 16), "bias": torch.zeros(24)}
            got = torch.func.functional_call(lin, params, (x,))
            assert torch.allclose(got, F.linear(x, params["weight"], params["bias"]), atol=1e-5)
        for _ in range(3):  # .data assigned twice without a product between
            lin.weight.data = torch.randn(24, 16)
            lin.weight.data = torch.randn(24, 16)
            assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)
        lin.weight.data.mul_(3)  # unseen by the version counter
        decode_layout(lin)
        assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)


@needs_onednn
def test_what_runs_on_f_linear_instead(monkeypatch):
    """A bias alone trained gets its gradient; autocast gets its dtype; oneDNN switched off, a
    tensor-subclass weight and ``prepack=False`` (a plain Linear again) are F.linear's."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    decode_layout(lin)
    x = torch.randn(5, 16)
    lin.weight.requires_grad_(False)
    lin(x).sum().backward()
    assert torch.equal(lin.bias.grad, torch.full((24,), 5.0))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))

    class Tagged(torch.Tensor):  # stands for a quantised tensor subclass (torchao)
        pass

    sub = nn.Linear(16, 8)
    sub.weight = nn.Parameter(sub.weight.detach().as_subclass(Tagged), requires_grad=False)
    holder = nn.Sequential(sub, lin)
    assert decode_layout(holder) == 1 and type(sub) is nn.Linear and type(sub.weight.data) is Tagged
    assert decode_layout(holder, prepack=False) == 1 and type(lin) is nn.Linear and "_onednn" not in lin.__dict__
    assert lin.weight.t().is_contiguous()


@needs_onednn
def test_one_row_on_one_thread_runs_on_mkl(monkeypatch):
    """Where MKL's column-major product measured faster (docs/deploy.md); any other call on oneDNN."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 24)
    decode_layout(lin)
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            for n in (1, 2):
                torch.set_num_threads(n)
                for x in (torch.randn(1, 16), torch.randn(1, 1, 16), torch.randn(3, 16), torch.randn(2, 1, 16)):
                    assert torch.allclose(lin(x), real(x, lin.weight, lin.bias), atol=1e-5)
    finally:
        torch.set_num_threads(threads)
    assert calls == [(1, 16), (1, 1, 16)]  # the one-row calls on one thread, nothing else


@needs_onednn
def test_autograd_copies_and_other_inputs_see_a_plain_linear():
    model = _model("rope-tiny")
    plain = copy.deepcopy(model)
    decode_layout(model)
    x = torch.randint(0, model.cfg.vocab_size, (2, 10))
    for m in (model, plain):  # with grad: F.linear, the same gradients bit for bit
        F.cross_entropy(m(x).logits.flatten(0, 1), x.flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name
    twin = copy.deepcopy(model)  # the packed copies are not copied: packed again when used
    again = pickle.loads(pickle.dumps(model.head))
    assert type(twin.head) is PrepackedLinear and "_onednn" not in twin.head.__dict__
    assert "_onednn" not in again.__dict__ and "_onednn" in model.head.__dict__
    with torch.no_grad():
        assert torch.allclose(twin(x).logits, model(x).logits, rtol=0, atol=1e-6)
        h = torch.randn(3, model.cfg.d_model, dtype=torch.float64)  # another dtype: F.linear's refusal
        with pytest.raises(RuntimeError):
            model.head(h)
        assert torch.equal(model.double().head(h), F.linear(h, model.head.weight))


@needs_onednn
def test_a_weight_made_in_inference_mode_stays_on_f_linear():
    """It keeps no version counter, so a change in place could not be told: never packed."""
    with torch.inference_mode():
        lin = nn.Linear(8, 16)
        assert decode_layout(lin) == 1 and type(lin) is nn.Linear and lin.weight.t().is_contiguous()
        x = torch.randn(3, 8)
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    other = nn.Linear(8, 16)
    decode_layout(other)
    other.__dict__.pop("_onednn")
    with torch.inference_mode():  # a weight made outside: packed in inference mode, used after
        x = torch.randn(3, 8)
        assert torch.allclose(other(x), F.linear(x, other.weight, other.bias), atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(other(x), F.linear(x, other.weight, other.bias), atol=1e-6)
    assert torch.equal(PrepackedLinear.forward(lin, x), F.linear(x, lin.weight, lin.bias))  # by hand: falls back


@needs_onednn
def test_weight_bytes_count_the_packed_copies():
    model = _model("rope-tiny")
    params, fp32 = weight_bytes(model)
    linear = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    decode_layout(model)
    assert prepacked_bytes(model) >= linear
    assert weight_bytes(model) == (params + prepacked_bytes(model), fp32)


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
    assert isinstance(served.model.head, PrepackedLinear) == onednn_linear()
    lean = load(run, prepack=False)  # `serve --no-prepack`
    assert lean.model.head.weight.t().is_contiguous() and not isinstance(lean.model.head, PrepackedLinear)
    assert lean.info["weight_bytes"] < served.info["weight_bytes"] or not onednn_linear()
    seen = []
    real = run_cmds.decode_layout
    monkeypatch.setattr(run_cmds, "decode_layout", lambda m, **kw: seen.append(real(m, **kw)) or seen[-1])
    base = ["generate", str(run), "--max-new-tokens", "3", "--temperature", "0", "--device", "cpu", "--json"]
    capsys.readouterr()  # the run's training
    assert main(base) == 0
    packed = json.loads(capsys.readouterr().out)
    assert main([*base, "--no-prepack"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert seen[0] > seen[1] > 0 if onednn_linear() else seen[0] == seen[1] > 0
    assert plain["weight_bytes"] == plain["weight_bytes_fp32"] and plain["tokens"] == packed["tokens"]
    assert packed["weight_bytes"] > plain["weight_bytes"] or not onednn_linear()
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert weights and [w.read_bytes() for w in weights] == before
