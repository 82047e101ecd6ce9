"""``phaseloop eval`` and ``phaseloop generate``: a trained run's loss (at other depths,
with early exits) and its samples."""

from __future__ import annotations

import json
import sys

import torch

from phaseloop.analysis import plots
from phaseloop.analysis.exits import tally
from phaseloop.cli import argtypes
from phaseloop.cli.options import depth_options, exit_options, on_a_run
from phaseloop.cli.sweeps import eval_depths, eval_exits
from phaseloop.depth import set_model_depth
from phaseloop.early_exit import set_exit
from phaseloop.engine import dist, resolve_device
from phaseloop.engine.checkpoint import load_run, run_corpus, run_tokenizer
from phaseloop.errors import PhaseloopError
from phaseloop.lm.train import check_seq_len, eval_set, evaluate


def add_parsers(sub) -> None:
    """``phaseloop eval``, ``phaseloop generate``."""
    ev = on_a_run(sub, "eval", "validation loss / perplexity / bits per byte of a run", cmd_eval,
                  windows=64)
    ev.add_argument("--split", choices=("val", "all"), default="val",
                    help="val: the held-out tail; all: every token (ev.g. a separate test file)")
    ev.add_argument("--json", action="store_true")
    depth_options(ev, sweep=True)
    exit_options(ev, sweep=True)
    ev.add_argument("--plot", metavar="PNG", help="with --depth: loss and BPB against depth; with "
                    "--exit: loss against mean depth; as a PNG")

    gen = on_a_run(sub, "generate", "sample text from a run", cmd_generate, data=False)
    gen.add_argument("--prompt", default="")
    gen.add_argument("--max-new-tokens", type=argtypes.nonneg_int, default=200)
    gen.add_argument("--temperature", type=argtypes.finite_float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=argtypes.positive_int, default=None)
    gen.add_argument("--seed", type=argtypes.seed_int, default=0)
    gen.add_argument("--no-cache", action="store_true", help="recompute the full prefix every token")
    depth_options(gen)
    exit_options(gen)


def cmd_eval(args) -> int:
    if args.depth is None and (args.extend_loops or (args.plot and not args.exit)):
        raise PhaseloopError("--extend-loops and --plot apply with --depth (--plot also with --exit); "
                             "add --depth K[,K...]")
    if args.exit and args.depth is not None and len(args.depth) > 1:
        raise PhaseloopError("--exit sweeps its rules at one depth; give one --depth K (or none: "
                             "the trained depth)")
    device = resolve_device(args.device)
    model, run_cfg = load_run(args.run, device)
    corpus = run_corpus(args.run, run_cfg, args.data)
    seq_len = args.seq_len or run_cfg["train"].get("seq_len") or model.cfg.max_seq_len
    check_seq_len(seq_len, model.cfg)
    if args.split == "all":
        tokens = corpus.tokens
    else:
        _, tokens = corpus.split(run_cfg["train"].get("val_fraction", 0.1), seq_len + 1)
    windows, docs = eval_set(corpus, tokens, seq_len, args.windows, run_cfg["train"])
    if args.plot:  # refuse a plot without matplotlib before evaluating
        plots.pyplot()
    if args.exit:
        return eval_exits(args, model, run_cfg, corpus, windows, seq_len, device, docs)
    if args.depth is not None:
        return eval_depths(args, model, run_cfg, corpus, windows, seq_len, device, docs)
    res = evaluate(model, windows, corpus.tokenizer, 16, device, run_cfg["train"].get("loss_ignore_id"), docs)
    res.update({"data": corpus.name, "fingerprint": corpus.fingerprint, "split": args.split,
                "windows": len(windows), "seq_len": seq_len})
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{corpus.name} [{args.split}] loss {res['val_loss']:.4f}  ppl {res['val_ppl']:.3f}  "
              f"bpb {res['val_bpb']:.4f}  ({res['val_tokens']} tokens)")
    return 0


def _depth_args(args, model) -> None:
    """Apply --depth / --extend-loops (one depth) and --exit (one rule) to a loaded model."""
    set_model_depth(model, args.depth, args.extend_loops or None)
    if args.exit:
        if len(args.exit) > 1:
            raise PhaseloopError(f"--exit {args.exit[0].kind}: give one value here (a list sweeps "
                                 "in `phaseloop eval` only)")
        set_exit(model, args.exit[0])


def cmd_generate(args) -> int:
    if args.temperature < 0:  # the parser's types check the rest (finite, counts in range)
        raise PhaseloopError(f"--temperature {args.temperature}: must be a finite number >= 0 "
                             "(0 = greedy, 1 = the model's distribution)")
    device = resolve_device(args.device)
    model, run_cfg = load_run(args.run, device)
    _depth_args(args, model)
    tok = run_tokenizer(args.run, run_cfg)
    idx = torch.as_tensor(tok.encode(args.prompt or "\n"), dtype=torch.long, device=device)[None]
    if idx.shape[1] + args.max_new_tokens > model.cfg.max_seq_len:
        dist.say(f"note: prompt + new tokens ({idx.shape[1] + args.max_new_tokens}) exceed the model's "
                 f"max_seq_len {model.cfg.max_seq_len}: later positions are beyond what it was trained on")
    g = torch.Generator(device=device).manual_seed(args.seed)
    with tally(model) as t:
        out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             generator=g, use_cache=not args.no_cache)
    if args.exit and t.positions:
        dist.say(f"note: --exit {args.exit[0].label}: mean depth {t.mean('passes'):.2f} of "
                 f"{model.trunk.passes} passes per position computed")
    sys.stdout.write(tok.decode(out[0].tolist()) + "\n")
    return 0
