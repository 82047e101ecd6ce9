"""What ``phaseloop serve`` serves, loaded once at start: a run folder (``phaseloop train``)
or an exported Hugging Face folder (``phaseloop export``), and its text codec: encode,
decode, the end-of-text id, and the chat template that renders a conversation into a
prompt. ``--quantized FILE`` on a run builds it packed (``quant.load_packed``: int8/int4
codes on torch's CPU kernels, as ``phaseloop eval/generate --quantized``; the file is
refused in one line when it is damaged or of another run); on an export, whose folder
records no run to check the file against, it loads the file's dequantised weights."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from phaseloop.data.tokenizer import HFTokenizer
from phaseloop.engine import resolve_device
from phaseloop.engine.checkpoint import load_run, run_tokenizer
from phaseloop.errors import CheckpointError, ConfigError, PhaseloopError, first_line, state_dict_error
from phaseloop.files import read_json, sha256_file, why_missing
from phaseloop.inference import decode_layout
from phaseloop.model import build_model
from phaseloop.quant import load_packed, weight_bytes
from phaseloop.quant.io import load_quantized_state_dict
from phaseloop.quant.load import read_quantized
from phaseloop.serve.options import Settings
from phaseloop.serve.responses import Vocab

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Served:
    model: torch.nn.Module  # the DecoderLM, in eval mode, on its device
    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int | None = None
    render: Callable[[list[dict]], str] | None = None  # messages -> prompt text (the chat template)
    twin: torch.nn.Module | None = None  # the model on the meta device: per-request options are checked on it
    defaults: Settings = Settings()
    info: dict = field(default_factory=dict)  # shown in /v1/models: no paths
    path: Path | None = None
    vocab: Vocab | None = None  # decode with each token's bytes (the answers' logprobs); None: from decode

    def __post_init__(self):
        if self.vocab is None:
            self.vocab = Vocab(self.decode, lambda t: self.decode([t]).encode("utf-8"), False)


def is_export(path: Path) -> bool:
    """A ``save_pretrained`` folder of phaseloop's (config.json with model_type phaseloop);
    False for a run folder. A config.json that does not parse is refused as damaged (not
    taken for an absent one), and a folder of another model type (``export --format
    llama``) is refused naming what serves it."""
    config = path / "config.json"
    if not config.is_file():
        return False
    cfg = read_json(config, "restore it, or train or export the run again")
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    if kind == "phaseloop":
        return True
    if isinstance(kind, str):
        made = " (phaseloop export --format llama)" if kind == "llama" else ""
        raise ConfigError(f"{path} is a {kind!r} model folder{made}, which transformers, vLLM or llama.cpp "
                          "serve; phaseloop serve takes a run folder or an export of --format hf")
    return False


def _packed(path: Path, quantized: str, device: str, dtype: str):
    """(model, run config, info) of a run built packed from its quantised file."""
    if dtype != "float32":
        raise ConfigError(f"--quantized runs packed int8/int4 weights with float32 activations; drop --dtype {dtype}")
    model, run_cfg, q = load_packed(path, quantized, "cpu" if device == "auto" else resolve_device(device))
    for note in q["notes"]:
        print(f"note: {note}", file=sys.stderr)
    kernels = dict(Counter(q["kernels"].values()))
    return model, run_cfg, {"file": Path(quantized).name, "sha256": sha256_file(Path(quantized)), "packed": True,
                            "kernels": kernels}


def _quantized(model, path: Path, export: Path) -> dict:
    """The dequantised weights of a ``phaseloop quantize`` file, loaded into an exported
    ``model`` (``quant.io.load_quantized_state_dict``: the function the quantised model computes);
    the file must be of this model and of the checkpoint the export records (phaseloop.json)."""
    record = export / "phaseloop.json"
    rec = read_json(record) if record.is_file() else {}
    sha = rec.get("checkpoint_sha256") if isinstance(rec, dict) else None
    tensors, _ = read_quantized(path, None, {"model": model.cfg.to_dict()}, sha if isinstance(sha, str) else None)
    try:
        load_quantized_state_dict(tensors, model)
    except (RuntimeError, CheckpointError) as e:
        raise CheckpointError(f"--quantized {path} does not fit this model ({state_dict_error(e)}); "
                              "pass the file quantised from it") from None
    return {"file": path.name, "sha256": sha256_file(path), "packed": False}


def _bad_tokenizer_file(folder: Path) -> Path:
    """The tokenizer file of an export that does not parse as JSON (tokenizer.json when all do)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
        try:
            if (folder / name).is_file():
                json.loads((folder / name).read_bytes())
        except ValueError:
            return folder / name
    return folder / "tokenizer.json"


def _hf_tokenizer(run_tok=None, folder: Path | None = None):
    from phaseloop import hf

    hf.require("transformers")
    if folder is not None:
        from transformers import AutoTokenizer

        if not (folder / "tokenizer.json").is_file():
            raise CheckpointError(f"{folder} is an export without its tokenizer.json; export the run again "
                                  "(phaseloop export)")
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:  # a damaged tokenizer file fails in many ways inside transformers
            raise CheckpointError(f"{_bad_tokenizer_file(folder)} cannot be loaded ({first_line(e)}); the file is "
                                  "damaged: export the run again (phaseloop export)") from None
    from phaseloop.hf.tokenizer import hf_tokenizer

    return hf_tokenizer(run_tok)


