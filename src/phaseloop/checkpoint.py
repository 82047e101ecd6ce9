"""Run folders and checkpoints in safe formats only: safetensors for tensors, JSON for
everything else. A checkpoint folder is written beside the old one and swapped in by
renames, so an interruption never leaves a half-written checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .files import atomic_write_bytes
from .errors import CheckpointError, ConfigError

CKPT, OLD = "checkpoint", ".checkpoint.old"


def write_json(path: Path, obj) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found; point at a run folder made by `phaseloop train`") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e.__class__.__name__}; the file is damaged "
                              "— restore it or start a new run") from None


def _flatten_optimizer(opt_state: dict) -> tuple[dict, dict]:
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


def _unflatten_optimizer(tensors: dict, meta: dict) -> dict:
    state = {int(idx): {k: tensors[f"optim.{idx}.{k}"] for k in keys}
             for idx, keys in meta["state"].items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(run_dir: Path, model: torch.nn.Module, optimizer=None, step: int = 0,
                    data_state: dict | None = None, extra: dict | None = None) -> Path:
    """Weights, optimiser, RNG states, the data position (``data_state``: name -> tensor,
    stored as ``data.<name>``) and ``extra`` JSON fields, swapped in atomically."""
    run_dir = Path(run_dir)
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=".checkpoint.tmp-"))
    tmp.chmod(0o755)
    try:
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        save_file(_dedupe_tied(state), tmp / "model.safetensors", metadata={"step": str(step)})
        trainer_tensors = {"rng.torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                trainer_tensors[f"rng.cuda.{i}"] = s
        trainer_tensors.update({f"data.{k}": v for k, v in (data_state or {}).items()})
        meta = {"step": step, **(extra or {})}
        if optimizer is not None:
            t, m = _flatten_optimizer(optimizer.state_dict())
            trainer_tensors.update(t)
            meta["optimizer"] = m
        save_file(trainer_tensors, tmp / "trainer.safetensors")
        write_json(tmp / "trainer.json", meta)
        final, old = run_dir / CKPT, run_dir / OLD
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _dedupe_tied(state: dict) -> dict:
    """safetensors refuses shared storage: drop the tied head (rebuilt from config)."""
    if "head.weight" in state and "embed.tok.weight" in state and \
            state["head.weight"].data_ptr() == state["embed.tok.weight"].data_ptr():
        state = dict(state)
        state.pop("head.weight")
    return state


def checkpoint_dir(run_dir: Path) -> Path | None:
    run_dir = Path(run_dir)
    for name in (CKPT, OLD):  # OLD survives only if a swap was interrupted
        if (run_dir / name / "trainer.json").exists():
            return run_dir / name
    return None


def _load_safetensors(path: Path) -> dict:
    try:
        return load_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found; the checkpoint is incomplete") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({str(e)[:80]}); the checkpoint is damaged "
                              "— restore it or retrain") from None


# Parameter names of earlier versions -> today's (the block's between-sub-layer map was
# called ``mid``, the embedding's horn sat directly on the embedding).
_LEGACY_NAMES = ((".mid.", ".between."), ("embed.horn.", "embed.options.horn."))


def _rename_legacy(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        for old, new in _LEGACY_NAMES:
            k = k.replace(old, new)
        out[k] = v
    return out


def load_model_state(model: torch.nn.Module, ckpt: Path) -> None:
    state = _rename_legacy(_load_safetensors(Path(ckpt) / "model.safetensors"))
    own = model.state_dict()
    if "head.weight" in own and "embed.tok.weight" in own and \
            own["head.weight"].data_ptr() == own["embed.tok.weight"].data_ptr():
        state.setdefault("head.weight", state.get("embed.tok.weight"))  # tied: stored once
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    bad_shape = [k for k in set(own) & set(state) if own[k].shape != state[k].shape]
    if missing or unexpected or bad_shape:
        detail = "; ".join(x for x in (
            f"missing {', '.join(missing[:3])}" if missing else "",
            f"unexpected {', '.join(unexpected[:3])}" if unexpected else "",
            f"shape differs for {', '.join(sorted(bad_shape)[:3])}" if bad_shape else "") if x)
        raise CheckpointError(f"checkpoint {ckpt} does not match its model config ({detail}); "
                              "use the config.json saved with these weights")
    model.load_state_dict(state)


def load_trainer_state(ckpt: Path) -> tuple[dict, dict]:
    meta = read_json(Path(ckpt) / "trainer.json")
    return meta, _load_safetensors(Path(ckpt) / "trainer.safetensors")


def optimizer_state(meta: dict, tensors: dict) -> dict:
    return _unflatten_optimizer(tensors, meta["optimizer"])


def data_state(tensors: dict) -> dict:
    """The ``data_state`` given to ``save_checkpoint``, back from the trainer tensors."""
    return {k[len("data."):]: v for k, v in tensors.items() if k.startswith("data.")}


def load_run(path: str | Path, device: str | torch.device = "cpu"):
    """Load (model, run_config) from a run folder (or its checkpoint folder) for eval,
    generation or analysis."""
    from .model import build_model

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a run folder made by `phaseloop train`")
    run_dir = path.parent if (path / "model.safetensors").exists() else path
    run_cfg = read_json(run_dir / "config.json")
    try:
        cfg = ModelConfig.from_dict(run_cfg["model"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{run_dir / 'config.json'} has no valid model config ({e}); "
                              "restore it from the run") from None
    except ConfigError as e:
        raise CheckpointError(f"{run_dir / 'config.json'}: {e}") from None
    ckpt = path if (path / "model.safetensors").exists() else checkpoint_dir(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet; train it first (phaseloop train)")
    model = build_model(cfg)
    load_model_state(model, ckpt)
    return model.to(device).eval(), run_cfg


TOKENIZER_COPY = "tokenizer.json"  # a run keeps the tokenizer it was trained with


def run_tokenizer(path: str | Path, run_cfg: dict):
    """The tokenizer a run was trained with: bytes, or the run's own copy of its
    tokenizer.json, refused when that copy no longer has the recorded sha256."""
    from .tokenizer import ByteTokenizer, HFTokenizer

    path = Path(path)
    run_dir = path.parent if (path / "model.safetensors").exists() else path
    data = run_cfg.get("data", {})
    if data.get("tokenizer", "bytes") == "bytes":
        return ByteTokenizer()
    copy = run_dir / TOKENIZER_COPY
    if not copy.is_file():
        raise CheckpointError(f"{copy} is missing (the run was trained with tokenizer "
                              f"{data.get('tokenizer')!r}); restore the file from the run")
    sha = hashlib.sha256(copy.read_bytes()).hexdigest()
    if sha != data.get("tokenizer_sha256"):
        raise CheckpointError(f"{copy} has changed since the run was trained (sha256 "
                              f"{sha[:12]}..., recorded {str(data.get('tokenizer_sha256'))[:12]}...); "
                              "restore the original tokenizer file")
    return HFTokenizer(copy)
