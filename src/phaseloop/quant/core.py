"""Quantisation scheme, round-to-nearest, int4 packing and the packed weight.

Quantisation scheme (RTN and GPTQ share it)
-------------------------------------------
* Weight ``W`` of shape ``[out, in]``; groups of ``group_size`` consecutive input
  columns per output row, so ``scale`` and ``zero`` have shape ``[out, in // group_size]``.
* **Asymmetric** by default: per group, ``xmin = min(w.min(), 0)``, ``xmax = max(w.max(), 0)``
  (the range always contains 0, so an exact zero weight stays exactly zero),
  ``scale = (xmax - xmin) / (2**bits - 1)``, ``zero = round(-xmin / scale)``,
  ``q = clamp(round(w / scale) + zero, 0, 2**bits - 1)`` stored unsigned (uint8),
  ``w_hat = (q - zero) * scale``.  ``sym=True`` gives the symmetric variant
  (``zero = 2**(bits-1)``, ``scale = max|w| / (2**(bits-1) - 1)``).
* Scales and zeros are stored in fp16 (``scale_dtype``).  The scale is rounded *up* to
  the next fp16 value before ``q`` is computed, so the dequantised weight uses exactly
  the stored scale, save/load is bit-exact, and the RTN error is at most ``scale/2``.
* ``bits`` must be 4 or 8 (anything else raises :class:`~phaseloop.errors.ConfigError`,
  a ``ValueError``).  ``group_size=None`` (or -1) means one group per row.  The
  low-level functions raise ``ConfigError`` if ``group_size`` does not divide
  ``in_features``; :func:`quantize_model` instead falls back to **per-row** quantisation
  for that layer and lists it in ``report["per_row_fallback"]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from phaseloop.errors import ConfigError

SUPPORTED_BITS = (4, 8)
QUANT_ATTR = "phaseloop_qweight"


# --------------------------------------------------------------------------- checks

def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits must be one of {SUPPORTED_BITS} (weight-only int quantisation), got {bits!r}")
    return bits


def resolve_group_size(group_size, in_features: int) -> int:
    """Group size as an int; None / -1 / 0 mean one group per row.  Raises if it does not divide."""
    if group_size is None or group_size in (-1, 0):
        return in_features
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be a positive int, or None / -1 for per-row, got {group_size!r}")
    if in_features % group_size != 0:
        raise ConfigError(f"group_size={group_size} does not divide in_features={in_features}; "
                          "use a divisor, or None for per-row quantisation")
    return group_size


def check_weight(weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ConfigError(f"weight must be a 2-D tensor [out_features, in_features], got "
                          f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if not weight.is_floating_point():
        raise ConfigError(f"weight must be floating point, got {weight.dtype}")


# --------------------------------------------------------------------------- RTN core

def _round_up_to_dtype(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``s`` (fp32, positive) rounded up to the next value representable in ``dtype``; returned as fp32."""
    if dtype == torch.float32:
        return s
    if dtype == torch.float16 and bool((s > torch.finfo(torch.float16).max).any()):
        raise ConfigError("weight range too large for fp16 scales (|w| > ~1e6); pass scale_dtype=torch.float32")
    r = s.to(dtype)
    low = r.float() < s
    if bool(low.any()):
        r = torch.where(low, torch.nextafter(r, torch.full_like(r, float("inf"))), r)
    return r.float()


def qparams(w: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype):
    """Per-row quantisation parameters of ``w`` [rows, cols] (a group): fp32 scale and zero, [rows]."""
    qmax = 2 ** bits - 1
    w = w.float()
    tiny = float(torch.finfo(scale_dtype).tiny) if scale_dtype != torch.float32 else 1e-12
    if sym:
        half = 2 ** (bits - 1)
        scale = w.abs().amax(dim=-1) / (half - 1)
        scale = _round_up_to_dtype(scale.clamp_min(tiny), scale_dtype)
        zero = torch.full_like(scale, float(half))
    else:
        xmin = w.amin(dim=-1).clamp_max(0.0)
        xmax = w.amax(dim=-1).clamp_min(0.0)
        scale = _round_up_to_dtype(((xmax - xmin) / qmax).clamp_min(tiny), scale_dtype)
        zero = torch.round(-xmin / scale).clamp(0, qmax)
    return scale, zero


