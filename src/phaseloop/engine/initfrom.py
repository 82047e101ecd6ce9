"""Training from another run's weights (``--init-from RUN_OR_CHECKPOINT``): a new run, with
its own folder, config and optimiser, whose model starts from the source's weights
(continued pretraining on other data, a task model from an LM, a longer context).

Checked before anything is written: the source is a run folder (its checkpoint) or a
checkpoint folder in one (``RUN/checkpoint``, ``RUN/checkpoint-<step>``, ``RUN/best``),
verified against its manifest; the architecture is the same and every weight has the
same name and shape (a named error lists the first that differs and the config fields
behind it). ``max_seq_len`` may differ where no weight depends on it: every built-in
architecture computes its positions (RoPE, the 3PT horn, the UT coordinate signal), so
a longer context is allowed; an architecture with learned positions fails the shape check
by name. An LM run must use the source's tokenizer (the same sha256) unless
``allow_new_tokenizer`` and the vocabularies have the same size. The source (folder,
step, sha256 of its weights, its tokenizer) is recorded in the run's config.json
(section ``init``) and carried into HF exports (phaseloop.json)."""

from __future__ import annotations

from pathlib import Path

from phaseloop.config import ModelConfig
from phaseloop.engine.checkpoint import (
    MANIFEST,
    StateMismatch,
    checkpoint_dir,
    load_model_state,
    read_run_config,
    verify_checkpoint,
)
from phaseloop.errors import ConfigError
from phaseloop.files import read_json, why_missing


def source(path: str | Path) -> tuple[Path, Path, dict]:
    """(run folder, checkpoint folder, its config.json) of an --init-from source, verified."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--init-from {p} {why_missing(p)}; name a run folder made by `phaseloop train` "
                          "or a checkpoint folder in one")
    is_ckpt = (p / "model.safetensors").exists()
    run_dir = p.parent if is_ckpt else p
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"--init-from {p}: {run_dir} holds no run (no config.json); name a run folder "
                          "made by `phaseloop train` or a checkpoint folder in one")
    ckpt = p if is_ckpt else checkpoint_dir(run_dir)
    if ckpt is None:
        raise ConfigError(f"--init-from {p}: that run has no checkpoint yet; train it first or name another run")
    cfg = read_run_config(run_dir, ckpt, fix="restore it, or name another run in --init-from", sections=("model",))
    verify_checkpoint(ckpt, ("model.safetensors",))
    return run_dir, ckpt, cfg


def provenance(path: str | Path) -> dict:
    """The ``init`` section of a run's config.json: what its weights started from."""
    run_dir, ckpt, cfg = source(path)
    manifest = read_json(ckpt / MANIFEST) if (ckpt / MANIFEST).is_file() else {}
    sha = manifest.get("files", {}).get("model.safetensors", {}).get("sha256")
    data = cfg.get("data", {})
    return {"from": str(run_dir.resolve()), "checkpoint": ckpt.name, "step": manifest.get("step"),
            "model_sha256": sha, "arch": cfg["model"].get("arch"),
            "tokenizer": data.get("tokenizer"), "tokenizer_sha256": data.get("tokenizer_sha256")}


def check_tokenizer(path: str | Path, data: dict, allow_new: bool) -> None:
    """An LM run's tokenizer (its ``data`` section: ``describe_tokenizer``'s keys) against the source's."""
    _, _, cfg = source(path)
    there = cfg.get("data", {})
    same = there.get("tokenizer_sha256") == data.get("tokenizer_sha256") and (
        data.get("tokenizer_sha256") is not None or there.get("tokenizer", "bytes") == data.get("tokenizer"))
    if same:
        return
    said = (f"--init-from {path} was trained with tokenizer {there.get('tokenizer')!r} (sha256 "
            f"{str(there.get('tokenizer_sha256'))[:12]}...), this run uses {data.get('tokenizer')!r} (sha256 "
            f"{str(data.get('tokenizer_sha256'))[:12]}...)")
    if not allow_new:
        raise ConfigError(f"{said}; use the same --tokenizer (the source run's tokenizer.json), or pass "
                          "--allow-new-tokenizer for another of the same vocabulary size")
    v_there, v_here = there.get("tokenizer_vocab"), data.get("tokenizer_vocab")
    if v_there != v_here:
        raise ConfigError(f"{said}, of {v_there} tokens there and {v_here} here: --allow-new-tokenizer needs "
                          "vocabularies of the same size; use a tokenizer of that size")


def load_init(model, path: str | Path) -> None:
    """Load the source's weights into ``model`` (a freshly built model of the new run),
    refusing another architecture or any weight of another name or shape, by name."""
    run_dir, ckpt, cfg = source(path)
    here = getattr(model, "cfg", None)
    there = cfg["model"]
    if isinstance(here, ModelConfig) and there.get("arch") != here.arch:
        raise ConfigError(f"--init-from {path} is arch {there.get('arch')!r}, this run's model is arch "
                          f"{here.arch!r}; build the same architecture (--preset/--arch as in {run_dir}/config.json)")
    try:
        load_model_state(model, ckpt)
    except StateMismatch as e:
        diff = _differences(there, here)
        raise ConfigError(f"--init-from {path}: its weights do not fit this model ({e.detail}"
                          + (f"; config: {diff}" if diff else "") + "); build the model with the source's "
                          "shape (its config.json), or start without --init-from") from None


def _differences(there: dict, here) -> str:
    if not isinstance(here, ModelConfig):
        return ""
    try:
        there = ModelConfig.from_dict(there).to_dict()
    except Exception:
        pass
    mine = here.to_dict()
    keys = [k for k in mine if k in there and there[k] != mine[k]]
    return ", ".join(f"{k} {there[k]!r} there, {mine[k]!r} here" for k in keys[:3])
