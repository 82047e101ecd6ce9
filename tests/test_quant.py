"""Tests for phaseloop.quant: RTN, GPTQ, Hessian pooling over loop passes, save/load."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from phaseloop.quant import (
    QUANT_ATTR,
    collect_hessians,
    dequantize,
    gptq_quantize,
    load_quantized_state_dict,
    pack_int4,
    quantize_model,
    quantize_rtn,
    quantized_state_dict,
    save_quantized,
    unpack_int4,
)

torch.set_num_threads(1)


class ToyLooped(nn.Module):
    """Embedding -> (one Linear block applied `loops` times) -> head; no biases."""

    def __init__(self, vocab=32, d=64, ff=128, loops=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)
        self.proj = nn.Linear(d, 48, bias=False)      # 48 not divisible by group 32 on its consumer...
        self.back = nn.Linear(48, d, bias=False)      # ...so `back` (in=48) falls back to per-row at group 32
        self.head = nn.Linear(d, vocab, bias=False)
        self.loops = loops

    def forward(self, idx):
        h = self.embed(idx)
        for _ in range(self.loops):
            h = h + 0.5 * self.down(F.gelu(self.up(F.rms_norm(h, (h.shape[-1],)))))
        h = h + 0.5 * self.back(F.gelu(self.proj(h)))
        return SimpleNamespace(logits=self.head(F.rms_norm(h, (h.shape[-1],))))


def _toy(seed=0):
    torch.manual_seed(seed)
    return ToyLooped()


def _batches(n=2, B=2, T=16, vocab=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (B, T), generator=g) for _ in range(n)]


# ----------------------------------------------------------------- RTN

@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("sym", [False, True])
def test_rtn_error_bounded_and_levels(bits, sym):
    torch.manual_seed(0)
    W = torch.randn(16, 128) * torch.linspace(0.1, 3, 16).unsqueeze(1)
    W[0, :32] = 0.0                                   # an all-zero group
    W[1, 32:64] = torch.rand(32) + 1.0                # an all-positive group
    q, s, z = quantize_rtn(W, bits, 32, sym=sym)
    assert q.dtype == torch.uint8 and s.dtype == torch.float16 and z.dtype == torch.float16
    assert q.shape == W.shape and s.shape == (16, 4) and z.shape == (16, 4)
    assert int(q.max()) <= 2 ** bits - 1
    Wh = dequantize(q, s, z)
    err = (Wh - W).abs().reshape(16, 4, 32)
    bound = s.float().unsqueeze(-1) / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all())
    assert bool((Wh[0, :32] == 0).all())              # zero stays exactly zero
    for r in range(16):
        for gi in range(4):
            assert Wh[r, gi * 32:(gi + 1) * 32].unique().numel() <= 2 ** bits
    # 8 bits is much finer than 4 bits
    if bits == 8:
        q4, s4, z4 = quantize_rtn(W, 4, 32, sym=sym)
        assert (dequantize(q4, s4, z4) - W).pow(2).mean() > 50 * (Wh - W).pow(2).mean()


def test_rtn_per_row_and_bad_args():
    W = torch.randn(4, 48)
    q, s, z = quantize_rtn(W, 4, None)
    assert s.shape == (4, 1)
    with pytest.raises(ValueError, match="bits"):
        quantize_rtn(W, 3, 16)
    with pytest.raises(ValueError, match="group_size"):
        quantize_rtn(W, 4, 32)                        # 32 does not divide 48
    with pytest.raises(ValueError, match="bits"):
        quantize_model(_toy(), bits=3)
    with pytest.raises(ValueError, match="method"):
        quantize_model(_toy(), bits=4, method="awq")
    with pytest.raises(ValueError, match="calib_batches"):
        quantize_model(_toy(), bits=4, method="gptq")


@pytest.mark.parametrize("n", [64, 7])
def test_pack_int4_roundtrip(n):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (5, n), generator=g, dtype=torch.uint8)
    p = pack_int4(q)
    assert p.dtype == torch.uint8 and p.shape == (5, (n + 1) // 2)
    assert torch.equal(unpack_int4(p, n), q)
    with pytest.raises(ValueError):
        pack_int4(torch.tensor([[16]], dtype=torch.uint8))


# ----------------------------------------------------------------- GPTQ

def _correlated_inputs(n=1024, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(d, d, generator=g) * torch.logspace(0, -2, d).unsqueeze(1)   # decaying spectrum
    return torch.randn(n, d, generator=g) @ A + 0.3 * torch.randn(n, 1, generator=g)


def test_gptq_beats_rtn_on_output_error():
    X = _correlated_inputs()
    torch.manual_seed(1)
    W = torch.randn(32, 128)
    H = 2 * X.T @ X / X.shape[0]
    ref = X @ W.T
    q, s, z = quantize_rtn(W, 4, 64)
    err_rtn = (ref - X @ dequantize(q, s, z).T).norm()
    qg, sg, zg = gptq_quantize(W, H, 4, 64, damp=0.01, block_size=32)   # block rounded up to 64
    Wg = dequantize(qg, sg, zg)
    err_gptq = (ref - X @ Wg.T).norm()
    assert err_gptq < 0.7 * err_rtn, (float(err_gptq), float(err_rtn))
    assert int(qg.max()) <= 15 and sg.shape == (32, 2)
    for r in range(0, 32, 7):                        # still at most 16 levels per group
        assert Wg[r, :64].unique().numel() <= 16
    # per-row GPTQ also works and also helps
    qp, sp, zp = gptq_quantize(W, H, 4, None)
    qr, sr, zr = quantize_rtn(W, 4, None)
    assert (ref - X @ dequantize(qp, sp, zp).T).norm() < (ref - X @ dequantize(qr, sr, zr).T).norm()


def test_gptq_equals_its_algorithm_column_by_column():
    """Frantar et al. 2022, Alg. 1 written out without the lazy block updates: each column
    quantised with its group's parameters taken from the error-updated weights when the
    group starts, its error spread over the later columns by the upper Cholesky factor of
    H^-1 (damped). The blocked implementation equals it at every block size."""
    from phaseloop.quant.core import qparams, quant_codes

    X = _correlated_inputs(n=256, d=64)
    H = 2 * X.T @ X / X.shape[0]
    torch.manual_seed(3)
    W0, g, bits = torch.randn(6, 64) * 0.5, 16, 4
    Hd = H + 0.01 * torch.diagonal(H).mean() * torch.eye(64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd)), upper=True)
    W, Q, S = W0.clone(), torch.zeros_like(W0), []
    for c in range(64):
        if c % g == 0:
            scale, zero = qparams(W[:, c:c + g], bits, False, torch.float16)
            S.append(scale)
        Q[:, c] = quant_codes(W[:, c], scale, zero, 2 ** bits - 1)
        err = (W[:, c] - (Q[:, c] - zero) * scale) / U[c, c]
        W[:, c:] -= err[:, None] * U[c, c:][None]
    for block in (16, 32, 64):
        q, s, _ = gptq_quantize(W0, H, bits, g, damp=0.01, block_size=block)
        assert torch.equal(q.float(), Q), block
        torch.testing.assert_close(s.float(), torch.stack(S, 1), atol=0, rtol=1e-3)


def test_scales_round_up_to_their_dtype():
    """A scale stored in fp16 / bf16 is the smallest value of that dtype at or above the
    fp32 one (xmax - xmin) / qmax, so every weight of its group lies within half a step of
    its code (the RTN bound)."""
    from phaseloop.quant.core import _round_up_to_dtype

    torch.manual_seed(4)
    s = torch.rand(20000) * 3 + 1e-3
    for dtype in (torch.float16, torch.bfloat16):
        r = _round_up_to_dtype(s, dtype)
        assert torch.equal(r.to(dtype).float(), r) and bool((r >= s).all())
        below = torch.nextafter(r.to(dtype), torch.zeros((), dtype=dtype)).float()
        assert bool((below < s).all())  # the smallest such value
    w = torch.randn(400, 32)
    q, sc, z = quantize_rtn(w, 4, 32)
    step = sc.float().repeat_interleave(32, 1)
    assert float(((dequantize(q, sc, z) - w).abs() / step).max()) <= 0.5 + 1e-6


def test_gptq_dead_columns():
    X = _correlated_inputs(n=256, d=64)
    X[:, 5] = 0.0
    X[:, 40] = 0.0
    H = 2 * X.T @ X / X.shape[0]
    torch.manual_seed(2)
    W = torch.randn(8, 64)
    q, s, z = gptq_quantize(W, H, 8, 32)
    Wh = dequantize(q, s, z)
    assert torch.isfinite(Wh).all()
    assert bool((Wh[:, [5, 40]] == 0).all())
    assert (X @ W.T - X @ Wh.T).norm() / (X @ W.T).norm() < 0.02


# ----------------------------------------------------------------- Hessian pooling over loops

def test_hessian_pools_all_loop_passes():
    model = _toy()
    batches = _batches()
    calls = []
    h = model.up.register_forward_hook(lambda m, i, o: calls.append(i[0].detach().reshape(-1, 64).clone()))
    with torch.no_grad():
        for b in batches:
            model(b)
    h.remove()
    assert len(calls) == 2 * 3                        # 2 batches x 3 loop passes
    X_all = torch.cat(calls)
    H_all = 2 * X_all.T @ X_all / X_all.shape[0]
    first = torch.cat(calls[0::3])                    # only the first pass of each batch
    H_first = 2 * first.T @ first / first.shape[0]

    hs, counts = collect_hessians(model, batches, ["up", "down", "back"], return_counts=True)
    assert counts["up"] == {"rows": 2 * 2 * 16 * 3, "calls": 6}
    assert counts["back"] == {"rows": 2 * 2 * 16, "calls": 2}
    torch.testing.assert_close(hs["up"], H_all, rtol=1e-4, atol=1e-5)
    assert (hs["up"] - H_first).abs().max() > 1e-2
    # hooks are gone afterwards
    assert not model.up._forward_hooks


def test_hessian_pools_modules_sharing_a_weight():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.b = nn.Linear(8, 8, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    m = Tied()
    x = torch.randn(10, 8)
    hs = collect_hessians(m, [x], None)
    xa, xb = x, torch.tanh(m.a(x)).detach()
    X = torch.cat([xa, xb])
    torch.testing.assert_close(hs["a"], 2 * X.T @ X / 20, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(hs["b"], hs["a"])


# ----------------------------------------------------------------- whole model

def _rel_err(model, ref, batches):
    with torch.no_grad():
        out = torch.cat([model(b).logits for b in batches])
    return float((out - ref).norm() / ref.norm())


def _each_width(method: str):
    """(bits, quantised toy model, report, error rel. to the fp32 toy, reference logits,
    batches) for 8 and 4 bits."""
    batches = _batches()
    base = _toy()
    with torch.no_grad():
        ref = torch.cat([base(b).logits for b in batches])
    for bits in (8, 4):
        model = _toy()
        rep = quantize_model(model, bits=bits, group_size=32, method=method)
        yield bits, model, rep, _rel_err(model, ref, batches), ref, batches


def test_quantize_model_rtn_and_save_load(tmp_path):
    base = _toy()
    errs = {}
    for bits, model, rep, errs[bits], ref, batches in _each_width("rtn"):
        assert rep["n_quantized"] == 4 and set(rep["layers"]) == {"up", "down", "proj", "back"}
        assert rep["per_row_fallback"] == ["back"] and rep["layers"]["back"]["group_size"] == 48
        assert rep["bytes_after"] < rep["bytes_before"]
        assert rep["quantized_bytes_after"] < rep["quantized_bytes_before"] * (bits / 32 + 0.1)
        # up: 128x64 -> bits/8 per weight + 2 groups x (fp16 scale + fp16 zero) per row
        assert rep["layers"]["up"]["bytes_after"] == 128 * 64 * bits // 8 + 128 * 2 * 4
        assert all(v["mse"] > 0 for v in rep["layers"].values())
        assert torch.equal(model.head.weight, base.head.weight)      # skipped by default
        assert torch.equal(model.embed.weight, base.embed.weight)

        path = tmp_path / f"q{bits}.safetensors"
        save_quantized(model, path)
        sd = quantized_state_dict(model)
        assert sd["up.weight.qdata"].dtype == torch.uint8 and sd["up.weight.scale"].dtype == torch.float16
        assert sd["up.weight.qdata"].shape == ((128, 32) if bits == 4 else (128, 64))
        assert "up.weight" not in sd and "head.weight" in sd
        fresh = _toy(seed=123)
        plain = load_quantized_state_dict(path, fresh)
        for name, p in model.state_dict().items():
            assert torch.equal(plain[name], p), name
            assert torch.equal(fresh.state_dict()[name], p), name
        assert getattr(fresh.up, QUANT_ATTR).bits == bits
        assert _rel_err(fresh, ref, batches) == pytest.approx(errs[bits], rel=1e-5)
    assert errs[8] < 0.01, errs
    assert errs[8] < errs[4] < 0.3, errs


def test_quantize_model_gptq_looped():
    batches = _batches(n=4, B=4, T=16, seed=3)
    base = _toy()
    with torch.no_grad():
        ref = torch.cat([base(b).logits for b in batches])
    rtn = _toy()
    quantize_model(rtn, bits=4, group_size=32, method="rtn")
    gptq = _toy()
    rep = quantize_model(gptq, bits=4, group_size=32, method="gptq", calib_batches=batches)
    assert rep["n_quantized"] == 4
    assert rep["layers"]["up"]["calls"] == 4 * 3 and rep["layers"]["up"]["rows"] == 4 * 4 * 16 * 3
    assert rep["bytes_after"] < rep["bytes_before"]
    e_rtn, e_gptq = _rel_err(rtn, ref, batches), _rel_err(gptq, ref, batches)
    assert e_gptq < e_rtn, (e_gptq, e_rtn)
    seq = _toy()
    rep_s = quantize_model(seq, bits=4, group_size=32, method="gptq", calib_batches=batches, sequential=True)
    assert list(rep_s["layers"]) == ["up", "down", "proj", "back"]
    assert _rel_err(seq, ref, batches) < e_rtn


def test_head_tied_to_embedding_is_left_alone():
    model = _toy()
    model.head.weight = model.embed.weight
    before = model.embed.weight.detach().clone()
    rep = quantize_model(model, bits=4, group_size=32, skip=())     # head not skipped by name...
    assert rep["skipped_shared"] == ["head"]                          # ...but its weight is the embedding
    assert torch.equal(model.embed.weight, before)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
def test_torchao_cpu():
    errs = {}
    for bits, _, rep, err, _, _ in _each_width("torchao"):
        errs[bits] = err
        assert rep["n_quantized"] == 4 and rep["bytes_after"] < rep["bytes_before"]
    assert errs[8] < 0.01 and errs[8] < errs[4] < 0.3, errs


def test_gptq_runs_in_full_fp32_with_tf32_restored_after(monkeypatch):
    """TF32 (CUDA's 10-bit-mantissa fp32 products) is off while GPTQ builds its Hessian and
    propagates errors, as the reference implementation sets it, and the caller's setting
    comes back after; nothing in phaseloop switches it on outside a training step."""
    from torch.overrides import TorchFunctionMode

    from phaseloop.engine import resolve_device
    from phaseloop.engine.optim import tf32
    from phaseloop.quant.gptq import _HessianAccumulator

    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    seen = []

    class Products(TorchFunctionMode):  # the TF32 flags at every matrix product GPTQ calls
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("addmm_", "matmul", "__matmul__"):
                seen.append([f.allow_tf32 for f in flags])
            return func(*args, **(kwargs or {}))

    with tf32(True), Products():
        acc = _HessianAccumulator(8, "cpu")
        acc.add(torch.randn(5, 8))
        gptq_quantize(torch.randn(4, 8), acc.H, 4, 4, block_size=4)  # two blocks: Err1 @ Hinv
        assert [f.allow_tf32 for f in flags] == [True, True]  # restored
    assert len(seen) >= 2 and all(s == [False, False] for s in seen), seen
    before = [f.allow_tf32 for f in flags]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve_device("cuda") switched TF32 on
    assert resolve_device("cuda") == torch.device("cuda") and resolve_device("auto") == torch.device("cuda")
    assert [f.allow_tf32 for f in flags] == before


def test_byte_layouts_and_counts():
    """int4 packs the even column in the low nibble (a file's layout, which other tools
    read); storage counts rows padded to whole bytes and a partial last group; an int8
    layer's running bytes are its codes and scales, not the kernel's constant of ones;
    ``quantize_model`` counts fp32 scales at 4 bytes."""
    from phaseloop.quant.core import QuantizedWeight, pack_int4, packed_bytes
    from phaseloop.quant.packed import PackedLinear, weight_bytes

    assert pack_int4(torch.tensor([[1, 2]])).tolist() == [[0x21]]
    assert packed_bytes(8, 100, 4, 32) == 8 * 50 + 8 * 4 * 2 * 2  # ceil(100 / 32) = 4 groups
    assert packed_bytes(8, 7, 4, None) == 8 * 4 + 8 * 1 * 2 * 2  # 7 codes in 4 bytes
    torch.manual_seed(0)
    q, s, z = quantize_rtn(torch.randn(16, 64), 8, 32)
    layer = PackedLinear(QuantizedWeight.from_codes(q, s, z, 8))
    held = [t for t in layer.buffers(recurse=False) if t is not None and t is not getattr(layer, "ones", None)]
    assert getattr(layer, "ones", None) is not None
    assert weight_bytes(nn.Sequential(layer)) == (sum(t.untyped_storage().nbytes() for t in held), 4 * 16 * 64)
    r = quantize_model(nn.Sequential(nn.Linear(64, 64, bias=False)), 4, 32, skip=(), scale_dtype=torch.float32)
    assert r["quantized_bytes_after"] == 64 * 32 + 64 * 2 * 2 * 4


@pytest.mark.parametrize("method", ["rtn", "torchao"])
def test_a_layer_narrower_than_its_group_is_recorded_as_per_row(method):
    """group_size 1024 on rope-tiny (every in_features below it): each layer falls back to
    one group per row, and the report names every one."""
    if method == "torchao" and importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed (the quant extra)")
    from phaseloop import ModelConfig, build_model

    torch.manual_seed(0)
    rep = quantize_model(build_model(ModelConfig.from_preset("rope-tiny")), bits=8, group_size=1024, method=method)
    assert rep["n_quantized"] > 0 and len(rep["per_row_fallback"]) == rep["n_quantized"]
