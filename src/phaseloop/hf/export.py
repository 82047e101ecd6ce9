"""A run as a ``transformers`` model: in memory (``from_run``) or as a
``save_pretrained`` folder (``export_run``, ``phaseloop export``).

The folder holds config.json (the whole ``ModelConfig`` under ``phaseloop``, and an
``auto_map`` for ``trust_remote_code=True``), model.safetensors (one copy of every
weight: a weight-shared block is one module; a tied head is declared tied and stored
once), generation_config.json, the run's tokenizer (tokenizer.json and
tokenizer_config.json, the byte tokenizer included), the two small remote-code files
(they import phaseloop, which must be installed) and a model card. It is written into a
temporary folder beside ``out`` (``.NAME.tmp-PID-*``) and renamed, so ``out`` is never
half-written; one an export killed midway left is removed by the next export to ``out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from phaseloop import registry
from phaseloop.depth import set_model_depth
from phaseloop.engine.checkpoint import checkpoint_weights, load_run, run_folder, run_tokenizer
from phaseloop.errors import CheckpointError, PhaseloopError
from phaseloop.files import (
    check_out_dir,
    digests_fault,
    dumps,
    file_digests,
    pid_alive,
    read_json,
    read_object,
    read_unchanged,
    writing,
)
from phaseloop.files import sha256_file as file_sha256
from phaseloop.hf.modeling import PhaseloopForCausalLM
from phaseloop.hf.tokenizer import hf_tokenizer
from phaseloop.quant.load import load_dequantized, load_packed

REMOTE_CODE = {
    "configuration_phaseloop.py": "PhaseloopConfig",
    "modeling_phaseloop.py": "PhaseloopForCausalLM",
}
AUTO_MAP = {"AutoConfig": "configuration_phaseloop.PhaseloopConfig",
            "AutoModelForCausalLM": "modeling_phaseloop.PhaseloopForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _quantized_weights(model, path: Path, run, run_cfg: dict) -> dict:
    """Load a ``phaseloop quantize`` output into ``model`` (dequantised: the function the
    quantised model computes; checked against the run) and return what to record about it."""
    meta = load_dequantized(model, path, run, run_cfg)
    # how it was quantised, from the header its digest covers (not the report beside it, which
    # nothing checks; a file written before the header held it records none)
    recipe = {k: meta[k] if k == "method" else int(meta[k]) for k in ("bits", "group_size", "method") if k in meta}
    return {"file": path.name, "sha256": file_sha256(path), **recipe}


def from_run(run: str | Path, device: str | torch.device = "cpu", dtype: str = "float32",
             quantized: str | Path | None = None, depth: int | None = None,
             extend_loops: str | None = None, packed: bool = True):
    """(PhaseloopForCausalLM, PreTrainedTokenizerFast, run config, phaseloop tokenizer)
    for a run folder or its checkpoint folder; the model in eval mode, its trunk at
    ``depth`` (None: the trained depth; the config carries it). ``quantized``: a
    ``phaseloop quantize`` file, run packed on the CPU kernels (``quant.load_packed``), or
    with ``packed=False`` loaded as its dequantised weights (what an export saves)."""
    if dtype not in DTYPES:
        raise PhaseloopError(f"--dtype {dtype}: choose {' or '.join(DTYPES)}")
    quant = None
    if quantized and packed:
        if dtype != "float32":
            raise PhaseloopError(f"--dtype {dtype}: packed --quantized weights run with their own dtypes "
                                 "(int8/int4 codes, bf16 scales, fp32 elsewhere); drop --dtype")
        model, run_cfg, info = load_packed(run, quantized, device)
        quant = {"file": Path(quantized).name, "sha256": file_sha256(quantized), "packed": info["kernels"]}
    else:
        model, run_cfg = load_run(run, "cpu")
        if quantized:
            quant = _quantized_weights(model, Path(quantized), run, run_cfg)
    if depth is None:
        set_model_depth(model, None, extend_loops)  # refuses --extend-loops alone, before anything is written
    hf = PhaseloopForCausalLM.from_decoder(model.to(device=device, dtype=DTYPES[dtype]))
    if depth is not None:
        hf.config.phaseloop_depth, hf.config.phaseloop_extend_loops = depth, extend_loops
        hf.apply_depth()
    if quant:
        hf.config.phaseloop_quantization = quant
    tok = run_tokenizer(run, run_cfg)
    return hf, hf_tokenizer(tok), run_cfg, tok


def _card(hf, run: Path, run_cfg: dict, summary: dict) -> str:
    cfg = hf.model.cfg
    metrics = {k: summary[k] for k in ("val_loss", "val_bpb", "step") if k in summary}
    init = run_cfg.get("init")
    started = (f" Its weights started from step {init.get('step')} of the run `{Path(str(init.get('from'))).name}` "
               f"(model.safetensors sha256 {str(init.get('model_sha256'))[:12]}...)." if isinstance(init, dict) else "")
    return f"""---
library_name: transformers
tags: [phaseloop, {cfg.arch}]
---
# {run.name}

A phaseloop model (arch `{cfg.arch}`, {sum(p.numel() for p in hf.model.parameters()):,} parameters), exported from
the run folder `{run.name}` with `phaseloop export`. Final metrics of the run: {json.dumps(metrics)}.{started}

```python
import phaseloop  # registers model_type "phaseloop" (or pass trust_remote_code=True)
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("PATH")
tok = AutoTokenizer.from_pretrained("PATH")
ids = tok("To be, or not", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0]))
```

