"""``phaseloop eval`` and ``phaseloop generate``: a trained run's loss (at other depths,
with early exits) or downstream accuracy (``--tasks``: ``eval_tasks.py``) and its samples."""

from __future__ import annotations

import json
import sys

import torch

from phaseloop.cli import argtypes, eval_tasks
from phaseloop.cli.options import (
    depth_options,
    exit_options,
    inference_options,
    on_a_run,
    png_path,
    run_seq_len,
    windows_of,
)
from phaseloop.cli.sweeps import eval_depths, eval_exits, eval_kv_share
from phaseloop.deploy.compiled import check as check_compiled
from phaseloop.deploy.compiled import generate as generate_compiled
from phaseloop.deploy.generate import generate as generate_program
from phaseloop.deploy.generate import open_pte
from phaseloop.depth import set_model_depth
from phaseloop.engine import dist, resolve_device
from phaseloop.engine.checkpoint import load_run, run_corpus, run_tokenizer
from phaseloop.errors import PhaseloopError
from phaseloop.inference import Options, decode_layout, generate
from phaseloop.lm.train import eval_set, evaluate
from phaseloop.quant import load_packed, weight_bytes


def add_parsers(sub) -> None:
    """``phaseloop eval``, ``phaseloop generate``."""
    ev = on_a_run(sub, "eval", "validation loss / perplexity / bits per byte of a run", cmd_eval,
                  windows=64)
    ev.add_argument("--split", choices=("val", "all"), default="val",
                    help="val: the held-out tail; all: every token (e.g. a separate test file)")
    ev.add_argument("--json", action="store_true")
    quantized_option(ev)
    depth_options(ev, sweep=True)
    exit_options(ev, sweep=True)
    inference_options(ev, sweep=True)
    ev.add_argument("--plot", metavar="PNG", help="with --depth: loss and BPB against depth; with "
                    "--exit: loss against mean depth; as a PNG")
    eval_tasks.add_arguments(ev)

    gen = on_a_run(sub, "generate", "sample text from a run, or from its ExecuTorch export (FILE.pte)",
                   cmd_generate, data=False)
    gen.add_argument("--prompt", default="")
    gen.add_argument("--max-new-tokens", type=argtypes.nonneg_int, default=200)
    gen.add_argument("--temperature", type=argtypes.finite_float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=argtypes.positive_int, default=None)
    gen.add_argument("--seed", type=argtypes.seed_int, default=0)
    gen.add_argument("--no-cache", action="store_true", help="recompute the full prefix every token")
    gen.add_argument("--json", action="store_true", help="text, tokens, tokens/s, passes per token, "
                     "KV cache bytes, weight bytes (and the acceptance rate with --speculative) as JSON")
    gen.add_argument("--compile", action="store_true", help="compile the one-token decode step (inductor, "
                     "frozen prepacked weights; CPU, batch 1, a fixed depth): faster decoding after a compile "
                     "of seconds to a minute (docs/deploy.md)")
    gen.add_argument("--no-prepack", action="store_true", help="run fp32 CPU Linears on F.linear without "
                     "oneDNN's prepacked copy of each weight: less memory, slower products of 2 rows and more "
                     "(docs/deploy.md)")
    quantized_option(gen)
    depth_options(gen)
    exit_options(gen)
    inference_options(gen)


def quantized_option(p) -> None:
    p.add_argument("--quantized", metavar="FILE", help="a quant-*.safetensors of `phaseloop quantize`: run "
                   "its packed int8/int4 weights on torch's CPU kernels (docs/deploy.md)")


def run_device(args) -> torch.device:
    """``--device``, where ``auto`` is the CPU with ``--quantized`` (torch's low-bit kernels are CPU ones)."""
    return resolve_device("cpu" if getattr(args, "quantized", None) and args.device == "auto" else args.device)


def load_model(args, device):
    """The run's model, packed from ``--quantized FILE`` when given (``quant.load_packed``)."""
    if getattr(args, "quantized", None):
        model, run_cfg, info = load_packed(args.run, args.quantized, device)
        for note in info["notes"]:
            dist.say(f"note: {note}")
        return model, run_cfg
    return load_run(args.run, device)


