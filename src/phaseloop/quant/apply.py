"""Fake quantisation and the packed form
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

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from phaseloop.errors import ConfigError
from phaseloop.quant.core import QUANT_ATTR, QuantizedWeight, check_bits, packed_bytes, quantize_rtn
from phaseloop.quant.gptq import call_order, collect_hessians, gptq_quantize
from phaseloop.quant.targets import default_skip, select_linears


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
    check_bits(bits)
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

    targets, shared = select_linears(model, modules, skip)
    bytes_before = _param_bytes(model)
    report = {"method": method, "bits": bits, "group_size": group_size, "sym": sym,
              "layers": {}, "per_row_fallback": [], "skipped_shared": shared, "gptq_rtn_fallback": []}

    # unique weights: the first name is canonical, the others share its result
    groups: OrderedDict[int, list[str]] = OrderedDict()
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
                first = call_order(model, {n: targets[n] for n in order}, calib_batches[0], forward_fn)
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
                    warnings.warn(f"quantize_model: {name!r} was never called on the calibration data; using RTN",
                                  stacklevel=2)
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
    for _key, names in groups.items():
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
