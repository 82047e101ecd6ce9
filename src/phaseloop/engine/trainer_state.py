"""The trainer state of a checkpoint (``trainer.json`` beside ``trainer.safetensors``):
the optimizer's state dict split into tensors and the JSON that names them, and the check
that a ``trainer.json`` read back is what ``checkpoint.save_checkpoint`` writes."""

from __future__ import annotations

import torch


def flatten_optimizer(opt_state: dict) -> tuple[dict, dict]:
    tensors, meta = {}, {"param_groups": opt_state["param_groups"], "state": {}}
    for idx, st in opt_state["state"].items():
        meta["state"][str(idx)] = []
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"optim.{idx}.{k}"] = v.detach().cpu().contiguous()
                meta["state"][str(idx)].append(k)
            else:
                raise TypeError(f"unsupported optimizer state {k}")
    return tensors, meta


def unflatten_optimizer(tensors: dict, meta: dict) -> dict:
    state = {(int(idx) if idx.isdigit() else idx): {k: tensors[f"optim.{idx}.{k}"] for k in keys}
             for idx, keys in meta["state"].items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def meta_fault(meta, tensors: dict) -> str | None:
    """What in ``trainer.json`` is not as ``save_checkpoint`` writes it (None: nothing)."""
    if not isinstance(meta, dict):
        return f"it holds a JSON {type(meta).__name__}"
    if not _count(meta.get("step")):
        return f"its step is {meta.get('step')!r}"
    for key in ("tokens", "skipped"):
        if key in meta and not _count(meta[key]):
            return f"its {key} is {meta[key]!r}"
    if "elapsed" in meta and (isinstance(meta["elapsed"], bool) or not isinstance(meta["elapsed"], (int, float))):
        return f"its elapsed is {meta['elapsed']!r}"
    opt = meta.get("optimizer")
    if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) and all(_count(i) for i in g["params"])
                    for g in opt["param_groups"])):
        return "its optimizer entry is not {state, param_groups of parameter indices}"
    for idx, keys in opt["state"].items():
        if not isinstance(keys, list) or any(f"optim.{idx}.{k}" not in tensors for k in keys):
            return f"its optimizer state of parameter {idx} names tensors trainer.safetensors lacks"
    return None
