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
(section ``init``, with ``changed``: every model field that differs from the source's,
there and here) and carried into HF exports (phaseloop.json).

Fields that keep every shape may still change what the weights compute. Refused: another
head split of the same projections (``n_heads`` / ``n_kv_heads`` at the same shapes) and
a tied model from an untied one (one tensor cannot take both the embedding and the
head). A tied source into an untied model starts the head as a copy of the embedding (the
same function), said in a note. Every other such field (``rope_base``, ``embed_scale``,
``use_rope``, an architecture's options, ...) is said in one note each; the fields that
leave the function as it is (``config.same_function_fields``: ``max_seq_len``, dropout,
initial values) pass without one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from phaseloop.config import ModelConfig, same_function_fields
from phaseloop.engine.checkpoint import (
    MANIFEST,
    StateMismatch,
    checkpoint_dir,
    read_model_state,
    read_run_config,
    refuse_nonfinite,
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


def provenance(path: str | Path, model_cfg: ModelConfig | None = None) -> dict:
    """The ``init`` section of a run's config.json: what its weights started from, and
    (given this run's ``model_cfg``) the model fields that differ: name -> [there, here]."""
    run_dir, ckpt, cfg = source(path)
    manifest = read_json(ckpt / MANIFEST) if (ckpt / MANIFEST).is_file() else {}
    sha = manifest.get("files", {}).get("model.safetensors", {}).get("sha256")
    data = cfg.get("data", {})
    return {"from": str(run_dir.resolve()), "checkpoint": ckpt.name, "step": manifest.get("step"),
            "model_sha256": sha, "arch": cfg["model"].get("arch"),
            "tokenizer": data.get("tokenizer"), "tokenizer_sha256": data.get("tokenizer_sha256"),
            **({"changed": config_changes(cfg["model"], model_cfg)} if model_cfg is not None else {})}


def _named(data: dict) -> str:
    """A run's tokenizer as a message names it: its name, and the start of its file's sha256
    where it has a file (the byte tokenizer has none)."""
    sha = data.get("tokenizer_sha256")
    name = repr(data.get("tokenizer", "bytes"))
    return f"{name} (sha256 {sha[:12]}...)" if isinstance(sha, str) else name


def check_tokenizer(path: str | Path, data: dict, allow_new: bool) -> None:
    """An LM run's tokenizer (its ``data`` section: ``describe_tokenizer``'s keys) against the source's."""
    _, _, cfg = source(path)
    there = cfg.get("data", {})
    same = there.get("tokenizer_sha256") == data.get("tokenizer_sha256") and (
        data.get("tokenizer_sha256") is not None or there.get("tokenizer", "bytes") == data.get("tokenizer"))
    if same:
        return
    said = (f"--init-from {path} was trained with tokenizer {_named(there)}, this run uses {_named(data)}")
    if not allow_new:
        raise ConfigError(f"{said}; use the same --tokenizer (the source run's tokenizer.json), or pass "
                          "--allow-new-tokenizer for another of the same vocabulary size")
    v_there, v_here = there.get("tokenizer_vocab"), data.get("tokenizer_vocab")
    if v_there != v_here:
        raise ConfigError(f"{said}, of {v_there} tokens there and {v_here} here: --allow-new-tokenizer needs "
                          "vocabularies of the same size; use a tokenizer of that size")


def load_init(model, path: str | Path, log: Callable[[str], None] | None = None) -> None:
    """Load the source's weights into ``model`` (a freshly built model of the new run),
    refusing another architecture, any weight of another name or shape, and the field
    changes the weights cannot be taken into, by name; ``log`` gets a note for each other
    field that changes what the weights compute."""
    run_dir, ckpt, cfg = source(path)
    here = getattr(model, "cfg", None)
    there = cfg["model"]
    if isinstance(here, ModelConfig) and there.get("arch") != here.arch:
        raise ConfigError(f"--init-from {path} is arch {there.get('arch')!r}, this run's model is arch "
                          f"{here.arch!r}; build the same architecture (--preset/--arch as in {run_dir}/config.json)")
    untie = isinstance(here, ModelConfig) and bool(there.get("tie_embeddings")) and not here.tie_embeddings
    try:
        state = read_model_state(model, ckpt, head_from_embedding=untie)
    except StateMismatch as e:
        diff = ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in list(config_changes(there, here).items())[:3])
        raise ConfigError(f"--init-from {path}: its weights do not fit this model ({e.detail}"
                          + (f"; config: {diff}" if diff else "") + "); build the model with the source's "
                          "shape (its config.json), or start without --init-from") from None
    refuse_nonfinite(state, ckpt, "start from another run (--init-from), or without one")
    notes = check_changes(path, there, here)
    model.load_state_dict(state)
    for note in notes if log is not None else ():
        log(note)


def config_changes(there: dict, here) -> dict[str, list]:
    """The model fields whose values differ between the source's config (``there``, as
    its config.json holds it) and this run's ``here``: name -> [there, here]."""
    if not isinstance(here, ModelConfig):
        return {}
    try:
        there = ModelConfig.from_dict(there).to_dict()  # its derived values filled in, as here's
    except Exception:
        pass
    mine = here.to_dict()
    return {k: [there[k], mine[k]] for k in mine if k in there and there[k] != mine[k]}


def check_changes(path: str | Path, there: dict, here) -> list[str]:
    """Refuse the field changes that the same weights cannot be taken into (names and
    shapes fit already); the notes, one per field, of the others that change what the
    weights compute."""
    changed = config_changes(there, here)
    if not changed:
        return []
    heads = [k for k in ("n_heads", "n_kv_heads") if k in changed]
    if heads:
        said = ", ".join(f"{k} {changed[k][0]!r} there, {changed[k][1]!r} here" for k in heads)
        raise ConfigError(f"--init-from {path}: {said}: the same projection weights split into other "
                          "heads compute another function, which no training of the source chose; build "
                          "the model with the source's n_heads and n_kv_heads (its config.json), or start "
                          "without --init-from")
    if changed.get("tie_embeddings") == [False, True]:
        raise ConfigError(f"--init-from {path} has its own output head (tie_embeddings false), this run ties "
                          "it to the embedding: one tensor cannot take both embed.tok.weight and head.weight "
                          "(loading would keep the head and lose the embedding); train with --set "
                          "tie_embeddings=false, or start without --init-from")
    notes = []
    if changed.get("tie_embeddings") == [True, False]:
        notes.append(f"note: --init-from {path} ties its head to the embedding, this run does not: head.weight "
                     "starts as a copy of embed.tok.weight (the same function), then trains apart")
    same = same_function_fields(here)
    for k, (a, b) in changed.items():
        if k not in same and k != "tie_embeddings":
            notes.append(f"note: --init-from {path}: {k} {a!r} there, {b!r} here: the weights now compute "
                         "another function than they were trained for (no weight changes shape); recorded "
                         "in config.json (init.changed)")
    return notes
