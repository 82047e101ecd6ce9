"""A training run's configuration, resolved once (``resolve_run`` -> ``TrainRun``), read
from and written as TOML (``phaseloop train --config FILE`` / ``--print-config``).

Layers, each over the one before:

1. the preset (default: the baseline architecture's, ``registry.default_preset``), or an
   architecture at its defaults (``arch``, the CLI's --arch), or, resuming a run with no
   preset named, that run's config.json (its model, train and data sections and its copy
   of the tokenizer);
2. the config file: ``[model]`` (``preset = "..."`` and any ModelConfig field), ``[train]``
   (TrainConfig fields), ``[data]`` (``DATA_DEFAULTS``' keys);
3. the arguments: the CLI's --preset, --set, training flags, --data, --tokenizer, ...

then the model's vocabulary is fitted to the tokenizer (``fit_vocab``). A resumed run's
saved config is checked against the result when training starts (``RunFolder``).

TOML has no null. ``TrainRun.to_toml`` writes every resolved value, so the file stands
on its own, except that a None value is written as a comment and left out: a key left
out means the preset's value (the default preset's when none is named) or else the field's
default, which ``to_toml`` checks is None again, so reading the file back resolves to
the same configuration.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phaseloop import registry
from phaseloop.config import ModelConfig, merged
from phaseloop.data.corpus import corpus_args, load_corpus, separator_id
from phaseloop.data.tokenizer import Tokenizer, load_tokenizer
from phaseloop.depth import check_depth_sample, parse_depth_range
from phaseloop.engine import TrainConfig, dist
from phaseloop.engine.checkpoint import TOKENIZER_COPY, read_run_config, run_folder, run_tokenizer
from phaseloop.errors import ConfigError, PhaseloopError
from phaseloop.files import parse_toml
from phaseloop.lm.train import check_seq_len, fit_vocab, train
from phaseloop.model import build_model

SECTIONS = ("model", "train", "data")
# [data]: the source and how to read it (load_corpus's spec, tokenizer, text_column, split,
# streaming, doc_sep: the text of one token between documents, none by default)
DATA_DEFAULTS = {"source": "stdlib", "tokenizer": "bytes", "text_column": "text", "split": "train",
                 "streaming": False, "doc_sep": None}


def _known(section: str) -> set[str]:
    if section == "model":  # the core fields and every registered option group's
        return set(ModelConfig.field_names()) | {"preset"}
    if section == "train":
        return {f.name for f in dataclasses.fields(TrainConfig)}
    return set(DATA_DEFAULTS)


@dataclass
class TrainRun:
    """One training run, fully resolved: what ``phaseloop train`` trains and where."""

    model: ModelConfig  # vocab_size fitted to the tokenizer
    train: TrainConfig
    data: dict  # DATA_DEFAULTS' keys, every one set
    tokenizer: Tokenizer  # data["tokenizer"], loaded (a resumed run's: its own copy)
    out: Path
    resume: bool = False
    preset: str | None = None  # the model's starting point (None: a resumed run's saved model)
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. the vocabulary fitted

    def to_dict(self) -> dict:
        """The file's three sections, every value resolved ([model] names its preset)."""
        model = {"preset": self.preset} if self.preset else {}
        return {"model": {**model, **self.model.to_dict()}, "train": self.train.to_dict(),
                "data": dict(self.data)}

    def corpus_args(self) -> dict:
        """``load_corpus`` keyword arguments (the tokenizer apart)."""
        d = self.data
        return {"spec": d["source"], "text_column": d["text_column"], "split": d["split"],
                "streaming": d["streaming"], "doc_sep": d["doc_sep"]}

    def to_toml(self) -> str:
        """The configuration as a TOML file that ``--config`` reads back to this one."""
        import tomli_w

        sections = self.to_dict()
        _check_nones(sections)
        lines = ["# phaseloop train --config FILE: a run's configuration, every value resolved. A key",
                 "# left out takes the preset's value, else its default; a none value is left out (commented),",
                 "# and so is a derived one (shown commented: left out, it follows the fields it derives from)."]
        derived = _left_to_derive(sections["model"], self.model.derived())
        for name, d in sections.items():
            lines += ["", f"[{name}]"]
            for k, v in d.items():
                line = f"# {k} = none" if v is None else tomli_w.dumps({k: v}).rstrip("\n")
                lines.append(f"# {line}  (derived)" if name == "model" and k in derived else line)
        return "\n".join(lines) + "\n"


def _model_of(model: dict) -> ModelConfig:
    """The model a file's [model] section gives (``resolve_run``'s layers 1-2): its preset
    with the fields over it, or an architecture at its defaults, else the default preset's."""
    model = dict(model)
    preset = model.pop("preset", None)
    if preset is None and model.get("arch") is not None:
        return ModelConfig(**model)
    return ModelConfig.from_preset(preset or registry.default_preset(), **model)


