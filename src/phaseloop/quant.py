"""Post-training weight-only quantisation: round-to-nearest (RTN), GPTQ, optional torchao.

The Hyperloop paper reports weight-only INT4 with group size 128, quantised by GPTQ
where the Hessian of a looped (weight-shared) layer is pooled over all of its loop
passes.  This module implements that for any ``nn.Module`` whose matmuls are
``nn.Linear``; nothing here knows about a particular architecture.

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

GPTQ (Frantar et al. 2022, arXiv 2210.17323, Alg. 1)
----------------------------------------------------
:func:`gptq_quantize` follows the reference implementation: dead columns
(``H_ii == 0``) get ``H_ii = 1`` and a zero weight; damping ``damp * mean(diag H)``; the
upper Cholesky factor of ``H^-1``; column-by-column quantisation with error feedback
inside blocks of ``block_size`` columns and lazy updates of the later columns after each
block; group parameters computed from the (already error-updated) weights when a group
starts.  ``block_size`` is rounded up to a multiple of ``group_size`` so every group lies
inside one block and its parameters see all the feedback so far.  No act-order.

Hessians of looped layers
-------------------------
:func:`collect_hessians` registers forward hooks that see every call of a module, so
a Linear applied L times per forward pools ``H = 2/n sum x x^T`` over all L passes,
with ``n`` = the number of input rows (tokens) over all batches *and* all calls.
Distinct modules that share one weight tensor also pool into one Hessian.  By default
all Hessians come from one calibration pass of the full-precision model
(``sequential=False``); ``sequential=True`` re-collects each layer's Hessian after the
layers that run before it have been quantised (one calibration pass per layer).

Fake quantisation and the packed form
-------------------------------------
:func:`quantize_model` overwrites each targeted weight in place with its
quantise-dequantise result, so every architecture keeps running unchanged, and attaches
the packed form to the module as ``module.phaseloop_qweight`` (a :class:`QuantizedWeight`;
a plain attribute, so ``state_dict()`` is unchanged).  :func:`quantized_state_dict`
turns a model into a safetensors-ready dict (``<name>.weight.qdata`` uint8 — two 4-bit
values per byte for 4 bits — plus fp16 ``.scale`` / ``.zero`` and an int64 ``.qmeta``);
:func:`save_quantized` writes it, :func:`load_quantized_state_dict` reads it back into
an ordinary (dequantised) state dict and optionally loads it into a model.

torchao
-------
Tried with torchao 0.18.0 on CPU (torch 2.13.0+cpu), installed with ``--no-deps``:
``Int4WeightOnlyConfig`` does **not** work on CPU — its default (plain) packing raises
``ImportError: Requires mslk >= 1.0.0``, ``int4_packing_format="plain_int32"`` raises
``NotImplementedError: Int4PlainInt32Tensor does not support device 'cpu' yet`` and
``"tile_packed_to_4d"`` only accepts bfloat16 (and targets the CUDA tinygemm kernel).
``Int8WeightOnlyConfig`` works; ``IntxWeightOnlyConfig(weight_dtype=torch.int8|torch.int4,
granularity=PerGroup(g))`` works for both 8 and 4 bits on CPU (it stores the int4 values
unpacked in int8 and dequantises in the matmul — numerically INT4, memory 1 byte/weight).
``method="torchao"`` therefore uses ``IntxWeightOnlyConfig`` for both widths, imported
lazily; torchao is not a dependency, and without it ``method="torchao"`` raises a clear
``ImportError``.  A torchao-quantised model holds tensor subclasses, which
:func:`quantized_state_dict` refuses (save those with ``torch.save``).  RTN and GPTQ are
implemented here and need nothing beyond torch.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
import torch.nn as nn

from .errors import CheckpointError, ConfigError

__all__ = [
    "SUPPORTED_BITS", "QUANT_ATTR", "QuantizedWeight",
    "quantize_rtn", "dequantize", "gptq_quantize", "pack_int4", "unpack_int4",
    "collect_hessians", "quantize_model", "quantized_state_dict", "save_quantized",
    "load_quantized_state_dict", "packed_bytes", "default_skip",
]

SUPPORTED_BITS = (4, 8)
QUANT_ATTR = "phaseloop_qweight"
_FORMAT = "phaseloop.quant.v1"
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


# --------------------------------------------------------------------------- checks

def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits must be one of {SUPPORTED_BITS} (weight-only int quantisation), got {bits!r}")
    return bits


def _resolve_group_size(group_size, in_features: int) -> int:
    """Group size as an int; None / -1 / 0 mean one group per row.  Raises if it does not divide."""
    if group_size is None or group_size in (-1, 0):
        return in_features
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ConfigError(f"group_size must be a positive int, or None / -1 for per-row, got {group_size!r}")
    if in_features % group_size != 0:
        raise ConfigError(f"group_size={group_size} does not divide in_features={in_features}; "
                          "use a divisor, or None for per-row quantisation")
    return group_size


def _check_weight(weight: torch.Tensor) -> None:
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


def _qparams(w: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype):
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


def _quant(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int) -> torch.Tensor:
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
    _check_bits(bits)
    _check_weight(weight)
    out_f, in_f = weight.shape
    g = _resolve_group_size(group_size, in_f)
    w = weight.detach().float().reshape(out_f, in_f // g, g)
    scale, zero = _qparams(w, bits, sym, scale_dtype)              # [out, G]
    q = _quant(w, scale.unsqueeze(-1), zero.unsqueeze(-1), 2 ** bits - 1)
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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qdata, self.scale, self.zero))


# --------------------------------------------------------------------------- GPTQ

def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, bits: int, group_size: int | None = 128,
                  damp: float = 0.01, block_size: int = 128, *, sym: bool = False,
                  scale_dtype: torch.dtype = torch.float16):
    """GPTQ (Frantar et al. 2022, Alg. 1) of ``weight`` [out, in] given the input Hessian ``H`` [in, in].

    ``H`` is ``2/n sum x x^T`` over the layer's calibration inputs (its overall scale does
    not matter: damping is relative).  Returns ``(q_int, scale, zero)`` in the same format as
    :func:`quantize_rtn`.  Columns with ``H_ii == 0`` (never-active inputs) are set to zero.
    """
    _check_bits(bits)
    _check_weight(weight)
    out_f, in_f = weight.shape
    g = _resolve_group_size(group_size, in_f)
    if H.shape != (in_f, in_f):
        raise ConfigError(f"H must be [{in_f}, {in_f}] for a weight of shape {tuple(weight.shape)}, got {tuple(H.shape)}")
    if not (damp >= 0):
        raise ConfigError(f"damp must be >= 0, got {damp!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    block_size = math.ceil(block_size / g) * g if g < in_f else in_f   # groups never straddle blocks
    qmax = 2 ** bits - 1

    W = weight.detach().float().clone()
    H = H.detach().to(device=W.device, dtype=torch.float32).clone()
    if not bool(torch.isfinite(H).all()):
        raise ConfigError("gptq_quantize: H contains NaN or inf")
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    Hinv = None
    diag_mean = torch.diagonal(H).mean()
    d = damp if damp > 0 else 1e-6
    for _ in range(6):   # raise damping if the factorisation fails numerically
        Hd = H + d * diag_mean * torch.eye(in_f, device=W.device)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hi = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hi, upper=True)
            if int(info) == 0:
                Hinv = U
                break
        d *= 10.0
    if Hinv is None:
        raise ConfigError("gptq_quantize: Hessian is not positive definite even with heavy damping")

    Q = torch.zeros_like(W)
    scales = torch.zeros(out_f, in_f // g, device=W.device)
    zeros = torch.zeros_like(scales)
    scale = zero = None
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:   # a group starts: its parameters from the error-updated weights
                scale, zero = _qparams(W1[:, i:i + g], bits, sym, scale_dtype)
                scales[:, col // g] = scale
                zeros[:, col // g] = zero
            w = W1[:, i]
            q = _quant(w, scale, zero, qmax)
            Q[:, col] = q
            err = (w - (q - zero) * scale) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        if i2 < in_f:
            W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q.to(torch.uint8), scales.to(scale_dtype), zeros.to(scale_dtype)


# --------------------------------------------------------------------------- targets / hooks

def default_skip(name: str, module: nn.Module) -> bool:
    """Default: keep embeddings and the output head in full precision (names containing 'embed' or 'head')."""
    low = name.lower()
    return "embed" in low or "head" in low


def _make_skip(skip) -> Callable[[str, nn.Module], bool]:
    if skip is None:
        return lambda name, module: False
    if callable(skip):
        return skip
    if isinstance(skip, str):
        skip = (skip,)
    subs = tuple(s.lower() for s in skip)
    return lambda name, module: any(s in name.lower() for s in subs)


def _select_linears(model: nn.Module, modules=None, skip=default_skip):
    """Ordered {name: Linear} of the targets, plus names skipped because their weight is shared
    with a module that is not a target (e.g. a head tied to the embedding)."""
    if modules is None:
        pred = _make_skip(skip)
        cand = OrderedDict((n, m) for n, m in model.named_modules()
                           if isinstance(m, nn.Linear) and not pred(n, m))
    elif isinstance(modules, Mapping):
        cand = OrderedDict(modules.items())
    else:
        named = dict(model.named_modules())
        cand = OrderedDict()
        for item in modules:
            if isinstance(item, str):
                if item not in named:
                    raise ConfigError(f"modules: no submodule named {item!r} in the model")
                cand[item] = named[item]
            else:
                nm = next((n for n, m in named.items() if m is item), None)
                if nm is None:
                    raise ConfigError("modules: a given module is not part of the model")
                cand[nm] = item
    for n, m in cand.items():
        if not isinstance(m, nn.Linear):
            raise ConfigError(f"modules: {n!r} is a {type(m).__name__}, only nn.Linear can be quantised")
    target_ids = {id(m) for m in cand.values()}
    other_params = set()
    for m in model.modules():
        if id(m) not in target_ids:
            other_params.update(id(p) for p in m.parameters(recurse=False))
    shared = [n for n, m in cand.items() if id(m.weight) in other_params]
    for n in shared:
        del cand[n]
    return cand, shared


def _forward_batch(model, batch, forward_fn):
    if forward_fn is not None:
        return forward_fn(model, batch)
    dev = next((p.device for p in model.parameters()), None)
    if isinstance(batch, Mapping):
        return model(**{k: (v.to(dev) if isinstance(v, torch.Tensor) and dev is not None else v)
                        for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        batch = batch[0]   # (inputs, targets) pairs: inputs only
    if isinstance(batch, torch.Tensor) and dev is not None:
        batch = batch.to(dev)
    return model(batch)


class _HessianAccumulator:
    """Running ``2/n sum x x^T`` over every row of every call (pooled by weight tensor)."""

    def __init__(self, in_features: int, device):
        self.H = torch.zeros(in_features, in_features, device=device, dtype=torch.float32)
        self.n = 0
        self.calls = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        m = x.shape[0]
        self.calls += 1
        if m == 0:
            return
        n_new = self.n + m
        self.H.mul_(self.n / n_new)
        x = x * math.sqrt(2.0 / n_new)
        self.H.addmm_(x.t(), x)
        self.n = n_new


def collect_hessians(model: nn.Module, calib_batches: Iterable, modules=None, *, skip=default_skip,
                     forward_fn: Callable | None = None, return_counts: bool = False):
    """Forward the calibration batches and return ``{name: H}`` for the target Linear modules.

    ``H = 2/n sum_x x x^T`` (fp32, [in, in]) over **all** calls of the module, so a looped
    Linear called L times per forward pools all L passes; ``n`` counts input rows (tokens)
    over all batches and calls.  Modules sharing one weight get the same pooled ``H``.

    ``modules``: None (all ``nn.Linear`` not excluded by ``skip``), a ``{name: Linear}``
    mapping, or an iterable of names / modules.  ``calib_batches``: LongTensors [B, T]
    (or ``(inputs, targets)`` tuples, or dicts of keyword arguments); ``forward_fn(model,
    batch)`` overrides how a batch is run.  With ``return_counts=True`` returns
    ``(hessians, {name: {"rows": n, "calls": calls}})``.
    """
    targets, _ = _select_linears(model, modules, skip)
    accs: dict[int, _HessianAccumulator] = {}
    handles = []

    def make_hook(acc):
        def hook(mod, inputs, output):
            acc.add(inputs[0])
        return hook

    for name, mod in targets.items():
        key = id(mod.weight)
        if key not in accs:
            accs[key] = _HessianAccumulator(mod.in_features, mod.weight.device)
        handles.append(mod.register_forward_hook(make_hook(accs[key])))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in calib_batches:
                _forward_batch(model, batch, forward_fn)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    hs = {name: accs[id(mod.weight)].H for name, mod in targets.items()}
    if return_counts:
        counts = {name: {"rows": accs[id(mod.weight)].n, "calls": accs[id(mod.weight)].calls}
                  for name, mod in targets.items()}
        return hs, counts
    return hs


def _call_order(model, targets: Mapping[str, nn.Module], batch, forward_fn) -> list[str]:
    """Target names in the order of their first call on one batch (never-called ones last)."""
    order: list[str] = []
    handles = []
    for name, mod in targets.items():
        def hook(m, i, o, name=name):
            if name not in order:
                order.append(name)
        handles.append(mod.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _forward_batch(model, batch, forward_fn)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return order + [n for n in targets if n not in order]


# --------------------------------------------------------------------------- whole model

def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def quantize_model(model: nn.Module, bits: int, group_size: int | None = 128, method: str = "rtn",
                   calib_batches: Iterable | None = None, skip=default_skip, *, modules=None,
                   sym: bool = False, damp: float = 0.01, block_size: int = 128,
                   sequential: bool = False, forward_fn: Callable | None = None,
                   scale_dtype: torch.dtype = torch.float16) -> dict:
    """Quantise the targeted ``nn.Linear`` weights of ``model`` in place (fake quantisation).

    ``method``: ``"rtn"``, ``"gptq"`` (needs ``calib_batches``; Hessians pooled over all
    calls of looped layers) or ``"torchao"`` (optional dependency, see module docstring).
    ``skip``: predicate ``(name, module) -> bool`` or substrings of names to keep in full
    precision (default: names containing 'embed' or 'head').  Weights shared with a
    non-target module are left alone (``report["skipped_shared"]``).  A layer whose
    ``in_features`` is not divisible by ``group_size`` is quantised per row
    (``report["per_row_fallback"]``).

    Returns a JSON-serialisable report: ``layers`` {name: {mse, shape, group_size, ...}},
    ``mean_mse``, ``n_quantized``, ``bytes_before`` / ``bytes_after`` (all parameters;
    quantised weights counted packed: bits/8 per weight plus fp16 scale and zero per group),
    ``quantized_bytes_before`` / ``quantized_bytes_after`` (the targeted weights only).
    """
    _check_bits(bits)
    if method not in ("rtn", "gptq", "torchao"):
        raise ConfigError(f"method must be 'rtn', 'gptq' or 'torchao', got {method!r}")
    if group_size is not None and group_size not in (-1, 0) and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ConfigError(f"group_size must be a positive int, or None / -1 for per-row, got {group_size!r}")
    if method == "gptq" and calib_batches is None:
        raise ConfigError("method='gptq' needs calib_batches (an iterable of token batches)")
    if method == "gptq":
        calib_batches = list(calib_batches)   # iterated more than once
        if not calib_batches:
            raise ConfigError("calib_batches is empty")

    targets, shared = _select_linears(model, modules, skip)
    bytes_before = _param_bytes(model)
    report = {"method": method, "bits": bits, "group_size": group_size, "sym": sym,
              "layers": {}, "per_row_fallback": [], "skipped_shared": shared, "gptq_rtn_fallback": []}

    # unique weights: the first name is canonical, the others share its result
    groups: "OrderedDict[int, list[str]]" = OrderedDict()
    for name, mod in targets.items():
        groups.setdefault(id(mod.weight), []).append(name)

    def eff_group(mod):
        in_f = mod.in_features
        if group_size in (None, -1, 0):
            return in_f
        return group_size if in_f % group_size == 0 else in_f

    if method == "torchao":
        q_before, q_after = _quantize_torchao(model, targets, groups, bits, eff_group, sym, report)
    else:
        hessians = counts = None
        order = [names[0] for names in groups.values()]
        if method == "gptq":
            if sequential:
                first = _call_order(model, {n: targets[n] for n in order}, calib_batches[0], forward_fn)
                order = first
            else:
                hessians, counts = collect_hessians(model, calib_batches, targets,
                                                    forward_fn=forward_fn, return_counts=True)
        q_before = q_after = 0
        for name in order:
            mod = targets[name]
            W = mod.weight
            g = eff_group(mod)
            if group_size not in (None, -1, 0) and g != group_size:
                report["per_row_fallback"].append(name)
            info = {}
            if method == "gptq":
                if sequential:
                    hs, cs = collect_hessians(model, calib_batches, {n: targets[n] for n in groups[id(W)]},
                                              forward_fn=forward_fn, return_counts=True)
                    H, cnt = hs[name], cs[name]
                else:
                    H, cnt = hessians[name], counts[name]
                info.update(cnt)
                if cnt["rows"] == 0:
                    warnings.warn(f"quantize_model: {name!r} was never called on the calibration data; using RTN")
                    report["gptq_rtn_fallback"].append(name)
                    q, s, z = quantize_rtn(W, bits, g, sym=sym, scale_dtype=scale_dtype)
                else:
                    q, s, z = gptq_quantize(W, H, bits, g, damp=damp, block_size=block_size, sym=sym,
                                            scale_dtype=scale_dtype)
                del H
            else:
                q, s, z = quantize_rtn(W, bits, g, sym=sym, scale_dtype=scale_dtype)
            qw = QuantizedWeight.from_codes(q, s, z, bits, dtype=W.dtype, sym=sym)
            deq = qw.dequantize(torch.float32)
            with torch.no_grad():
                mse = float(((deq - W.detach().float()) ** 2).mean())
                W.copy_(deq.to(W.dtype))
            for n in groups[id(W)]:
                setattr(targets[n], QUANT_ATTR, qw)
            before = W.numel() * W.element_size()
            after = packed_bytes(W.shape[0], W.shape[1], bits, g, torch.finfo(scale_dtype).bits // 8)
            q_before += before
            q_after += after
            info.update({"mse": mse, "shape": list(W.shape), "group_size": g,
                         "bytes_before": before, "bytes_after": after})
            if len(groups[id(W)]) > 1:
                info["shared_with"] = groups[id(W)][1:]
            report["layers"][name] = info

    report["n_quantized"] = len(report["layers"])
    report["mean_mse"] = (sum(v["mse"] for v in report["layers"].values()) / report["n_quantized"]
                          if report["n_quantized"] else 0.0)
    report["quantized_bytes_before"] = q_before
    report["quantized_bytes_after"] = q_after
    report["bytes_before"] = bytes_before
    report["bytes_after"] = bytes_before - q_before + q_after
    return report


def _import_torchao():
    try:
        from torchao.quantization import IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerAxis, PerGroup
        from torchao.quantization.quant_primitives import MappingType
    except Exception as e:  # ImportError, or a broken install
        raise ImportError(f"method='torchao' needs torchao (pip install torchao): {type(e).__name__}: {e}. "
                          "method='rtn' or 'gptq' need nothing extra.") from e
    return IntxWeightOnlyConfig, quantize_, PerAxis, PerGroup, MappingType


def _quantize_torchao(model, targets, groups, bits, eff_group, sym, report):
    IntxWeightOnlyConfig, quantize_, PerAxis, PerGroup, MappingType = _import_torchao()
    q_before = q_after = 0
    for key, names in groups.items():
        if len(names) > 1:
            raise ConfigError(f"method='torchao' cannot quantise a weight shared by several modules ({names}); "
                              "use method='rtn' or 'gptq'")
        name = names[0]
        mod = targets[name]
        W0 = mod.weight.detach().float().clone()
        before = mod.weight.numel() * mod.weight.element_size()
        g = eff_group(mod)
        if g != mod.in_features:
            gran = PerGroup(g)
        else:
            gran = PerAxis(0)
            if report["group_size"] not in (None, -1, 0):
                report["per_row_fallback"].append(name)
        cfg = IntxWeightOnlyConfig(weight_dtype=torch.int8 if bits == 8 else torch.int4, granularity=gran,
                                   mapping_type=MappingType.SYMMETRIC if sym else MappingType.ASYMMETRIC)
        quantize_(mod, cfg, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
        w = mod.weight
        mse = float(((w.dequantize().float() - W0) ** 2).mean())
        after = sum(t.numel() * t.element_size() for t in (w.qdata, w.scale, getattr(w, "zero_point", None))
                    if isinstance(t, torch.Tensor))
        q_before += before
        q_after += after
        report["layers"][name] = {"mse": mse, "shape": list(W0.shape), "group_size": g,
                                  "bytes_before": before, "bytes_after": after,
                                  "torchao_tensor": type(w).__name__}
    return q_before, q_after


# --------------------------------------------------------------------------- save / load

_SUFFIXES = ("qdata", "scale", "zero", "qmeta")


def quantized_state_dict(model: nn.Module) -> dict:
    """A safetensors-ready state dict: each quantised weight ``<name>.weight`` is replaced by
    ``<name>.weight.qdata`` (uint8; 4-bit codes packed two per byte), ``.scale`` / ``.zero``
    (fp16) and ``.qmeta`` (int64: bits, group_size, out, in, sym, dtype code); every other
    entry is kept as is (copied where tensors share memory, which safetensors refuses)."""
    qmods = {name: getattr(m, QUANT_ATTR) for name, m in model.named_modules(remove_duplicate=False)
             if isinstance(getattr(m, QUANT_ATTR, None), QuantizedWeight)}
    out: dict[str, torch.Tensor] = {}
    seen_ptrs: set = set()

    def put(key, t):
        t = t.detach().contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.device) if t.numel() else None
        if ptr is not None and ptr in seen_ptrs:
            t = t.clone()
        elif ptr is not None:
            seen_ptrs.add(ptr)
        out[key] = t

    qkeys = {}
    for name, qw in qmods.items():
        prefix = f"{name}.weight" if name else "weight"
        qkeys[prefix] = qw
    for key, t in model.state_dict(keep_vars=False).items():
        if key in qkeys:
            continue
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
            raise ConfigError(f"quantized_state_dict: {key!r} is a {type(t).__name__} (a torchao-quantised "
                              "weight?); save such models with torch.save, or quantise with method='rtn'/'gptq'")
        put(key, t)
    for prefix, qw in qkeys.items():
        put(prefix + ".qdata", qw.qdata)
        put(prefix + ".scale", qw.scale)
        put(prefix + ".zero", qw.zero)
        out[prefix + ".qmeta"] = torch.tensor([qw.bits, qw.group_size, qw.shape[0], qw.shape[1], int(qw.sym),
                                               _DTYPE_CODES.get(qw.dtype, 0)], dtype=torch.int64)
    return out


def save_quantized(model: nn.Module, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Write :func:`quantized_state_dict` of ``model`` to a safetensors file."""
    from safetensors.torch import save_file
    meta = {"format": _FORMAT}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    save_file(quantized_state_dict(model), os.fspath(path), metadata=meta)


