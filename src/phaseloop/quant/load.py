"""A run with its ``phaseloop quantize`` file: the file checked against the run, then
either the packed model (``load_packed``: ``eval``, ``generate`` and the HF model take
``--quantized FILE`` so) or the dequantised weights (``export --quantized``).

A quantised file records the run it came from (``quantize_run``): the digest of the
run's model config and the sha256 of the checkpoint's model.safetensors. A file of
another run, or of this run before it trained further, is refused by name; so is a
damaged file, and a safetensors file that is not a quantised one (a checkpoint's). The
file also records the sha256 of its own tensors (``io.tensors_digest``), checked on every
read, so a changed byte in a code, scale or weight is refused, not run.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.nn as nn

from phaseloop.config import ModelConfig
from phaseloop.engine.checkpoint import (
    CKPT,
    MANIFEST,
    OLD,
    checkpoint_dir,
    config_digest,
    read_run_config,
    run_folder,
)
from phaseloop.errors import CheckpointError, PhaseloopError, state_dict_error
from phaseloop.files import read_json, sha256_file, why_missing
from phaseloop.model import build_model
from phaseloop.quant.io import (
    DIGEST,
    FORMAT,
    HEADER,
    check_digest,
    check_header,
    load_quantized_state_dict,
    split_quantized,
)
from phaseloop.quant.packed import PackedLinear

QUANTIZE_AGAIN = "run `phaseloop quantize` on this run and pass the file it writes"


def checkpoint_of(run: str | Path) -> Path | None:
    """The checkpoint folder of a run folder (or the folder itself, if it is one)."""
    run = Path(run)
    if (run / "model.safetensors").exists() or run.name in (CKPT, OLD):
        return run
    return checkpoint_dir(run)


def read_config(run: str | Path) -> dict:
    """A run's config.json, checked (``read_run_config``), without reading its weights."""
    if not Path(run).exists():
        raise CheckpointError(f"{run} {why_missing(Path(run))}; pass a run folder made by `phaseloop train`")
    return read_run_config(run_folder(run), checkpoint_of(run))


def checkpoint_sha256(ckpt: Path) -> str:
    """sha256 of a checkpoint's model.safetensors: its manifest's record, else the file's."""
    manifest = ckpt / MANIFEST
    if manifest.is_file():
        entry = read_json(manifest).get("files", {}).get("model.safetensors")
        if isinstance(entry, dict) and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
    return sha256_file(ckpt / "model.safetensors")


def provenance(run: str | Path, run_cfg: dict) -> dict:
    """What a quantised file records of the run it was made from (safetensors metadata)."""
    ckpt = checkpoint_of(run)
    return {"run": str(run_folder(run)), "arch": run_cfg["model"].get("arch", ""),
            "model_config_sha256": config_digest(run_cfg["model"]),
            "checkpoint_sha256": checkpoint_sha256(ckpt) if ckpt is not None else ""}


PROVENANCE = ("model_config_sha256", "checkpoint_sha256")  # what ties a quantised file to its run