def cmd_eval(args) -> int:
    eval_tasks.check_flags(args)
    if args.tasks is not None:
        return eval_tasks.eval_tasks(args)
    if args.depth is None and (args.extend_loops or (args.plot and not (args.exit or args.kv_share))):
        raise PhaseloopError("--extend-loops and --plot apply with --depth (--plot also with --exit or "
                             "--kv-share); add --depth K[,K...]")
    if (args.exit or args.kv_share) and args.depth is not None and len(args.depth) > 1:
        raise PhaseloopError(f"{'--exit' if args.exit else '--kv-share'} sweeps at one depth; give one "
                             "--depth K (or none: the trained depth)")
    if args.kv_share is not None and args.exit:
        raise PhaseloopError("--kv-share and --exit sweep one at a time; give one of them")
    if args.kv_fill != "recompute" and not args.exit:
        raise PhaseloopError(f"--kv-fill {args.kv_fill} applies with --exit RULE:V")
    device = run_device(args)
    model, run_cfg = load_model(args, device)
    corpus = run_corpus(args.run, run_cfg, args.data)
    seq_len = run_seq_len(args, run_cfg, model.cfg)
    if args.split == "all":
        tokens = corpus.tokens
    else:
        _, tokens = corpus.split(run_cfg["train"].get("val_fraction", 0.1), seq_len + 1)
    windows, docs = eval_set(corpus, tokens, seq_len, windows_of(args), run_cfg["train"])
    if args.plot:  # refuse a plot without matplotlib, or a path it cannot take, before evaluating
        png_path("--plot", args.plot, "depth.png")
    if args.kv_share is not None:
        return eval_kv_share(args, model, run_cfg, corpus, windows, seq_len, device, docs)
    if args.exit:
        return eval_exits(args, model, run_cfg, corpus, windows, seq_len, device, docs)
    if args.depth is not None:
        return eval_depths(args, model, run_cfg, corpus, windows, seq_len, device, docs)
    res = evaluate(model, windows, corpus.tokenizer, 16, device, run_cfg["train"].get("loss_ignore_id"), docs)
    res.update({"data": corpus.name, "fingerprint": corpus.fingerprint, "split": args.split,
                "windows": len(windows), "seq_len": seq_len, "quantized": args.quantized})
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{corpus.name} [{args.split}] loss {res['val_loss']:.4f}  ppl {res['val_ppl']:.3f}  "
              f"bpb {res['val_bpb']:.4f}  ({res['val_tokens']} tokens)")
    return 0


def _options(args, model) -> Options:
    """Apply --depth / --extend-loops (one depth) to a loaded model; the decoding options."""
    set_model_depth(model, args.depth, args.extend_loops or None)
    return _decode_options(args)


def _decode_options(args) -> Options:
    """generate's decoding flags as ``Options`` (a run's model or a .pte decodes with them)."""
    if args.exit and len(args.exit) > 1:
        raise PhaseloopError(f"--exit {args.exit[0].kind}: give one value here (a list sweeps "
                             "in `phaseloop eval` only)")
    if args.draft_tokens is not None and args.speculative is None:
        raise PhaseloopError("--draft-tokens applies with --speculative D (the draft's passes): add it or "
                             "drop --draft-tokens")
    drafts = {} if args.draft_tokens is None else {"draft_tokens": args.draft_tokens}
    return Options(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   seed=args.seed, use_cache=not args.no_cache, exit=args.exit[0] if args.exit else None,
                   kv_fill=args.kv_fill, kv_share=args.kv_share, speculative=args.speculative, **drafts)


def _prompt_ids(tok, prompt: str | None, device) -> torch.Tensor:
    """[1, T] ids of ``--prompt`` (an empty one is a newline); one that encodes to no token
    (a word-level tokenizer without "\\n") is refused in one line."""
    idx = torch.as_tensor(tok.encode(prompt or "\n"), dtype=torch.long, device=device)[None]
    if idx.shape[1] == 0:
        what = f"--prompt {prompt!r}" if prompt else "an empty --prompt (fed as a newline)"
        raise PhaseloopError(f"{what} encodes to no token with this model's tokenizer; give text it knows")
    return idx


