"""Why phaseloop runs its own packed Linear on torch's ATen kernels with bf16 activations, and
its fp32 Linears on oneDNN with prepacked weights (``inference.decode_layout``;
docs/deploy.md): one matrix product ``x [M, K] @ W^T`` per kernel and activation dtype,
interleaved, medians of microseconds. Weights are cycled through distinct copies (more
bytes than the last-level cache) so each product reads its weight from memory, as a
decode step does."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from phaseloop.inference import onednn_linear
from phaseloop.quant import PackedLinear, QuantizedWeight, quantize_rtn


def _variants(W: torch.Tensor) -> dict:
    """name -> fn(x) of one weight, each kernel holding its own copy or packing."""
    q8, s8, z8 = quantize_rtn(W, 8, None, sym=True)
    int8 = PackedLinear(QuantizedWeight.from_codes(q8, s8, z8, 8, sym=True))
    q4, s4, z4 = quantize_rtn(W, 4, 32)
    int4 = PackedLinear(QuantizedWeight.from_codes(q4, s4, z4, 4))
    def int8mm(dt, s):
        return lambda x: torch._weight_int8pack_mm(x.to(dt), int8.codes, s)

    def int4mm(dt, sz):
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dt), int4.codes, 32, sz)

    Wb, Wc = W.bfloat16(), W.t().contiguous().t()
    out = {"fp32 F.linear": lambda x: F.linear(x, W),
           "fp32 F.linear, column-major weight": lambda x: F.linear(x, Wc),  # decode_layout without oneDNN
           "bf16 F.linear": lambda x: F.linear(x.bfloat16(), Wb),
           "int8 kernel, fp32 act": int8mm(torch.float32, int8.scale[0].float()),
           "int8 kernel, bf16 act": int8mm(torch.bfloat16, int8.scale[0]),
           "int4 g32 kernel, fp32 act": int4mm(torch.float32, int4.scale_zero.float()),
           "int4 g32 kernel, bf16 act": int4mm(torch.bfloat16, int4.scale_zero)}
    if onednn_linear():  # PrepackedLinear's product (inference.decode_layout), called whatever the rows
        pre = torch.ops.mkldnn._reorder_linear_weight(W, None)
        out["fp32 oneDNN, prepacked weight"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, pre, None, "none",
                                                                                            [None], "")
    out.update(_torchao(W))
    return out


def _torchao(W: torch.Tensor) -> dict:
    """torchao 0.18's CPU weight-only configs, where torchao is installed: int8 (its v2
    tensor) and the prototype int4 CPU layout, as ``quantize_`` leaves an ``nn.Linear``."""
    try:
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except Exception:  # not installed (it is no dependency of phaseloop's)
        return {}
    def call(lin, dt):
        return lambda x: lin(x.to(dt))

    out = {}
    for name, make, dt in (("torchao Int8WeightOnly, fp32 act", Int8WeightOnlyConfig, torch.float32),
                           ("torchao Int8WeightOnly, bf16 act", Int8WeightOnlyConfig, torch.bfloat16),
                           ("torchao PrototypeInt4WeightOnly g32, bf16 act",
                            lambda: PrototypeInt4WeightOnlyConfig(group_size=32), torch.bfloat16)):
        lin = torch.nn.Linear(W.shape[1], W.shape[0], bias=False, dtype=dt)
        with torch.no_grad():
            lin.weight.copy_(W)
        quantize_(lin, make())
        out[name] = call(lin, dt)
    return out


def kernel_table(shapes=((2048, 768), (768, 2048), (32000, 768)), ms=(1, 128), copies_mb: int = 256,
                 reps: int = 9) -> list:
    """Rows (N, K, M, name, median us, ratio to fp32 F.linear)."""
    rows = []
    torch.manual_seed(0)
    for N, K in shapes:
        copies = max(2, copies_mb * 2 ** 20 // (N * K * 4))
        variants = [_variants(torch.randn(N, K) * 0.02) for _ in range(copies)]
        for M in ms:
            x = torch.randn(M, K)
            names = [n for n in variants[0] if M == 1 or "fp32 act" not in n]  # those take seconds at M=128
            times = {n: [] for n in names}
            with torch.no_grad():
                for v in variants:  # warm
                    for n in names:
                        v[n](x)
                for _ in range(reps):
                    for n in names:
                        t0 = time.perf_counter()
                        for v in variants:
                            v[n](x)
                        times[n].append((time.perf_counter() - t0) / len(variants))
            base = statistics.median(times["fp32 F.linear"])
            for n in names:
                t = statistics.median(times[n])
                rows.append((N, K, M, n, 1e6 * t, base / t))
    return rows


def print_kernels(rows) -> None:
    print("\n| product | M | kernel | us | speed vs fp32 |\n|---|---|---|---|---|")
    for N, K, M, name, us, ratio in rows:
        print(f"| {K}->{N} | {M} | {name} | {us:.0f} | {ratio:.2f}x |")


def layout_table(preset: str = "rope-123m", batches=(1, 2, 4, 8), steps: int = 8, reps: int = 3) -> list:
    """One decode step of ``preset`` (random weights) with ``batches`` rows, its Linears as
    built (row-major), laid out column-major (``decode_layout(prepack=False)``, torch
    without oneDNN) and prepacked (``decode_layout``), interleaved: rows (batch, ms of each,
    row-major / prepacked, column-major / prepacked)."""
    import copy

    from phaseloop import ModelConfig, build_model
    from phaseloop.inference import decode_layout
    from phaseloop.kvcache import KVCache

    cfg = ModelConfig.from_preset(preset)
    torch.manual_seed(0)
    row = build_model(cfg).eval()
    col, pre = copy.deepcopy(row), copy.deepcopy(row)
    decode_layout(col, prepack=False)
    decode_layout(pre)
    out = []
    with torch.no_grad():
        for B in batches:
            prompt = torch.randint(0, cfg.vocab_size, (B, 16))
            x = torch.randint(0, cfg.vocab_size, (B, 1))
            times: dict = {"row": [], "col": [], "pre": []}
            for _ in range(reps):
                for name, m in (("row", row), ("col", col), ("pre", pre)):
                    cache = KVCache(capacity=16 + steps)
                    m(prompt, cache=cache)
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        m(x, cache=cache)
                    times[name].append((time.perf_counter() - t0) / steps)
            r, c, p = (statistics.median(times[k]) for k in ("row", "col", "pre"))
            out.append((B, 1e3 * r, 1e3 * c, 1e3 * p, r / p, c / p))
    return out


def print_layout(rows, preset: str) -> None:
    print(f"\n{preset}, one decode step, Linears as built (row-major), column-major and prepacked "
          "(decode_layout):\n")
    print("| batch | row-major ms | column-major ms | prepacked ms | prepacked vs row-major | vs column-major |\n"
          "|---|---|---|---|---|---|")
    for B, r, c, p, sr, sc in rows:
        print(f"| {B} | {r:.2f} | {c:.2f} | {p:.2f} | {sr:.2f}x | {sc:.2f}x |")