def load_quantized_state_dict(src, model: nn.Module | None = None, *, device="cpu", strict: bool = True) -> dict:
    """Read a quantised state dict (a safetensors path or the dict itself) back.

    Returns an ordinary state dict whose quantised weights are dequantised (to their
    original dtype).  If ``model`` is given, loads it (``strict``) and re-attaches the packed
    :class:`QuantizedWeight` to each quantised Linear.
    """
    if isinstance(src, (str, os.PathLike)):
        from safetensors.torch import load_file
        try:
            sd = load_file(os.fspath(src), device=str(device))
        except Exception as e:
            raise CheckpointError(f"cannot read quantised safetensors file {os.fspath(src)!r}: {e}") from e
    else:
        sd = dict(src)
    plain: dict[str, torch.Tensor] = {}
    qweights: dict[str, QuantizedWeight] = {}
    prefixes = {k[: -len(".qmeta")] for k in sd if k.endswith(".qmeta")}
    for prefix in prefixes:
        try:
            bits, g, out_f, in_f, sym, dcode = (int(v) for v in sd[prefix + ".qmeta"].tolist())
            qw = QuantizedWeight(sd[prefix + ".qdata"], sd[prefix + ".scale"], sd[prefix + ".zero"], bits, g,
                                 (out_f, in_f), _CODE_DTYPES.get(dcode, torch.float32), bool(sym))
            w = qw.dequantize()
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"quantised entry {prefix!r} is incomplete or corrupt: {e}") from e
        if tuple(w.shape) != (out_f, in_f):
            raise CheckpointError(f"quantised entry {prefix!r}: shape {tuple(w.shape)} != {(out_f, in_f)}")
        plain[prefix] = w
        qweights[prefix] = qw
    qsuffix_keys = {p + "." + s for p in prefixes for s in _SUFFIXES}
    for k, v in sd.items():
        if k not in qsuffix_keys:
            plain[k] = v
    if model is not None:
        model.load_state_dict(plain, strict=strict)
        for name, m in model.named_modules(remove_duplicate=False):
            prefix = f"{name}.weight" if name else "weight"
            if prefix in qweights and isinstance(m, nn.Linear):
                qw = qweights[prefix]
                dev = m.weight.device
                setattr(m, QUANT_ATTR, QuantizedWeight(qw.qdata.to(dev), qw.scale.to(dev), qw.zero.to(dev), qw.bits,
                                                       qw.group_size, qw.shape, qw.dtype, qw.sym))
    return plain