def _left_to_derive(model: dict, derived: set[str]) -> set[str]:
    """The derived fields of a [model] section that come back the same when left out (a
    preset that gives one would put its own value there instead: that one is written)."""
    if not derived:
        return set()
    back = _model_of({k: v for k, v in model.items() if v is not None and k not in derived}).to_dict()
    return {k for k in derived if back.get(k) == model.get(k)}


def _check_nones(sections: dict) -> None:
    """Every None left out of the TOML must come back as None when read: a key left out
    takes the preset's value (the default preset's when none is named), else the field's default."""
    model = dict(sections["model"])
    preset = model.pop("preset", registry.default_preset())
    for name, want, build in (("model", model, lambda d: ModelConfig.from_preset(preset, **d)),
                              ("train", sections["train"], TrainConfig.from_dict)):
        back = build({k: v for k, v in want.items() if v is not None}).to_dict()
        k = next((k for k in want if want[k] is None and back.get(k) is not None), None)
        if k is not None:
            raise ConfigError(f"[{name}] {k} is none, which TOML cannot hold, and left out it would be "
                              f"{back[k]!r}; set {k} to a value")


# ---------------------------------------------------------------------------- reading
def read_config(path: str | os.PathLike) -> dict[str, dict]:
    """The sections of a TOML config file, checked (``check_config``)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; check the --config path") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder; pass a .toml file to --config") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text; pass a .toml file to --config") from None
    return check_config(parse_toml(text, f"config file {path}"), str(path))


def check_config(d: dict, where: str = "config") -> dict[str, dict]:
    """{section: {key: value}} with only known sections and keys, each a plain value."""
    out = {s: {} for s in SECTIONS}
    model = d.get("model")
    if isinstance(model, dict) and isinstance(model.get("arch"), str) and registry.by_alias(model["arch"]) is None:
        registry.get_arch(model["arch"])  # a plugin not installed here: said first, not as its options' keys
    for name, section in d.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{where}: {name} = {section!r} is outside any section; put it under "
                              "[model], [train] or [data]")
        if name not in SECTIONS:
            close = difflib.get_close_matches(name, SECTIONS, n=1)
            hint = f" (did you mean [{close[0]}]?)" if close else ""
            raise ConfigError(f"{where}: unknown section [{name}]{hint}; the sections are [model], "
                              "[train] and [data]")
        known = _known(name)
        for key, value in section.items():
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(known))}"
                raise ConfigError(f"{where}: unknown key {key!r} in section [{name}]; {hint}")
            if isinstance(value, dict):
                raise ConfigError(f"{where}: [{name}] {key} is a table; write {key} = VALUE")
        out[name] = dict(section)
    return out


# ---------------------------------------------------------------------------- resolving
def _check_data(data: dict) -> None:
    for k, v in data.items():
        if k == "streaming" and not isinstance(v, bool):
            raise ConfigError.invalid(f"streaming={v!r}: must be true or false", "data config")
        if k == "doc_sep" and v is None:
            continue
        if k != "streaming" and (not isinstance(v, str) or not v):
            raise ConfigError.invalid(f"{k}={v!r}: must be a non-empty string", "data config")


def resolve_run(config: str | os.PathLike | dict | None = None, *, preset: str | None = None,
                arch: str | None = None, model: dict | None = None, train: dict | None = None, data: dict | None = None,
                out: str | os.PathLike | None = None, resume: bool = False) -> TrainRun:
    """The run that ``phaseloop train`` would train. ``config``: a TOML file or a dict of its
    sections; ``preset`` or ``arch`` (that architecture at its defaults), ``model``
    (ModelConfig fields, as --set), ``train`` (TrainConfig
    fields) and ``data`` (``DATA_DEFAULTS``' keys) go over it; ``out`` (default
    runs/PRESET-TIMESTAMP) and ``resume`` as the CLI's. Reads the saved config.json of a
    run being resumed and loads the tokenizer; builds nothing, reads no data. What it
    adapted (the vocabulary) is in ``notes``, for ``train_run`` to say."""
    if config is None:
        file = {s: {} for s in SECTIONS}
    elif isinstance(config, dict):
        file = check_config(config)
    else:
        file = read_config(config)
    for name, given in (("train", train), ("data", data)):
        unknown = sorted(set(given or {}) - _known(name))
        if unknown:
            raise ConfigError(f"unknown {name} key(s) {', '.join(unknown)}; known: {', '.join(sorted(_known(name)))}")
    fields = dict(file["model"])
    file_preset = fields.pop("preset", None)
    if preset is not None and isinstance(file_preset, str) and preset != file_preset and fields:
        # --preset replaces the file's: keep only what the file changes of its own preset (a
        # --print-config file lists every field, which would otherwise rebuild the old model)
        try:
            own = ModelConfig.from_preset(file_preset).to_dict()
        except PhaseloopError:
            own = {}
        fields = {k: v for k, v in fields.items() if k not in own or own[k] != v}
    preset = preset or file_preset
    if preset is not None and not isinstance(preset, str):
        raise ConfigError.invalid(f"preset={preset!r}: must be a preset name, e.g. "
                          f"\"{registry.default_preset()}\"")
    fields = merged(fields, model or {})  # --set over the file (the layer count under either name)
    if resume and out is None:  # a fresh timestamped folder holds nothing to continue
        raise ConfigError("--resume needs --out, the folder of the run to continue")
    if out is not None and not os.fspath(out):
        raise ConfigError("--out '': name a folder for the run (or drop --out for runs/PRESET-TIME)")
    out = Path(out or f"runs/{preset or arch or registry.default_preset()}-{time.strftime('%Y%m%d-%H%M%S')}")
    saved = read_run_config(out, fix="restore it as the run wrote it, or choose another --out") \
        if resume and (out / "config.json").exists() else None

    if saved is not None and preset is None:
        model_cfg = ModelConfig.from_dict(merged(saved["model"], fields))
    elif preset is None and (arch or file["model"].get("arch")) is not None:
        # --arch, or a file's [model] arch without a preset: that architecture's defaults
        model_cfg = ModelConfig(**{"arch": arch or file["model"]["arch"], **fields})
    else:
        preset = preset or registry.default_preset()
        model_cfg = ModelConfig.from_preset(preset, **fields)
    if arch is not None and model_cfg.arch != arch:
        raise ConfigError(f"--arch {arch} but the model is arch {model_cfg.arch!r} (from "
                          f"{'--preset ' + preset if preset else 'the run being resumed or --set arch'}); "
                          "drop one of them")
    tc = TrainConfig.from_dict({**(saved["train"] if saved else {}), **file["train"], **(train or {})})

    given = {**file["data"], **(data or {})}
    _check_data(given)
    if saved is not None:  # the run's data and its copy of the tokenizer, unless given again
        if "task" in saved:  # a task runner's seed folder: its data are examples, not a text corpus
            raise ConfigError(f"{out} is a run of `phaseloop task` / `babi`, not of `phaseloop train`; resume it "
                              "with the task command that made it")
        load = corpus_args(saved["data"])
        base = {"source": load["spec"], "text_column": load.get("text_column", "text"),
                "split": load.get("split", "train"), "streaming": load.get("streaming", False),
                "doc_sep": load.get("doc_sep")}
        if saved["data"].get("tokenizer", "bytes") != "bytes" or saved["data"].get("tokenizer_sha256"):
            # a tokenizer file (the byte tokenizer has no digest), whatever its folder's name
            base["tokenizer"] = str(run_folder(out) / TOKENIZER_COPY)
        data = {**DATA_DEFAULTS, **base, **given}
        tok = run_tokenizer(out, saved) if "tokenizer" not in given else load_tokenizer(data["tokenizer"])
    else:
        data = {**DATA_DEFAULTS, **given}
        tok = load_tokenizer(data["tokenizer"])
    notes: list[str] = []
    model_cfg = fit_vocab(model_cfg, tok, explicit=saved is not None or "vocab_size" in fields, log=notes.append)
    # what training refuses before it reads the data, refused here, so --print-config prints no
    # configuration that --config then refuses
    check_seq_len(tc.seq_len or model_cfg.max_seq_len, model_cfg)
    if tc.depth_sample is not None:
        check_depth_sample(build_model(model_cfg, device="meta"), parse_depth_range(tc.depth_sample), tc.extend_loops)
    if data["doc_sep"] is not None:
        separator_id(tok, data["doc_sep"])
    return TrainRun(model=model_cfg, train=tc, data=data, tokenizer=tok, out=out, resume=resume, preset=preset,
                   notes=notes)


def train_run(spec: TrainRun, progress: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Load the data (rank 0 first: it builds the token store), say ``spec.notes`` and
    train ``spec``; returns the run summary (``phaseloop.lm.train.train``)."""
    with dist.main_first():
        corpus = load_corpus(tokenizer=spec.tokenizer, progress=progress and dist.world().main,
                             **spec.corpus_args())
    for note in spec.notes if log is not None else ():
        log(note)
    return train(spec.model, spec.train, corpus, spec.out, resume=spec.resume, progress=progress, log=log)