def cmd_generate(args) -> int:
    if args.temperature < 0:  # the parser's types check the rest (finite, counts in range)
        raise PhaseloopError(f"--temperature {args.temperature}: must be a finite number >= 0 "
                             "(0 = greedy, 1 = the model's distribution)")
    if str(args.run).endswith(".pte"):
        return generate_pte(args)
    device = run_device(args)
    model, run_cfg = load_model(args, device)
    # faster products (docs/deploy.md); a compiled step packs its own copy (inductor's freezing)
    decode_layout(model, prepack=not (args.no_prepack or args.compile))
    opts = _options(args, model)
    tok = run_tokenizer(args.run, run_cfg)
    idx = _prompt_ids(tok, args.prompt, device)
    if args.compile:
        check_compiled(model, opts, idx)  # before the note below (a refusal is one line)
    if idx.shape[1] + args.max_new_tokens > model.cfg.max_seq_len:
        dist.say(f"note: prompt + new tokens ({idx.shape[1] + args.max_new_tokens}) exceed the model's "
                 f"max_seq_len {model.cfg.max_seq_len}: later positions are beyond what it was trained on")
    g = generate_compiled(model, idx, opts) if args.compile else generate(model, idx, opts)
    new = g.tokens[0].tolist()
    if args.json:
        out = {"prompt": tok.decode(idx[0].tolist()), "text": tok.decode(new), "tokens": new,
               "tokens_per_s": g.tokens_per_s, "mean_passes": g.mean_passes, "passes": g.passes,
               "depth": model.trunk.passes, "kv_cache_bytes": g.kv_cache_bytes}
        out["weight_bytes"], out["weight_bytes_fp32"] = weight_bytes(model)
        if opts.speculative is not None:
            out.update(acceptance=g.acceptance, rounds=g.rounds, draft_passes=opts.speculative)
        if args.compile:
            out["compile_seconds"], out["compile_autotuned"] = g.compile_seconds, g.compile_autotuned
        print(json.dumps(out, indent=2))
        return 0
    if args.compile and g.compile_autotuned is False:
        dist.say("note: --compile: inductor's GEMM templates failed on this model's step, so it compiled "
                 "without autotuning (frozen weights, ATen products; docs/deploy.md)")
    if opts.exit is not None and g.mean_passes is not None:
        dist.say(f"note: --exit {opts.exit.label}: mean depth {g.mean_passes:.2f} of "
                 f"{model.trunk.passes} passes per generated token")
    if opts.speculative is not None:
        dist.say(f"note: --speculative {opts.speculative}: {g.acceptance or 0:.1%} of the drafted tokens "
                 f"accepted over {g.rounds} rounds, {g.tokens_per_s:.1f} tokens/s")
    sys.stdout.write(tok.decode(idx[0].tolist() + new) + "\n")
    return 0


def generate_pte(args) -> int:
    """``phaseloop generate FILE.pte``: the program in ExecuTorch's runtime (deploy.generate)."""
    fixed = [flag for flag, on in (("--quantized", args.quantized), ("--depth", args.depth is not None),
                                   ("--extend-loops", args.extend_loops),
                                   ("--device", args.device not in ("auto", "cpu"))) if on]
    if fixed:
        raise PhaseloopError(f"{fixed[0]} with a .pte: its weights, depth and device were fixed at export "
                             "(phaseloop export ... --depth K --bits 4); run the checkpoint for another choice")
    if args.compile:
        raise PhaseloopError("--compile with a .pte: the program is compiled already (ExecuTorch); drop --compile")
    opts = _decode_options(args)  # deploy.generate.check refuses what a program cannot decode with
    exp = open_pte(args.run)
    idx = _prompt_ids(exp.tokenizer, args.prompt, "cpu")
    g = generate_program(exp, idx, opts)
    new = g.tokens[0].tolist()
    if args.json:
        print(json.dumps({"prompt": exp.tokenizer.decode(idx[0].tolist()), "text": exp.tokenizer.decode(new),
                          "tokens": new, "tokens_per_s": g.tokens_per_s, "mean_passes": g.mean_passes,
                          "passes": g.passes, "depth": exp.record.get("passes"), "kv_cache_bytes": g.kv_cache_bytes,
                          "program_bytes": exp.path.stat().st_size, "bits": exp.record.get("bits"),
                          "engine": "executorch"}, indent=2))
        return 0
    sys.stdout.write(exp.tokenizer.decode(idx[0].tolist() + new) + "\n")
    return 0