def read_quantized(path: str | Path, run: str | Path | None, run_cfg: dict,
                   checkpoint: str | None = None) -> tuple[dict, dict]:
    """(tensors, metadata) of the quantised file ``path``, refused in one line naming it
    when it is missing, damaged, not a quantised file or not made from ``run`` (None: an
    export of it, whose checkpoint is not at hand: the model config is compared, and the
    checkpoint's sha256 the export recorded, ``checkpoint``, where it has one)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else f"{why_missing(path)}: no such file"
        raise PhaseloopError(f"--quantized {path} {what}; pass the quant-*.safetensors that "
                             "`phaseloop quantize` wrote")
    try:
        with safe_open(os.fspath(path), "pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors' own error: a truncated or overwritten file
        why = (str(e).splitlines() or [type(e).__name__])[0][:100]
        raise CheckpointError(f"--quantized {path} is damaged or not a safetensors file ({why}); "
                              f"{QUANTIZE_AGAIN}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"--quantized {path} is not a phaseloop quantised file (its format is "
                              f"{meta.get('format')!r}, not {FORMAT!r}); {QUANTIZE_AGAIN}")
    lacks = [k for k in PROVENANCE if k not in meta] or (
        [] if any(k.endswith(".qmeta") for k in tensors) else ["quantised layer"])
    if lacks:
        raise CheckpointError(f"--quantized {path} holds no {lacks[0]}: not written by `phaseloop quantize`, "
                              f"or its header was edited; {QUANTIZE_AGAIN}")
    if DIGEST not in meta:
        raise CheckpointError(f"--quantized {path} holds no {DIGEST} (the digest of its tensors; files "
                              f"written before `quantize` recorded it have none), so damage cannot be told; "
                              f"{QUANTIZE_AGAIN}")
    if HEADER not in meta:  # without it an edited provenance would pass: another run's file would load
        raise CheckpointError(f"--quantized {path} holds no {HEADER} (the digest of its metadata; files written "
                              f"before `quantize` recorded it have none), so an edit cannot be told; {QUANTIZE_AGAIN}")
    check_header(meta, f"--quantized {path}", QUANTIZE_AGAIN)  # before its provenance is trusted
    want = provenance(run, run_cfg) if run is not None else {"model_config_sha256": config_digest(run_cfg["model"]),
                                                             "run": "this export's run"}
    if meta["model_config_sha256"] != want["model_config_sha256"]:
        raise CheckpointError(f"--quantized {path} was quantised from another model ({meta.get('arch')} run "
                              f"{meta.get('run')}), not {want['run']}; {QUANTIZE_AGAIN}")
    bad = next((k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
    if bad is not None:  # a checkpoint is refused so too (engine.checkpoint); every reader of the file sees this
        raise CheckpointError(f"--quantized {path}: {bad} is not finite (NaN or infinite values); {QUANTIZE_AGAIN}")
    if run is None and checkpoint is not None:
        want["checkpoint_sha256"] = checkpoint
    if (run is not None or checkpoint is not None) and meta["checkpoint_sha256"] != want["checkpoint_sha256"]:
        raise CheckpointError(f"--quantized {path} was quantised from another checkpoint (run {meta.get('run')}, "
                              f"or this run before it trained further); {QUANTIZE_AGAIN}")
    check_digest(tensors, meta, f"--quantized {path}", QUANTIZE_AGAIN)  # last: the checks above name what they find
    return tensors, meta


def load_dequantized(model: nn.Module, path: str | Path, run: str | Path, run_cfg: dict) -> dict:
    """Load the quantised file into ``model`` as dequantised fp32 weights (the function the
    quantised model computes); returns the file's metadata."""
    tensors, meta = read_quantized(path, run, run_cfg)
    try:
        load_quantized_state_dict(tensors, model)
    except RuntimeError as e:
        raise CheckpointError(f"--quantized {path} does not fit this run's model ({state_dict_error(e)}); "
                              f"{QUANTIZE_AGAIN}") from None
    except CheckpointError as e:  # a damaged quantised entry
        raise CheckpointError(f"--quantized {path}: {e}; {QUANTIZE_AGAIN}") from None
    return meta


INIT_FNS = ("normal_", "uniform_", "zeros_", "ones_", "constant_", "kaiming_uniform_", "kaiming_normal_",
            "xavier_uniform_", "xavier_normal_", "trunc_normal_", "orthogonal_")


