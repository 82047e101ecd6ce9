"""Run folders and checkpoints in safe formats only: safetensors for tensors, strict JSON
for everything else. A checkpoint folder is written beside the old one and swapped in by
renames, so an interruption never leaves a half-written checkpoint; its manifest.json,
written last, records the size and sha256 of every file, checked on load, so a damaged
file is refused by name, never loaded nor taken for a missing checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from phaseloop.config import ModelConfig
from phaseloop.data.corpus import Corpus, corpus_args, load_corpus
from phaseloop.data.tokenizer import ByteTokenizer, HFTokenizer
from phaseloop.engine.config import TrainConfig
from phaseloop.engine.trainer_state import flatten_optimizer, meta_fault, unflatten_optimizer
from phaseloop.errors import CheckpointError, ConfigError, first_line
from phaseloop.files import (
    digests_fault,
    dumps,
    file_digests,
    read_json,
    save_safetensors,
    sha256_file,
    why_missing,
    write_json,
)
from phaseloop.model import build_model
from phaseloop.registry import UnknownArch, missing_plugin

CKPT, OLD, TMP_PREFIX = "checkpoint", ".checkpoint.old", ".checkpoint.tmp-"
MANIFEST = "manifest.json"
CKPT_FILES = ("model.safetensors", "trainer.safetensors", "trainer.json")
CONFIG_DIGEST = "config_sha256"  # the manifest's digest of the run's config.json (absent before 0.2)
RUN_SECTIONS = ("model", "train", "data")  # what every run's config.json holds


def config_digest(cfg: dict) -> str:
    """sha256 of a run config as canonical strict JSON (sorted keys): the same for the
    dict written and for config.json read back, whatever its indentation."""
    return hashlib.sha256(dumps(cfg, sort_keys=True).encode()).hexdigest()


# the data section's keys that readers use, and their types (an LM run's; a task run's has others)
_DATA_TYPES = {"source": str, "load": dict, "tokenizer": str, "tokenizer_sha256": (str, type(None)),
               "fingerprint": str}
_DATA_TYPES_SAID = {"source": "a data source", "load": "an object of load_corpus arguments",
                    "tokenizer": "a tokenizer name", "tokenizer_sha256": "a sha256 or null",
                    "fingerprint": "a fingerprint"}


def read_run_config(run_dir: str | Path, ckpt: Path | None = None,
                    fix: str = "restore it from a copy of the run", sections=RUN_SECTIONS) -> dict:
    """A run's config.json, checked wherever a run is read (resume, eval, generate,
    quantize, export): a JSON object whose model, train and data sections are objects,
    whose model and train sections are valid configs, and which is the file the run
    wrote: the checkpoint's manifest (``ckpt``, default the run's) records its digest,
    so a hand edit (a learning rate, a step count, a seed) is refused, naming the file,
    not resumed silently. Checkpoints written before the digest existed are not checked.
    ``fix``: what to do, for the message; ``sections``: those it must hold (a run of the
    engine's own, e.g. a test's, may hold others)."""
    run_dir = Path(run_dir)
    path = run_dir / "config.json"
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} is not a run config (a JSON object of sections: "
                              f"{', '.join(sections)}) but a JSON {type(cfg).__name__}; {fix}")
    for name in sections:
        if name not in cfg:
            raise CheckpointError(f"{path} has no {name} section; {fix}")
    for name in (*sections, "parallel"):  # parallel: optional (runs of 0.1 have none)
        if name in cfg and not isinstance(cfg[name], dict):
            raise CheckpointError(f"{path}: its {name} section is a JSON {type(cfg[name]).__name__}, not "
                                  f"an object of settings; {fix}")
    world = cfg.get("parallel", {}).get("world_size", 1)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{path}: parallel.world_size is {world!r}, not the positive whole number of "
                              f"processes the run was trained with; {fix}")
    data = cfg.get("data", {})
    for key, types in _DATA_TYPES.items():
        if key in data and not isinstance(data[key], types):
            raise CheckpointError(f"{path}: data.{key} is {data[key]!r}, not {_DATA_TYPES_SAID[key]}; {fix}")
    if isinstance(data.get("load"), dict) and not isinstance(data["load"].get("spec"), str):
        raise CheckpointError(f"{path}: data.load names no source (spec); {fix}")
    ckpt = checkpoint_dir(run_dir) if ckpt is None else Path(ckpt)
    if ckpt is not None and (ckpt / MANIFEST).is_file():
        manifest = read_json(ckpt / MANIFEST)
        want = manifest.get(CONFIG_DIGEST) if isinstance(manifest, dict) else None
        if want is not None and config_digest(cfg) != want:
            raise CheckpointError(
                f"{path} was changed after the checkpoint of step {manifest.get('step')} was written "
                f"(its digest differs from the one in {ckpt.name}/{MANIFEST}); settings are not edited in "
                "place: restore the file as the run wrote it, then resume with flags (a different setting "
                "is refused by name), or start a new run in another --out")
    for name, build in (("model", ModelConfig.from_dict), ("train", TrainConfig.from_dict)):
        if name not in sections:
            continue
        try:
            build(cfg[name])
        except UnknownArch as e:  # the file is fine: this machine lacks the architecture's plugin
            software = cfg.get("software") if isinstance(cfg.get("software"), dict) else {}
            plugin = software.get("arch_plugin") if isinstance(software.get("arch_plugin"), str) else None
            raise CheckpointError(f"{path}: this run's model is arch {e.name!r}, which no package installed here "
                                  f"registers; {missing_plugin(e.name, plugin)}") from None
        except (ConfigError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: its {name} section is not valid ({first_line(e)}); {fix}") from None
    return cfg


def save_checkpoint(run_dir: Path, model: torch.nn.Module | dict, optimizer=None, step: int = 0,
                    data_state: dict | None = None, extra: dict | None = None,
                    rng: dict | None = None, config: dict | None = None) -> Path:
    """Weights (a module or its full state dict), optimiser (or its state dict), RNG
    states (``rng``: name -> tensor, stored as ``rng.<name>``; default this process's),
    the data position (``data_state``, stored as ``data.<name>``) and ``extra`` JSON
    fields, swapped in atomically. ``config``: the run's config.json as written; its
    ``config_digest`` goes into the manifest, so a later edit of config.json is recognised
    (``read_run_config``)."""
    run_dir = Path(run_dir)
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=TMP_PREFIX))
    tmp.chmod(0o755)
    try:
        full = model if isinstance(model, dict) else model.state_dict()
        state = {k: v.detach().cpu().contiguous() for k, v in full.items()}
        final, old = run_dir / CKPT, run_dir / OLD
        save_safetensors(_dedupe_tied(state), tmp / "model.safetensors", metadata={"step": str(step)},
                         target=final / "model.safetensors")
        trainer_tensors = {f"rng.{k}": v for k, v in (rng or rng_states()).items()}
        trainer_tensors.update({f"data.{k}": v for k, v in (data_state or {}).items()})
        meta = {"step": step, **(extra or {})}
        if optimizer is not None:
            opt = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
            t, m = flatten_optimizer(opt)
            trainer_tensors.update(t)
            meta["optimizer"] = m
        save_safetensors(trainer_tensors, tmp / "trainer.safetensors", target=final / "trainer.safetensors")
        write_json(tmp / "trainer.json", meta)
        for name in ("model.safetensors", "trainer.safetensors"):
            (tmp / name).chmod(0o644)  # as the JSON beside them
        write_json(tmp / MANIFEST, {"step": step, "files": file_digests(tmp, CKPT_FILES),
                                    **({CONFIG_DIGEST: config_digest(config)} if config is not None else {})})
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def rng_states() -> dict:
    """This process's RNG states: torch's CPU generator and every CUDA device's."""
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return out


def _dedupe_tied(state: dict) -> dict:
    """safetensors refuses shared storage: drop the tied head (rebuilt from config)."""
    if "head.weight" in state and "embed.tok.weight" in state and \
            state["head.weight"].data_ptr() == state["embed.tok.weight"].data_ptr():
        state = dict(state)
        state.pop("head.weight")
    return state


def checkpoint_dir(run_dir: Path) -> Path | None:
    """The run's checkpoint folder, complete or not (``verify_checkpoint`` decides), or
    None when it has none. OLD alone is left only by an interrupted swap."""
    run_dir = Path(run_dir)
    for name in (CKPT, OLD):
        if (run_dir / name).is_dir():
            return run_dir / name
    return None


def checkpoint_weights(run: str | Path) -> Path | None:
    """model.safetensors of a run folder's checkpoint, or of a checkpoint folder given
    itself; None when the run has no checkpoint (``load_run`` then refuses it)."""
    run = Path(run)
    run_dir = run_folder(run)
    ckpt = checkpoint_dir(run_dir) if run_dir == run else run
    return None if ckpt is None else ckpt / "model.safetensors"


def verify_checkpoint(ckpt: Path, names=CKPT_FILES,
                      fix: str = "restore it from a copy, or start the run again in another --out (nothing was "
                                 "changed)") -> None:
    """Refuse a checkpoint whose files ``names`` are missing or differ (size, sha256)
    from its manifest, naming the file and ``fix``. A checkpoint of a phaseloop without
    manifests is accepted when its files are all there."""
    ckpt = Path(ckpt)
    if not (ckpt / MANIFEST).exists():
        if _writes_manifests(ckpt.parent / "config.json"):
            raise CheckpointError(f"checkpoint {ckpt} is damaged: its {MANIFEST} is missing (the phaseloop "
                                  f"that wrote it always writes one); {fix}")
        missing = [n for n in CKPT_FILES if not (ckpt / n).is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {ckpt} is damaged: {missing[0]} is missing; {fix}")
        return
    manifest = read_json(ckpt / MANIFEST)
    why = digests_fault(ckpt, manifest.get("files") if isinstance(manifest, dict) else None, names, MANIFEST)
    if why is not None:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {why}; {fix}")


def _writes_manifests(config: Path) -> bool:
    """Whether the run's config.json says a phaseloop >= 0.2 wrote it (every checkpoint of
    one has a manifest; older runs may not)."""
    try:
        version = json.loads(config.read_text()).get("software", {}).get("phaseloop", "")
        return tuple(int(x) for x in version.split(".")[:2]) >= (0, 2)
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def remove_orphans(run_dir: Path) -> list[Path]:
    """Remove what an interrupted write leaves in a run folder: temporary checkpoint
    folders and files, and the previous checkpoint once the new one is in place."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    gone = [p for p in run_dir.iterdir() if p.name.startswith(TMP_PREFIX)
            or (p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file())
            or (p.name == OLD and (run_dir / CKPT).is_dir())]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return gone


def _load_safetensors(path: Path) -> dict:
    try:
        return load_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found; the checkpoint is incomplete") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} ({first_line(e, 80)}); the checkpoint is damaged "
                              "— restore it or retrain") from None


# Parameter names of 0.1's checkpoints -> today's (the block's between-sub-layer map was
# called ``mid``, the embedding's horn sat directly on the embedding).
_LEGACY_NAMES = ((".mid.", ".between."), ("embed.horn.", "embed.options.horn."))


def _rename_legacy(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        for old, new in _LEGACY_NAMES:
            k = k.replace(old, new)
        out[k] = v.reshape(1) if v.dim() == 0 else v  # scalars (ACT bias, horn gain) are 1-D now
    return out


class StateMismatch(CheckpointError):
    """Weights that do not fit a model; ``detail`` names the first names and shapes."""

    def __init__(self, msg: str, detail: str):
        super().__init__(msg)
        self.detail = detail


def load_model_state(model: torch.nn.Module, ckpt: Path) -> None:
    """Load a checkpoint folder's (or bare) model.safetensors into ``model``, verified
    against its manifest; StateMismatch names what does not fit (names, shapes)."""
    model.load_state_dict(read_model_state(model, ckpt))


def read_model_state(model: torch.nn.Module, ckpt: Path, head_from_embedding: bool = False) -> dict:
    """A checkpoint folder's (or bare) model.safetensors, verified against its manifest,
    as a state dict that fits ``model`` (StateMismatch names what does not: names,
    shapes). A tied model's head is stored once, as the embedding; ``head_from_embedding``:
    the weights are a tied model's and ``model`` is not, so its head starts as a copy of
    the embedding (the same function)."""
    if (Path(ckpt) / "trainer.json").exists() or (Path(ckpt) / MANIFEST).exists():
        verify_checkpoint(ckpt, ("model.safetensors",))  # a checkpoint folder, not bare weights
    state = _rename_legacy(_load_safetensors(Path(ckpt) / "model.safetensors"))
    own = model.state_dict()
    tied = "head.weight" in own and "embed.tok.weight" in own and \
        own["head.weight"].data_ptr() == own["embed.tok.weight"].data_ptr()
    if (tied or head_from_embedding) and "embed.tok.weight" in state:
        embedding = state["embed.tok.weight"]
        state.setdefault("head.weight", embedding if tied else embedding.clone())
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    bad_shape = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or bad_shape:
        detail = "; ".join(x for x in (
            f"{', '.join(missing[:3])} missing there" if missing else "",
            f"{', '.join(unexpected[:3])} not in this model" if unexpected else "",
            ", ".join(f"{k} is {list(state[k].shape)} there, {list(own[k].shape)} here" for k in bad_shape[:3]))
            if x)
        raise StateMismatch(f"checkpoint {ckpt} does not match its model config ({detail}); "
                            "use the config.json saved with these weights", detail)
    return state


def load_trainer_state(ckpt: Path) -> tuple[dict, dict]:
    verify_checkpoint(ckpt, ("trainer.safetensors", "trainer.json"))
    meta = read_json(Path(ckpt) / "trainer.json")
    tensors = _load_safetensors(Path(ckpt) / "trainer.safetensors")
    if isinstance(meta, dict) and "optimizer" not in meta and type(meta.get("step")) is int:  # optimizer=None
        raise CheckpointError(f"checkpoint {ckpt} holds weights only (no optimizer state), which a run cannot "
                              "resume from: continue from them with --init-from RUN in a new --out")
    why = meta_fault(meta, tensors)
    if why is not None:
        raise CheckpointError(f"{Path(ckpt) / 'trainer.json'}: {why}, not the trainer state phaseloop writes; "
                              "the checkpoint is damaged or foreign: resume from a kept checkpoint-* copy "
                              "or start a new run in another --out")
    return meta, tensors


def optimizer_state(meta: dict, tensors: dict) -> dict:
    return unflatten_optimizer(tensors, meta["optimizer"])


def data_state(tensors: dict) -> dict:
    """The ``data_state`` given to ``save_checkpoint``, back from the trainer tensors."""
    return {k[len("data."):]: v for k, v in tensors.items() if k.startswith("data.")}


def load_run(path: str | Path, device: str | torch.device = "cpu"):
    """Load (model, run_config) from a run folder (or its checkpoint folder) for eval,
    generation or analysis."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} {why_missing(path)}; pass a run folder made by `phaseloop train`")
    is_ckpt = (path / "model.safetensors").exists() or path.name in (CKPT, OLD)
    run_dir = path.parent if is_ckpt else path
    ckpt = path if is_ckpt else checkpoint_dir(run_dir)
    run_cfg = read_run_config(run_dir, ckpt)
    cfg = ModelConfig.from_dict(run_cfg["model"])
    if ckpt is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet; train it first (phaseloop train)")
    model = build_model(cfg)
    load_model_state(model, ckpt)
    refuse_nonfinite(model.state_dict(), ckpt, "train again with a lower --lr")
    return model.to(device).eval(), run_cfg


def refuse_nonfinite(state: dict, ckpt: Path, fix: str) -> None:
    """One line naming the first weight of ``state`` (read from ``ckpt``) that holds NaN or inf."""
    bad = next((k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    if bad is not None:
        raise CheckpointError(f"the weights in {ckpt} hold NaN or inf ({bad}): that run diverged; {fix}")


TOKENIZER_COPY = "tokenizer.json"  # a run keeps the tokenizer it was trained with


def run_folder(path: str | Path) -> Path:
    """The run folder of ``path``: itself, or the parent of a checkpoint folder."""
    path = Path(path)
    return path.parent if (path / "model.safetensors").exists() else path


def run_tokenizer(path: str | Path, run_cfg: dict):
    """The tokenizer a run was trained with: bytes, or the run's own copy of its
    tokenizer.json, refused when that copy no longer has the recorded sha256."""
    run_dir = run_folder(path)
    if isinstance(run_cfg.get("task"), dict):  # tasks.runner: ids of the task's own symbols (CharVocab, WordVocab)
        raise ConfigError(f"{run_dir} is a task run (`phaseloop task` / `babi`, task "
                          f"{str(run_cfg['task'].get('task', '?'))[:60]!r}): its tokens are the task's own "
                          "symbols, not text, so no text tokenizer reads it; evaluate it with `phaseloop task` "
                          "or `phaseloop babi` (the same --out)")
    data = run_cfg.get("data", {})
    if data.get("tokenizer", "bytes") == "bytes" and data.get("tokenizer_sha256") is None:
        # (a tokenizer file has a digest, whatever its folder's name)
        return ByteTokenizer()
    copy = run_dir / TOKENIZER_COPY
    if not copy.is_file():
        raise CheckpointError(f"{copy} is missing (the run was trained with tokenizer "
                              f"{data.get('tokenizer')!r}); restore the file from the run")
    sha = sha256_file(copy)
    if sha != data.get("tokenizer_sha256"):
        raise CheckpointError(f"{copy} has changed since the run was trained (sha256 "
                              f"{sha[:12]}..., recorded {str(data.get('tokenizer_sha256'))[:12]}...); "
                              "restore the original tokenizer file")
    return HFTokenizer(copy)


def run_corpus(run: str | os.PathLike, run_cfg: dict, spec: str | None = None, progress: bool = False) -> Corpus:
    """A trained run's data (or ``spec`` instead), read with the run's own tokenizer."""
    tok = run_tokenizer(run, run_cfg)  # first: a task run is refused as one, not for its data section
    data = run_cfg["data"]
    args = corpus_args(data) if spec is None else {**(data.get("load") or {}), "spec": spec}
    return load_corpus(tokenizer=tok, progress=progress, strict=False, **args)