def _compile(template: str, what: str) -> None:
    """Compile a chat template at start, as transformers compiles it for each request: a
    syntax error is refused in one line here, not answered with a 400 per request."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(template)
    except ImportError as e:  # transformers wants a newer jinja2 for templates
        raise PhaseloopError(f"{what}: chat templates need jinja2 ({first_line(e)}); pip install "
                             "'jinja2>=3.1.6'") from None
    except Exception as e:  # jinja2's TemplateSyntaxError and the like
        raise PhaseloopError(f"{what} does not compile ({first_line(e)}); fix the Jinja template") from None


def _from_export(path: Path):
    from phaseloop import hf

    hf.require("transformers")
    from safetensors import SafetensorError

    from phaseloop.hf.export import no_progress_bar, verify_export
    from phaseloop.hf.modeling import PhaseloopForCausalLM

    verify_export(path)  # the files against phaseloop.json's digests
    try:
        with no_progress_bar():  # stderr is notes and, on failure, one line
            wrapped = PhaseloopForCausalLM.from_pretrained(str(path))
    except SafetensorError as e:  # a folder without phaseloop.json (save_pretrained's) has no digests to check
        raise CheckpointError(f"{path / 'model.safetensors'} is damaged ({first_line(e, 100)}); export the run "
                              "again (phaseloop export)") from None
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: the exported model cannot be loaded ({str(e).splitlines()[0][:120]}); "
                              "export the run again (phaseloop export)") from None
    depth = getattr(wrapped.config, "phaseloop_depth", None)
    if depth is not None:  # the model rests at its trained depth, as ``applied`` leaves it; the export's is a default
        wrapped.model.trunk.reset_depth()
    return wrapped.model, Settings(depth=depth, extend_loops=getattr(wrapped.config, "phaseloop_extend_loops", None)
                                   if depth is not None else None)


def load(path: str | Path, *, device: str = "auto", dtype: str = "float32", quantized: str | None = None,
         name: str | None = None, chat_template: str | None = None, defaults: Settings | None = None,
         prepack: bool = True) -> Served:
    """Load ``path`` (a run folder, its checkpoint folder or an export) to serve it, its fp32
    CPU Linears laid out by ``inference.decode_layout`` (``prepack``: on oneDNN)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} {why_missing(path)}; pass a run folder (phaseloop train) or an "
                              "exported folder (phaseloop export)")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose {' or '.join(DTYPES)}")
    template = None
    if chat_template is not None:
        tpath = Path(chat_template)
        if tpath.is_dir():
            raise PhaseloopError(f"--chat-template {tpath} is a folder; pass a Jinja chat template file")
        if not tpath.is_file():
            raise PhaseloopError(f"--chat-template {tpath} {why_missing(tpath)}; pass a Jinja chat template file")
        try:
            template = tpath.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise PhaseloopError(f"--chat-template {tpath} is not UTF-8 text; pass a Jinja chat template") from None
    info: dict = {"source": path.name, "created": int(time.time())}
    if is_export(path):
        model, exported = _from_export(path)
        # the command line's defaults over the export's own, field by field (its depth stays under --exit)
        given = {k: v for k, v in vars(defaults or Settings()).items() if v is not None}
        defaults = replace(exported, **given)
        fast = _hf_tokenizer(folder=path)
        def encode(text: str) -> list[int]:
            return fast(text, add_special_tokens=False)["input_ids"]

        decode = fast.decode
        eos_id = fast.eos_token_id
        own = HFTokenizer(path / "tokenizer.json")  # each token's bytes (the fast tokenizer's file)
        vocab = Vocab(decode, own.token_bytes, own.byte_level)
        info["kind"] = "export"
    else:
        if quantized:
            model, run_cfg, info["quantized"] = _packed(path, quantized, device, dtype)
        else:
            model, run_cfg = load_run(path)
        tok = run_tokenizer(path, run_cfg)
        def encode(text: str) -> list[int]:
            return tok.encode(text).tolist()

        decode, eos_id, fast = tok.decode, None, None
        vocab = Vocab(decode, tok.token_bytes, tok.byte_level)
        info["kind"] = "run"
    if quantized and "quantized" not in info:
        info["quantized"] = _quantized(model, Path(quantized), path)
    render = None
    if template is not None or (fast is not None and getattr(fast, "chat_template", None)):
        fast = fast or _hf_tokenizer(run_tok=tok)
        if template is not None:
            fast.chat_template = template
        _compile(fast.chat_template, f"--chat-template {chat_template}" if template is not None
                 else f"{path}'s chat template (tokenizer_config.json)")

        def render(messages: list[dict]) -> str:
            return fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    if info.get("quantized", {}).get("packed"):  # its codes and scales stay as packed
        model = model.eval()
    else:
        model = model.to(device=resolve_device(device), dtype=DTYPES[dtype]).eval()
    decode_layout(model, prepack=prepack)  # fp32 CPU weights laid out for inference (docs/deploy.md)
    try:
        twin = build_model(model.cfg, device="meta").eval()
    except Exception:  # a plugin that cannot be built without weights: no per-request options
        twin = None
    # depth: the passes a request runs unless it asks (UT steps / loop passes, as a request's
    # depth; None: a stack); layers: the trained layer applications (a Looped model's begin,
    # middle x loops and end)
    passes = getattr(model.trunk, "passes", None)
    info.update(arch=model.cfg.arch, depth=passes if defaults is None or defaults.depth is None else defaults.depth,
                layers=getattr(model.trunk, "depth", None), dtype=dtype)
    info["weight_bytes"], info["weight_bytes_fp32"] = weight_bytes(model)
    return Served(model, name or path.resolve().name, encode, decode, eos_id, render, twin,
                  defaults or Settings(), info, path, vocab)
