"""``phaseloop quantize``, ``export`` and ``lm-eval``: a trained run made smaller, handed
to Hugging Face, evaluated by lm-evaluation-harness. ``phaseloop.hf`` is imported when a
command runs: transformers and lm-eval are an optional extra."""

from __future__ import annotations

from phaseloop.analysis.params import format_count
from phaseloop.cli import argtypes
from phaseloop.cli.options import depth_options, on_a_run
from phaseloop.engine.checkpoint import run_folder
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
    quant.add_argument("--out", help="folder for the weights and report (default: the run folder)")

    export = on_a_run(sub, "export", "a run as a Hugging Face folder (AutoModelForCausalLM.from_pretrained)",
                      cmd_export, data=False, device=False)
    export.add_argument("--out", required=True, help="new (or empty) folder to write")
    export.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    export.add_argument("--quantized", metavar="FILE", help="a quant-*.safetensors of `phaseloop quantize`: "
                        "export its dequantised weights (the function the quantised model computes)")
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
                     calib_batch_size=args.calib_batch_size, seed=args.seed, windows=args.windows,
                     data=args.data, out=args.out, device=args.device)
    b, a = r["before"], r["after"]
    print(f"{r['arch']} {r['stem']}: val loss {b['val_loss']:.4f} -> {a['val_loss']:.4f}, "
          f"bpb {b['val_bpb']:.4f} -> {a['val_bpb']:.4f}, params {format_count(r['bytes_before'])}B -> "
          f"{format_count(r['bytes_after'])}B ({r['n_quantized']} Linears) -> {r['weights']}")
    return 0


def cmd_export(args) -> int:
    """A run as a Hugging Face folder (``hf.export_run``)."""
    from phaseloop import hf

    hf.require()
    out = hf.export_run(args.run, args.out, dtype=args.dtype, quantized=args.quantized,
                        depth=args.depth, extend_loops=args.extend_loops)
    print(f"exported {args.run} -> {out} (AutoModelForCausalLM.from_pretrained({str(out)!r}) "
          "after `import phaseloop`, or with trust_remote_code=True)")
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