Needs `pip install 'phaseloop[hf]'`. Training configuration: see `phaseloop.json`.
"""


@contextlib.contextmanager
def no_progress_bar():
    """transformers' "Writing model shards" bar off: the command's stderr is its notes and,
    on failure, its one line."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _tmp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-"


def remove_export_orphans(out: Path) -> list[Path]:
    """Remove the temporary folders an export to ``out`` killed midway left beside it
    (``.NAME.tmp-PID-*``, a model's size each), unless their process still runs."""
    out, gone = Path(out), []
    if not out.parent.is_dir():
        return gone
    for p in out.parent.glob(_tmp_prefix(out) + "*"):
        pid = p.name[len(_tmp_prefix(out)):].split("-", 1)[0]
        if p.is_dir() and not p.is_symlink() and not (pid.isdigit() and pid_alive(int(pid))):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def new_folder(out: Path) -> Path:
    """Refuse (one line) an ``--out`` that is a file, lies under one, cannot be written or
    is a folder holding files; nothing is written."""
    if not os.fspath(out):
        raise PhaseloopError("--out '': name a new folder for the export (nothing was written)")
    out = Path(out)
    check_out_dir(out)
    if out.is_dir() and any(out.iterdir()):
        raise PhaseloopError(f"--out {out} is not empty; choose a new folder (nothing was written)")
    return out


@contextlib.contextmanager
def atomic_folder(out: Path):
    """A temporary folder beside ``out`` (``.NAME.tmp-PID-*``) to write into; renamed to
    ``out`` (absent or empty) when the block ends without an error, removed otherwise, so
    ``out`` is never half-written, nor a parent folder it made left behind. Files get the
    documented modes (0644, folders 0755)."""
    out = Path(out)
    made = [p for p in out.parents if not p.exists()]  # deepest first
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_export_orphans(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{_tmp_prefix(out)}{os.getpid()}-"))
    done = False
    try:
        yield tmp
        for p in tmp.rglob("*"):  # not mkdtemp's 0700 or a writer's 0600
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        if out.is_dir():
            out.rmdir()  # empty (new_folder checked)
        os.replace(tmp, out)
        done = True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        for p in made if not done else ():  # as GGUF and .pte exports leave none
            with contextlib.suppress(OSError):
                p.rmdir()


DIGESTED = ("model.safetensors", "config.json", "tokenizer.json")  # an export's files phaseloop.json digests


def verify_export(folder: Path) -> None:
    """Refuse an export folder whose phaseloop.json is damaged or whose files differ from the
    digests it records. A folder without one (``save_pretrained`` of a phaseloop model) or
    written before digests were recorded has none to check."""
    record = folder / "phaseloop.json"
    if not record.is_file():
        return
    fix = "export the run again (phaseloop export)"
    files = read_object(record, "phaseloop export's record", fix).get("files")
    if files is None:
        return
    names = [n for n in DIGESTED if n in files] if isinstance(files, dict) else DIGESTED  # else refused below
    why = digests_fault(folder, files, names, "phaseloop.json")
    if why is not None:
        raise CheckpointError(f"{folder} has changed since `phaseloop export` wrote it (damaged, or saved "
                              f"again): {why}; {fix}")


def export_run(run: str | Path, out: str | Path, dtype: str = "float32",
               quantized: str | Path | None = None, depth: int | None = None,
               extend_loops: str | None = None) -> Path:
    """Write the run as a Hugging Face folder at ``out`` (absent or empty); returns it."""
    out = new_folder(out)
    run, run_dir = Path(run), run_folder(run)
    with read_unchanged(checkpoint_weights(run), run_dir) as digest:
        hf, fast, run_cfg, _ = from_run(run, "cpu", dtype, quantized, depth, extend_loops, packed=False)  # or refused
    sha = digest["sha256"]
    summary = read_json(run_dir / "summary.json") if (run_dir / "summary.json").is_file() else {}
    with atomic_folder(out) as tmp:
        hf.config.auto_map = dict(AUTO_MAP)
        plugin = registry.provider(hf.config.phaseloop["arch"])
        if plugin:  # loading without it then says what to install
            hf.config.phaseloop_arch_plugin = plugin
        with writing(out / "model.safetensors"), no_progress_bar():  # a full disk: an OSError
            hf.save_pretrained(tmp)
        fast.save_pretrained(tmp)
        for name, cls in REMOTE_CODE.items():
            module = "configuration" if cls == "PhaseloopConfig" else "modeling"
            (tmp / name).write_text(f'"""phaseloop\'s {cls} for trust_remote_code=True (needs '
                                    f'`pip install phaseloop`)."""\n\nfrom phaseloop.hf.{module} '
                                    f'import {cls}  # noqa: F401\n')
        digested = file_digests(tmp, [n for n in DIGESTED if (tmp / n).is_file()])
        (tmp / "phaseloop.json").write_text(dumps({
            "run": str(run_dir.resolve()), "checkpoint_sha256": sha, "files": digested,
            "quantization": getattr(hf.config, "phaseloop_quantization", None), "dtype": dtype,
            "train": run_cfg.get("train"), "data": run_cfg.get("data"), "summary": summary,
            **({"init": run_cfg["init"]} if "init" in run_cfg else {})}, indent=2))  # --init-from's source
        (tmp / "README.md").write_text(_card(hf, run_dir, run_cfg, summary))
    return out
