"""``phaseloop quantize``, ``export`` and ``lm-eval``: a trained run made smaller, handed
to Hugging Face, llama.cpp or an on-device runtime, evaluated by lm-evaluation-harness.
``phaseloop.hf`` (its transformers and GGUF writers) and ``phaseloop.deploy.run`` are
imported when a command runs: transformers / lm-eval, gguf and executorch / torchao are
optional extras. ``FORMATS``: ``--format`` -> its exporter (a new format is one entry)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from phaseloop import deploy
from phaseloop.analysis.params import format_count
from phaseloop.cli import argtypes
from phaseloop.cli.options import depth_options, on_a_run, windows_of
from phaseloop.config import ModelConfig
from phaseloop.engine.checkpoint import read_run_config, run_folder
from phaseloop.errors import ConfigError, PhaseloopError
from phaseloop.hf.llama_map import refusal as not_a_llama
from phaseloop.quant import quantize_run


def add_parsers(sub) -> None:
    """``phaseloop quantize``, ``export``, ``lm-eval``."""
    quant = on_a_run(sub, "quantize", "weight-only INT8/INT4 quantisation of a run, with validation "
                     "loss/BPB before and after", cmd_quantize, windows=64, seq_len=False)
    quant.add_argument("--bits", type=int, choices=(8, 4), required=True)
    quant.add_argument("--group-size", type=argtypes.int_in(-1), default=128, help="input columns per scale "
                       "(-1: one per row; a layer it does not divide falls back to per row)")
    quant.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                       help="rtn: round to nearest; gptq: Frantar et al. 2022, Hessians of shared "
                       "layers pooled over all loop passes")
    quant.add_argument("--calib-batches", type=argtypes.positive_int, default=8, help="GPTQ calibration batches")
    quant.add_argument("--calib-batch-size", type=argtypes.positive_int, default=8)
    quant.add_argument("--seed", type=argtypes.seed_int, default=0, help="seed of the calibration windows")
    quant.add_argument("--head", action="store_true", help="quantise the output head too (an untied head; "
                       "the embedding stays fp32): the head is a decode step's largest single read")
    quant.add_argument("--out", help="folder for the weights and report (default: the run folder)")

    export = on_a_run(sub, "export", "a run as a Hugging Face folder (AutoModelForCausalLM.from_pretrained), "
                      "a native Llama folder, a GGUF file for llama.cpp or an ExecuTorch program (docs/deploy.md)",
                      cmd_export, data=False, device=False)
    export.add_argument("--format", choices=tuple(FORMATS), default="hf",
                        help="; ".join(f"{name}: {f.what}" for name, f in FORMATS.items()))
    export.add_argument("--out", required=True, help="hf, llama: a new (or empty) folder; gguf: a new FILE.gguf; "
                        "executorch: a new FILE.pte")
    export.add_argument("--dtype", choices=("float32", "bfloat16"), help="hf, llama: the weights' dtype "
                        "(default float32)")
    export.add_argument("--quantized", metavar="FILE", help="hf, llama, gguf: a quant-*.safetensors of `phaseloop "
                        "quantize`: export its dequantised weights (the function the quantised model computes)")
    export.add_argument("--outtype", choices=("f32", "f16", "q8_0"), help="gguf: the matrices' type (default f32)")
    export.add_argument("--bits", type=int, choices=(8, 4), help="executorch: int8 weights per channel or int4 "
                        "in groups of 32, int8 activations (every Linear but the head; default fp32)")
    export.add_argument("--head", action="store_true", default=None, help="executorch with --bits: quantise "
                        "the output head too (an untied head; the embedding stays fp32)")
    export.add_argument("--max-seq-len", type=argtypes.positive_int, help="executorch: positions the static "
                        "KV cache holds (default: the model's max_seq_len)")
    depth_options(export)

    lm_eval = on_a_run(sub, "lm-eval", "lm-evaluation-harness on a run (local: lambada_local, "
                       "wikitext2_local)", cmd_lm_eval, data=False)
    lm_eval.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    lm_eval.add_argument("--include-path", help="a folder of extra lm-eval task YAMLs")
    lm_eval.add_argument("--limit", type=argtypes.positive_float, help="examples per task (a fraction if < 1)")
    lm_eval.add_argument("--batch-size", type=int, default=8)  # harness.lm_eval_run checks it
    depth_options(lm_eval)
    lm_eval.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    lm_eval.add_argument("--data-dir", help="folder holding lambada/ and wikitext-2/ (default $PHASELOOP_DATA_DIR)")


def cmd_quantize(args) -> int:
    """Hyperloop §4: weight-only INT8/INT4 quantisation of a run (``quant.quantize_run``)."""
    r = quantize_run(args.run, args.bits, args.group_size, args.method, calib_batches=args.calib_batches,
                     calib_batch_size=args.calib_batch_size, seed=args.seed, windows=windows_of(args),
                     data=args.data, out=args.out, device=args.device, head=args.head)
    b, a = r["before"], r["after"]
    print(f"{r['arch']} {r['stem']}: val loss {b['val_loss']:.4f} -> {a['val_loss']:.4f}, "
          f"bpb {b['val_bpb']:.4f} -> {a['val_bpb']:.4f}, params {format_count(r['bytes_before'])}B -> "
          f"{format_count(r['bytes_after'])}B ({r['n_quantized']} Linears) -> {r['weights']}")
    return 0


def _export_hf(args) -> str:
    """A run as a Hugging Face folder (``hf.export_run``)."""
    from phaseloop import hf

    hf.require()
    out = hf.export_run(args.run, args.out, dtype=args.dtype or "float32", quantized=args.quantized,
                        depth=args.depth, extend_loops=args.extend_loops)
    return (f"exported {args.run} -> {out} (AutoModelForCausalLM.from_pretrained({str(out)!r}) "
            "after `import phaseloop`, or with trust_remote_code=True)")


def _export_executorch(args) -> str:
    """A run as an ExecuTorch program (``deploy.run.export_run``)."""
    deploy.require()
    from phaseloop.deploy.run import export_run

    r = export_run(args.run, args.out, depth=args.depth, extend_loops=args.extend_loops, bits=args.bits,
                   max_len=args.max_seq_len, head=bool(args.head))
    weights = f"int{r['bits']} ({len(r['quantized_layers'])} Linears{', the head too' * r['head']})" \
        if r["bits"] else "fp32"
    return (f"exported {args.run} -> {r['out']} ({r['bytes'] / 1e6:.2f} MB, {weights}, XNNPACK, "
            f"{r['metadata']['get_max_seq_len']} positions; tokenizer {r['tokenizer']}; {r['export_s']:.0f} s)")


def _static_cache_refuses(cfg) -> str | None:
    if getattr(cfg, "hc_transition", "hc") == "pooled_mlp":
        return ("hc_transition='pooled_mlp' keeps running sums per loop in its cache, which a static "
                "cache has no buffer for")
    return None


def _at_its_depth(args, fmt: str) -> None:
    if args.depth is not None or args.extend_loops:
        raise PhaseloopError(f"--depth and --extend-loops apply to weight-tied trunks; --format {fmt} takes a "
                             "rope run, a stack of distinct layers with no depth to change: drop them")


def _export_llama(args) -> str:
    """A Llama run as a native ``LlamaForCausalLM`` folder (``hf.llama.export_llama``)."""
    from phaseloop import hf

    hf.require()
    _at_its_depth(args, "llama")
    from phaseloop.hf.llama import export_llama

    out = export_llama(args.run, args.out, dtype=args.dtype or "float32", quantized=args.quantized)
    return f"exported {args.run} -> {out} (LlamaForCausalLM.from_pretrained({str(out)!r}), no phaseloop needed)"


def _export_gguf(args) -> str:
    """A Llama run as one GGUF file for llama.cpp (``hf.gguf.export_gguf``)."""
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError("--format gguf needs the gguf library, which is not installed: pip install 'phaseloop[gguf]'")
    _at_its_depth(args, "gguf")
    from phaseloop.hf.gguf import export_gguf

    out = export_gguf(args.run, args.out, outtype=args.outtype or "f32", quantized=args.quantized)
    return f"exported {args.run} -> {out} (llama.cpp: llama-cli -m {out})"


@dataclass(frozen=True)
class ExportFormat:
    """One ``--format``: ``export(args) -> the line to print``; ``refuses(model config)``:
    why it cannot take a run of that model, or None; ``options``: the flags only it takes."""

    what: str
    export: Callable
    refuses: Callable = lambda cfg: None
    options: tuple = ()


FORMATS = {
    "hf": ExportFormat("a transformers folder, every architecture", _export_hf, options=("dtype", "quantized")),
    "llama": ExportFormat("a native LlamaForCausalLM folder, no remote code (a rope run with the Llama block)",
                          _export_llama, not_a_llama, ("dtype", "quantized")),
    "gguf": ExportFormat("one GGUF file for llama.cpp, --outtype f32|f16|q8_0 (a rope run with the Llama block)",
                         _export_gguf, not_a_llama, ("outtype", "quantized")),
    "executorch": ExportFormat("an ExecuTorch .pte (XNNPACK) for its LLM runner", _export_executorch,
                               _static_cache_refuses, ("bits", "head", "max_seq_len")),
}


def cmd_export(args) -> int:
    """A run in the ``--format`` asked for; what a format cannot take is refused in one line
    naming the formats that take this run."""
    fmt = FORMATS[args.format]
    for opt in dict.fromkeys(o for f in FORMATS.values() for o in f.options):
        if getattr(args, opt) is not None and opt not in fmt.options:
            takes = " / ".join(n for n, f in FORMATS.items() if opt in f.options)
            raise PhaseloopError(f"--{opt.replace('_', '-')} applies to --format {takes}, not {args.format}")
    if Path(args.run).exists():  # else loading the run says what is missing
        cfg = ModelConfig.from_dict(read_run_config(run_folder(args.run))["model"])
        why = fmt.refuses(cfg)
        if why:
            takes = [n for n, f in FORMATS.items() if f.refuses(cfg) is None]
            raise PhaseloopError(f"--format {args.format} cannot take this {cfg.arch} run: {why}; "
                                 f"it exports as: {', '.join(takes) or 'none'}")
    print(fmt.export(args))
    return 0


def cmd_lm_eval(args) -> int:
    """lm-evaluation-harness on a run (``hf.harness.lm_eval_run``)."""
    from phaseloop import hf

    hf.require("transformers", "lm_eval")
    from phaseloop.hf.harness import lm_eval_run

    tasks = [t.strip() for t in args.tasks.split(",")]
    res = lm_eval_run(args.run, tasks, include_path=args.include_path, limit=args.limit,
                      batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                      data=args.data_dir, depth=args.depth, extend_loops=args.extend_loops)
    from lm_eval.utils import make_table

    print(make_table(res))
    print(f"results: {run_folder(args.run) / 'lm_eval' / 'results.json'} (table: results.md)")
    return 0
