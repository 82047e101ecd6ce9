"""Quantised Linears that stay packed as the model runs: int8 and int4 weights multiplied
by torch's weight-only CPU kernels, never dequantised to fp32.

Kernels (ATen, torch 2.13, CPU): ``torch._weight_int8pack_mm(x, w8, scales)`` (int8
[N, K], one scale per output row) and ``aten._weight_int4pack_mm_for_cpu(x, packed, g,
scales_and_zeros)`` (codes 0..15 packed by ``_convert_weight_to_int4pack_for_cpu``;
``w = (q - 8) * scale + zero`` per group of g = 32, 64, 128 or 256 input columns; N a
multiple of 16). Both are fast only with bfloat16 activations on a CPU without AVX-512
(fp32 activations take their scalar path, 10-50x slower; docs/deploy.md's table), so
activations are cast to bf16 for the matmul and back; the scales are rounded to bf16
(they are fp16 in the file). torchao 0.18 has no faster x86 CPU path: its int4 CPU
layout calls the same ATen kernel, its int8 weight-only path dequantises on every call.

The weight is exactly ``quant.core.dequantize``'s ``w = (q - zero) * scale`` per group:

* int4: the kernel's zero is ``(8 - zero) * scale``; a group the kernel cannot take
  (a row of 768 columns, 96, ...) is its largest kernel group dividing it, the scale
  repeated; a row of a length no kernel group divides (176) is padded with zero
  activations to a multiple of 32.
* int8: codes ``c = q - 128`` (int8; a row padded with zero codes to a multiple of 16, which
  the kernel's bf16 path needs), ``w = c * scale + (128 - zero) * scale``, so
  ``y = x @ (c * scale)^T + sum_g (sum_{k in g} x_k) * (128 - zero_g) * scale_g``. One
  group per row is one kernel call; with G groups the kernel (whose scale is per row)
  gets the activations stacked G times, each zero outside its group, and the G partial
  sums are scaled and added: the weight is still read once.

A layer the kernels cannot take (int4 with N not a multiple of 16, or groups that are
not a multiple of 32 within a row) keeps its dequantised weight in fp32 (``PackedLinear.kernel == "fp32"``),
counted so by ``weight_bytes``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from phaseloop.inference import prepacked_bytes
from phaseloop.quant.core import QuantizedWeight

ACT_DTYPE = torch.bfloat16  # the kernels' fast path on AVX2 CPUs (module docstring)
INT4_GROUPS = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu takes
INT8_ROW = 16  # _weight_int8pack_mm with bf16 activations: rows of a multiple of 16 (K = 72 crashed, torch 2.13)


def int4_layout(group_size: int, out_features: int, in_features: int) -> tuple[int, int] | None:
    """(kernel group, padded in_features) for an int4 weight quantised in groups of
    ``group_size``: the largest kernel group dividing it; one group per row whose length
    no kernel group divides is padded with zero activations to a multiple of 32 (the
    padded columns multiply zeros). None when the kernel cannot take the weight."""
    if out_features % 16:
        return None
    kg = next((g for g in INT4_GROUPS if group_size % g == 0), None)
    if kg is not None:
        return kg, in_features
    if group_size == in_features:
        padded = -(-in_features // 32) * 32
        return next(g for g in INT4_GROUPS if padded % g == 0), padded
    return None


class PackedLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` a :class:`QuantizedWeight` kept packed (module
    docstring). ``kernel``: "int8", "int4" or "fp32" (a layer the kernels cannot take)."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                 act_dtype: torch.dtype = ACT_DTYPE):
        super().__init__()
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size, self.act_dtype = qw.bits, qw.group_size, act_dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        N, K, G = self.out_features, self.in_features, qw.group_size
        scale, zero = qw.scale.float(), qw.zero.float()  # [N, K // G]
        layout = int4_layout(G, N, K) if qw.bits == 4 else None
        self.padded = K
        if qw.bits == 8:
            # the kernel's bf16 path reads rows of a multiple of 16 (others crashed or read past them):
            # the codes padded with zeros, the activations with zeros where they are multiplied
            self.kernel, self.padded = "int8", -(-K // INT8_ROW) * INT8_ROW
            codes = (qw.codes().to(torch.int16) - 128).to(torch.int8)
            self.register_buffer("codes", torch.nn.functional.pad(codes, (0, self.padded - K)).contiguous())
            self.register_buffer("scale", scale.t().contiguous().to(act_dtype))  # [n_groups, N]
            offset = (128 - zero) * scale  # [N, n_groups]: the weight's per-group constant
            self.register_buffer("offset", None if bool((offset == 0).all()) else offset.t().contiguous())
            self.register_buffer("ones", torch.ones(N, dtype=act_dtype) if scale.shape[1] > 1 else None)
        elif layout is not None:
            self.kernel, (self.kernel_group, self.padded) = "int4", layout
            kg, pad = self.kernel_group, self.padded - K
            sz = torch.stack([scale, (8 - zero) * scale], -1)  # [N, n_groups, 2]
            sz = sz.repeat_interleave(G // kg, dim=1) if pad == 0 else sz.expand(N, self.padded // kg, 2)
            self.register_buffer("scale_zero", sz.transpose(0, 1).contiguous().to(act_dtype))  # [K'/kg, N, 2]
            codes = torch.nn.functional.pad(qw.codes().to(torch.int32), (0, pad), value=8)
            self.register_buffer("codes", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1))
        else:
            self.kernel = "fp32"
            self.register_buffer("weight", qw.dequantize(torch.float32))
        self.n_groups = K // G

    def _apply(self, fn, recurse=True):
        """``.to(dtype)``, ``.double()``, ``.half()`` move the module but keep its buffers as
        they are (dtype and values; only their device follows): the kernels take int codes and
        bf16 scales, and a round trip through another dtype would round the fp32 offsets."""
        old = {n: b for n, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for n, b in old.items():
            self._buffers[n] = b.to(device=self._buffers[n].device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, kernel={self.kernel}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, K = x.shape[:-1], self.in_features
        x2 = x.reshape(-1, K)
        if self.kernel == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(self._padded(x2.to(self.scale_zero.dtype)), self.codes,
                                                           self.kernel_group, self.scale_zero).to(x.dtype)
        elif self.kernel == "int8":
            y = self._int8(x2).to(x.dtype)
        else:
            y = (x2.float() @ self.weight.t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def _padded(self, x_MK: torch.Tensor) -> torch.Tensor:
        """[M, K] activations with zero columns up to the codes' padded row length."""
        pad = self.padded - x_MK.shape[-1]
        return torch.nn.functional.pad(x_MK, (0, pad)) if pad else x_MK

    def _int8(self, x2: torch.Tensor) -> torch.Tensor:
        M, K, ng = x2.shape[0], self.in_features, self.n_groups
        xa = x2.to(self.scale.dtype)
        if ng == 1:
            y = torch._weight_int8pack_mm(self._padded(xa), self.codes, self.scale[0])
            if self.offset is None:
                return y
            return torch.addcmul(y.float(), x2.float().sum(-1, keepdim=True), self.offset)
        G = K // ng  # the activations once per group, zero outside it: [ng * M, K]
        stacked = xa.new_zeros(ng, M, ng, G)
        idx = torch.arange(ng, device=x2.device)
        stacked[idx, :, idx] = xa.view(M, ng, G).transpose(0, 1)
        part = torch._weight_int8pack_mm(self._padded(stacked.view(ng * M, K)), self.codes, self.ones)
        y = (part.view(ng, M, -1).float() * self.scale.float()[:, None, :]).sum(0)
        if self.offset is not None:
            y = y + x2.float().view(M, ng, G).sum(-1) @ self.offset
        return y

    def weight_tensors(self) -> list[torch.Tensor]:
        """What holds the weight as it runs (the packed codes and their scales)."""
        return [t for t in self.buffers(recurse=False) if t is not None and t is not getattr(self, "ones", None)]


def _storage_key(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.device) if t.numel() else id(t)


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the model's weights occupy as it runs, bytes of the same model in fp32):
    every parameter once (a tied head is the embedding) plus the packed codes and scales
    of each :class:`PackedLinear` and the oneDNN copies ``inference.decode_layout`` packed
    beside fp32 weights, against 4 bytes per weight of all of them."""
    seen: set = set()
    now = fp32 = 0
    for p in model.parameters():
        key = _storage_key(p)
        if key not in seen:
            seen.add(key)
            now += p.untyped_storage().nbytes() if p.numel() else 0
            fp32 += 4 * p.numel()
    for m in model.modules():
        if isinstance(m, PackedLinear) and id(m) not in seen:
            seen.add(id(m))
            now += sum(t.untyped_storage().nbytes() for t in m.weight_tensors())
            fp32 += 4 * m.in_features * m.out_features
    return now + prepacked_bytes(model), fp32
