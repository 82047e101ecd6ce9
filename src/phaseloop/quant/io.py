"""Packed quantised weights in safetensors: write and read back (bit-exact)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import torch
import torch.nn as nn

from phaseloop.errors import CheckpointError, ConfigError, first_line
from phaseloop.files import json_digest, save_safetensors
from phaseloop.quant.core import QUANT_ATTR, QuantizedWeight

FORMAT = "phaseloop.quant.v1"  # the metadata's "format" of every quantised file
DIGEST = "tensors_sha256"  # the metadata's digest of every tensor in the file (tensors_digest)
HEADER = "header_sha256"  # the metadata's digest of the rest of the metadata (header_digest)
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


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


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over a state dict's tensors in key order: each key, dtype, shape and bytes, so a
    changed bit anywhere in a file's data (which safetensors itself does not check) shows."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous()
        h.update(f"{key}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def header_digest(meta: Mapping[str, str]) -> str:
    """A file's metadata's own digest (``files.json_digest`` less ``header_sha256``): the
    run, checkpoint and config digests the provenance checks trust, and the tensors' digest."""
    return json_digest(dict(meta), HEADER)


def check_header(meta: Mapping[str, str], name: str, fix: str) -> None:
    """Refuse metadata edited or damaged since it was written (a file from before the
    header was digested has nothing to check)."""
    if HEADER in meta and meta[HEADER] != header_digest(meta):
        raise CheckpointError(f"{name} is damaged or was edited: its metadata (run, checkpoint and config "
                              f"digests) differs from the {HEADER} recorded when it was written; {fix}")


def check_digest(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, str], name: str, fix: str) -> None:
    """Refuse ``tensors`` (of the file ``name``) unless they have the digest ``meta`` records."""
    if tensors_digest(tensors) != meta[DIGEST]:
        raise CheckpointError(f"{name} is damaged: its tensors differ from the {DIGEST} recorded when it was "
                              f"written; {fix}")


def save_quantized(model: nn.Module, path: str | os.PathLike, metadata: Mapping[str, str] | None = None,
                   *, target: str | os.PathLike | None = None) -> None:
    """Write :func:`quantized_state_dict` of ``model`` to a safetensors file with its
    :func:`tensors_digest` (a write error, a full disk, as an ``OSError`` naming ``target``,
    default ``path``)."""
    sd = quantized_state_dict(model)
    meta = {"format": FORMAT}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    meta[DIGEST] = tensors_digest(sd)
    meta[HEADER] = header_digest(meta)
    save_safetensors(sd, path, metadata=meta, target=target)


def load_quantized_state_dict(src, model: nn.Module | None = None, *, device="cpu", strict: bool = True) -> dict:
    """Read a quantised state dict (a safetensors path or the dict itself) back.

    Returns an ordinary state dict whose quantised weights are dequantised (to their
    original dtype). A file's ``tensors_sha256`` is checked where it has one (a file of
    yours written before the digest loads; ``load.read_quantized``, what every command
    reads with, requires it).  If ``model`` is given, loads it (``strict``) and re-attaches the packed
    :class:`QuantizedWeight` to each quantised Linear.
    """
    if isinstance(src, (str, os.PathLike)):
        from safetensors import safe_open
        fix = "run `phaseloop quantize` on the run again to rewrite it"
        try:
            with safe_open(os.fspath(src), "pt", device="cpu") as f:
                meta, sd = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise CheckpointError(f"quantised file {os.fspath(src)} is damaged or not a safetensors file "
                                  f"({first_line(e, 100)}); {fix}") from None
        check_header(meta, f"quantised file {os.fspath(src)}", fix)
        if DIGEST in meta:
            check_digest(sd, meta, f"quantised file {os.fspath(src)}", fix)
        sd = {k: v.to(device) for k, v in sd.items()}
    else:
        sd = dict(src)
    plain, qweights = split_quantized(sd)
    for prefix, qw in qweights.items():
        plain[prefix] = qw.dequantize()
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


def split_quantized(sd: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """(every plain entry, {``<name>.weight``: QuantizedWeight}) of a quantised state dict;
    an incomplete or inconsistent entry raises CheckpointError naming it."""
    plain: dict[str, torch.Tensor] = {}
    qweights: dict[str, QuantizedWeight] = {}
    prefixes = {k[: -len(".qmeta")] for k in sd if k.endswith(".qmeta")}
    for prefix in sorted(prefixes):
        try:
            meta = sd[prefix + ".qmeta"]
            if meta.dtype != torch.int64 or tuple(meta.shape) != (6,):
                raise ValueError(f"qmeta {meta.dtype} {list(meta.shape)}, expected int64 [6]")
            bits, g, out_f, in_f, sym, dcode = (int(v) for v in meta.tolist())
            qw = QuantizedWeight(sd[prefix + ".qdata"], sd[prefix + ".scale"], sd[prefix + ".zero"], bits, g,
                                 (out_f, in_f), _CODE_DTYPES.get(dcode, torch.float32), bool(sym))
            _check(qw)
        except (KeyError, ValueError, RuntimeError, TypeError) as e:
            raise CheckpointError(f"quantised entry {prefix!r} is incomplete or corrupt: {first_line(e, 80)}") from None
        qweights[prefix] = qw
    qsuffix_keys = {p + "." + s for p in prefixes for s in _SUFFIXES}
    plain.update({k: v for k, v in sd.items() if k not in qsuffix_keys})
    return plain, qweights


def _check(qw: QuantizedWeight) -> None:
    """Shapes and dtypes that fit together (what dequantising would otherwise find late)."""
    out_f, in_f = qw.shape
    if qw.bits not in (4, 8) or qw.group_size < 1 or in_f % qw.group_size or out_f < 1:
        raise ValueError(f"bits {qw.bits}, group {qw.group_size} for shape {list(qw.shape)}")
    packed_in = (in_f + 1) // 2 if qw.bits == 4 else in_f
    if qw.qdata.dtype != torch.uint8 or tuple(qw.qdata.shape) != (out_f, packed_in):
        raise ValueError(f"qdata {qw.qdata.dtype} {list(qw.qdata.shape)}, expected uint8 {[out_f, packed_in]}")
    groups = (out_f, in_f // qw.group_size)
    if tuple(qw.scale.shape) != groups or tuple(qw.zero.shape) != groups:
        raise ValueError(f"scale / zero {list(qw.scale.shape)} / {list(qw.zero.shape)}, expected {list(groups)}")
    if not (qw.scale.is_floating_point() and qw.zero.is_floating_point()):
        raise ValueError("scale and zero must be floating point")
    if not (bool(torch.isfinite(qw.scale).all()) and bool(torch.isfinite(qw.zero).all())):
        raise ValueError("a scale or zero is not finite")
    if not bool((qw.scale > 0).all()):
        raise ValueError("a scale is not positive")