@contextlib.contextmanager
def no_init():
    """``torch.nn.init``'s functions as no-ops while a model is built on the meta device
    (transformers' ``no_init_weights`` does the same): on meta tensors they initialise
    nothing, but the first of them loads torch's decompositions (sympy, ~70 MB resident)."""
    saved = {n: getattr(torch.nn.init, n) for n in INIT_FNS}
    try:
        for n in INIT_FNS:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def load_packed(run: str | Path, path: str | Path, device: str | torch.device = "cpu"):
    """(model, run config, info) of ``run`` with the quantised file's Linears as
    :class:`PackedLinear` and its other weights from the file: the fp32 weights of the
    quantised layers are never allocated. ``info``: the file's metadata and the kernel of
    each packed layer. CPU only: the kernels are torch's CPU ones."""
    if torch.device(device).type != "cpu":
        raise PhaseloopError(f"--quantized runs torch's CPU low-bit kernels; use --device cpu (not {device}), "
                             "or `phaseloop export --quantized` for dequantised weights on any device")
    run_dir = run_folder(run)
    ckpt = checkpoint_of(run)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet; train it first (phaseloop train)")
    run_cfg = read_run_config(run_dir, ckpt)
    tensors, meta = read_quantized(path, run, run_cfg)
    cfg = ModelConfig.from_dict(run_cfg["model"])
    with no_init():
        model = build_model(cfg, "meta")
    try:
        plain, qweights = split_quantized(tensors)
    except CheckpointError as e:
        raise CheckpointError(f"--quantized {path}: {e}; {QUANTIZE_AGAIN}") from None
    modules = dict(model.named_modules(remove_duplicate=False))
    kernels = {}
    for prefix, qw in qweights.items():
        name = prefix[: -len(".weight")]
        mod = modules.get(name)
        if not isinstance(mod, nn.Linear) or tuple(mod.weight.shape) != tuple(qw.shape):
            raise CheckpointError(f"--quantized {path} does not fit this run's model ({prefix} "
                                  f"{list(qw.shape)}); {QUANTIZE_AGAIN}")
        bias = plain.pop(f"{name}.bias", None)
        want = None if mod.bias is None else tuple(mod.bias.shape)
        if (bias is None) != (want is None) or (bias is not None and tuple(bias.shape) != want):
            got = "no bias" if bias is None else f"a bias {list(bias.shape)}"
            raise CheckpointError(f"--quantized {path} holds {got} for {name}, whose bias is "
                                  f"{'none' if want is None else list(want)}; {QUANTIZE_AGAIN}")
        packed = PackedLinear(qw, bias)
        for other, m in modules.items():  # one module under several names: one packed module
            if m is mod:
                _replace(model, other, packed)
        kernels[name] = packed.kernel
    if cfg.tie_embeddings and "head.weight" not in plain and "embed.tok.weight" in plain:
        plain["head.weight"] = plain["embed.tok.weight"]
    _check_plain(path, plain, model.state_dict())
    try:
        missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    except RuntimeError as e:  # a shape that does not fit
        raise CheckpointError(f"--quantized {path} does not fit this run's model ({state_dict_error(e)}); "
                              f"{QUANTIZE_AGAIN}") from None
    missing = [k for k in missing if k.rpartition(".")[0] not in kernels]  # the packed modules' own
    if missing or unexpected:
        what = f"{missing[0]} is missing there" if missing else f"{unexpected[0]} is not in this model"
        raise CheckpointError(f"--quantized {path} does not fit this run's model ({what}); {QUANTIZE_AGAIN}")
    if cfg.tie_embeddings:
        model.head.weight = model.embed.tok.weight
    for m in model.modules():  # derived (non-persistent) buffers: allocated, then recomputed
        for n, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[n] = torch.empty_like(b, device="cpu")
    model.reset_buffers()
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"--quantized {path} lacks {left[0]}; {QUANTIZE_AGAIN}")
    return model.eval(), run_cfg, {"metadata": meta, "kernels": kernels, "notes": _notes(model)}


def _check_plain(path, plain: dict, want: dict) -> None:
    """The file's unquantised tensors in the model's dtypes (``load_state_dict`` with
    ``assign`` would take an fp16 norm as it is), each refused by name."""
    for key, t in plain.items():
        ref = want.get(key)
        if ref is not None and t.dtype != ref.dtype:
            raise CheckpointError(f"--quantized {path}: {key} is {t.dtype}, the model's is {ref.dtype}; "
                                  f"{QUANTIZE_AGAIN}")


def _notes(model: nn.Module) -> list[str]:
    """What runs slower than it could: int8 in groups (the kernel takes one scale per row,
    so the products run once per group) and layers the kernels cannot take (fp32)."""
    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    grouped = [n for n, m in packed if m.kernel == "int8" and m.n_groups > 1]
    plain = [n for n, m in packed if m.kernel == "fp32"]
    notes = []
    if grouped:
        notes.append(f"int8 in groups runs its kernel once per group ({len(grouped)} layers, e.g. {grouped[0]}): "
                     "quantize with --group-size -1 for int8's own one-scale-per-row form")
    if plain:
        notes.append(f"{len(plain)} quantised layers fit no int4 kernel (rows not a multiple of 16, or groups "
                     f"that are not multiples of 32; e.g. {plain[0]}) and run their dequantised weights in fp32")
    return notes
