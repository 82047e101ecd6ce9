"""Quantise a trained run (Hyperloop §4): load its weights, quantise every Linear but the
embedding and head (``head=True``: the head too, as llama.cpp's types do), measure
validation loss / BPB before and after on the run's own data, write the packed weights
and a JSON report. ``phaseloop quantize`` and the benchmarks call ``quantize_run``."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from phaseloop.data.corpus import TrainBatches
from phaseloop.engine import resolve_device
from phaseloop.engine.checkpoint import load_run, run_corpus, run_folder
from phaseloop.engine.optim import check_forward_memory
from phaseloop.errors import PhaseloopError
from phaseloop.files import check_out_dir, write_json
from phaseloop.lm.train import eval_set, evaluate
from phaseloop.quant.apply import quantize_model
from phaseloop.quant.io import save_quantized
from phaseloop.quant.load import provenance
from phaseloop.quant.targets import default_skip


def quantize_run(run: str | Path, bits: int, group_size: int = 128, method: str = "rtn", *,
                 calib_batches: int = 8, calib_batch_size: int = 8, seed: int = 0,
                 windows: int = 64, data: str | None = None, out: str | Path | None = None,
                 device: str = "auto", head: bool = False) -> dict:
    """Quantise ``run`` (a run folder or its checkpoint folder) and return the report,
    also written as ``<out>/quant-w<bits>-g<group>-<method>.json`` next to the weights
    (``out`` defaults to the run folder). ``group_size`` -1 means one group per row;
    GPTQ calibrates on ``calib_batches`` windows of the run's training split. ``head``: the
    output head is quantised too (its own file, ``...-head``); a head tied to the embedding
    is refused (quantising it would quantise the embedding)."""
    if group_size < 1 and group_size != -1:
        raise PhaseloopError(f"--group-size {group_size}: use a positive size or -1 (per row)")
    if windows < 1 or calib_batches < 1 or calib_batch_size < 1:
        raise PhaseloopError("--windows, --calib-batches and --calib-batch-size must be >= 1")
    if out:
        check_out_dir(Path(out))
    dev = resolve_device(device)
    model, run_cfg = load_run(run, dev)
    if head and model.cfg.tie_embeddings:
        raise PhaseloopError(f"--head: {run_folder(run)}'s head is tied to its embedding, so quantising it would "
                             "quantise the embedding too; quantise without --head")
    run_dir = run_folder(run)
    corpus = run_corpus(run, run_cfg, data)
    seq_len = run_cfg["train"].get("seq_len") or model.cfg.max_seq_len
    train_tok, val_tok = corpus.split(run_cfg["train"].get("val_fraction", 0.1), seq_len + 1)
    val, docs = eval_set(corpus, val_tok, seq_len, windows, run_cfg["train"])
    ignore = run_cfg["train"].get("loss_ignore_id")
    before = evaluate(model, val, corpus.tokenizer, 16, dev, ignore, docs)
    calib = None
    if method == "gptq":  # calibration windows from the run's training split, if they fit
        check_forward_memory(model.cfg, calib_batch_size, seq_len, dev, "--calib-batch-size",
                             held_tokens=calib_batches * calib_batch_size * seq_len)
        batches = TrainBatches(train_tok, seq_len, calib_batch_size, seed)
        calib = [batches.next()[0] for _ in range(calib_batches)]
    skip = (lambda name, module: "embed" in name.lower()) if head else default_skip
    report = quantize_model(model, bits, None if group_size == -1 else group_size, method, calib, skip)
    after = evaluate(model, val, corpus.tokenizer, 16, dev, ignore, docs)

    out_dir = Path(out) if out else run_dir
    made = [] if out_dir.is_dir() else [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"quant-w{bits}-g{group_size}-{method}" + ("-head" if head else "")
    weights = out_dir / f"{stem}.safetensors"
    tmp = out_dir / f".{stem}.safetensors.tmp"
    report.update({"run": str(run_dir), "arch": model.cfg.arch, "weights": str(weights), "stem": stem,
                   "before": before, "after": after, "data": corpus.name,
                   "fingerprint": corpus.fingerprint, "head": head, "windows": len(val), "seq_len": seq_len,
                   "calib": None if calib is None else {"batches": len(calib),
                                                        "batch_size": calib_batch_size, "seed": seed}})
    # how it was quantised, in the header its digest covers (an export records it from there)
    recipe = {"bits": bits, "group_size": group_size, "method": method, "head": head}
    report_tmp = out_dir / f".{stem}.json.tmp"
    try:  # both under temporary names, then renamed in: the weights, at once their report
        save_quantized(model, tmp, {**provenance(run, run_cfg), **recipe}, target=weights)
        tmp.chmod(0o644)  # safetensors writes 0600; as the JSON beside it
        try:
            write_json(report_tmp, report)
        except OSError as e:  # a full disk: named as the report it was for
            raise OSError(e.errno, e.strerror, str(out_dir / f"{stem}.json")) from None
        (out_dir / f"{stem}.json").unlink(missing_ok=True)  # an older report never lies beside the new weights
        os.replace(tmp, weights)
        os.replace(report_tmp, out_dir / f"{stem}.json")
    except BaseException:  # a full disk, an interrupt: nothing half-written, no folder left that we made
        tmp.unlink(missing_ok=True)
        report_tmp.unlink(missing_ok=True)
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    return report