def quant_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int) -> torch.Tensor:
    """Integer codes (as float) of ``w`` [..] with broadcastable scale / zero."""
    return torch.clamp(torch.round(w / scale) + zero, 0, qmax)


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int | None = 128, *, sym: bool = False,
                 scale_dtype: torch.dtype = torch.float16):
    """Per-group round-to-nearest quantisation of ``weight`` [out, in] along the input dimension.

    Returns ``(q_int, scale, zero)``: ``q_int`` uint8 [out, in] with values in
    ``[0, 2**bits - 1]``; ``scale`` and ``zero`` of dtype ``scale_dtype``, shape
    [out, in // group_size].  ``dequantize(q_int, scale, zero)`` gives the weights back
    with error at most ``scale / 2`` per weight.
    """
    check_bits(bits)
    check_weight(weight)
    out_f, in_f = weight.shape
    g = resolve_group_size(group_size, in_f)
    w = weight.detach().float().reshape(out_f, in_f // g, g)
    scale, zero = qparams(w, bits, sym, scale_dtype)              # [out, G]
    q = quant_codes(w, scale.unsqueeze(-1), zero.unsqueeze(-1), 2 ** bits - 1)
    return (q.reshape(out_f, in_f).to(torch.uint8), scale.to(scale_dtype), zero.to(scale_dtype))


def dequantize(q_int: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_rtn` / :func:`gptq_quantize`: ``(q - zero) * scale`` per group.

    The group size is ``in_features // scale.shape[1]``.
    """
    if q_int.dim() != 2 or scale.shape != zero.shape or scale.dim() != 2 or scale.shape[0] != q_int.shape[0]:
        raise ConfigError(f"dequantize: shapes do not match: q {tuple(q_int.shape)}, scale {tuple(scale.shape)}, "
                          f"zero {tuple(zero.shape)}")
    out_f, in_f = q_int.shape
    n_groups = scale.shape[1]
    if in_f % n_groups:
        raise ConfigError(f"dequantize: {n_groups} groups do not divide in_features={in_f}")
    g = in_f // n_groups
    q = q_int.float().reshape(out_f, n_groups, g)
    w = (q - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    return w.reshape(out_f, in_f).to(dtype)


# --------------------------------------------------------------------------- packing

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (uint8 values 0..15) two per byte along the last dim: even index in the low nibble.

    An odd last dimension is padded with one zero code; pass the original length to :func:`unpack_int4`.
    """
    if q.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        raise ConfigError(f"pack_int4 expects integer codes, got {q.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ConfigError("pack_int4 expects codes in [0, 15]")
    q = q.to(torch.uint8)
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_int4`; ``n`` is the original last-dim length (default ``2 * packed.shape[-1]``)."""
    if packed.dtype != torch.uint8:
        raise ConfigError(f"unpack_int4 expects uint8, got {packed.dtype}")
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    if n is not None:
        out = out[..., :n]
    return out.contiguous()


def packed_bytes(out_features: int, in_features: int, bits: int, group_size: int | None,
                 scale_bytes: int = 2) -> int:
    """Storage of one quantised weight: ``bits/8`` per weight (rows padded to whole bytes) plus a
    scale and a zero (``scale_bytes`` each, fp16 by default) per group."""
    g = in_features if group_size in (None, -1, 0) else group_size
    n_groups = math.ceil(in_features / g)
    return out_features * math.ceil(in_features * bits / 8) + out_features * n_groups * 2 * scale_bytes


@dataclass
class QuantizedWeight:
    """The packed form of one quantised Linear weight."""
    qdata: torch.Tensor          # uint8 [out, ceil(in/2)] for 4 bits, [out, in] for 8 bits
    scale: torch.Tensor          # [out, n_groups], fp16 by default
    zero: torch.Tensor           # [out, n_groups], same dtype as scale
    bits: int
    group_size: int              # effective group size (in_features when per-row)
    shape: tuple                 # (out_features, in_features)
    dtype: torch.dtype = torch.float32   # dtype of the (dequantised) weight
    sym: bool = False

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale, zero, bits: int, dtype=torch.float32, sym=False):
        out_f, in_f = q.shape
        qdata = pack_int4(q) if bits == 4 else q.to(torch.uint8).contiguous()
        return cls(qdata, scale.contiguous(), zero.contiguous(), bits, in_f // scale.shape[1],
                   (out_f, in_f), dtype, sym)

    def codes(self) -> torch.Tensor:
        return unpack_int4(self.qdata, self.shape[1]) if self.bits == 4 else self.qdata

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.codes(), self.scale, self.zero, dtype or self.dtype)
