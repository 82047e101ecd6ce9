"""`phaseloop` command line: a thin layer over the library functions.

Bad input (PhaseloopError) prints one line `phaseloop: error: ...` and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .errors import PhaseloopError

# train options: (flag, TrainConfig field, type, help)
TRAIN_OPTS = [
    ("--steps", "steps", int, "optimizer steps"),
    ("--batch-size", "batch_size", int, "sequences per micro-batch"),
    ("--grad-accum", "grad_accum", int, "micro-batches per step"),
    ("--seq-len", "seq_len", int, "training window (default: the model's max_seq_len)"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--min-lr-ratio", "min_lr_ratio", float, "cosine floor as a fraction of lr"),
    ("--warmup", "warmup_steps", int, "linear warmup steps"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (matrices only)"),
    ("--grad-clip", "grad_clip", float, "gradient-norm clip"),
    ("--seed", "seed", int, "random seed"),
    ("--eval-every", "eval_every", int, "steps between evaluations"),
    ("--eval-windows", "eval_windows", int, "validation windows per evaluation"),
    ("--ckpt-every", "ckpt_every", int, "steps between checkpoints"),
    ("--log-every", "log_every", int, "steps between metric records"),
    ("--val-fraction", "val_fraction", float, "fraction of tokens held out"),
    ("--device", "device", str, "auto | cpu | cuda[:N]"),
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_overrides(items: list[str] | None) -> dict:
    """`key=value` pairs; values parsed as JSON where possible (3, 0.1, true, null)."""
    out = {}
    for item in items or []:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise PhaseloopError(f"bad --set {item!r}; write KEY=VALUE, e.g. --set n_layers=6")
        try:
            out[key.strip()] = json.loads(val)
        except json.JSONDecodeError:
            out[key.strip()] = val
    return out


def _model_config(args, base: dict | None = None):
    from .config import ModelConfig

    if base is not None and args.preset is None:
        return ModelConfig.from_dict({**base, **parse_overrides(args.set)})
    return ModelConfig.from_preset(args.preset or "rope-small", **parse_overrides(args.set))


# ---------------------------------------------------------------------------- commands
def cmd_train(args) -> int:
    from .checkpoint import read_json
    from .train import TrainConfig, train

    explicit = {field: getattr(args, field) for _, field, _, _ in TRAIN_OPTS
                if getattr(args, field) is not None}
    if args.compile:
        explicit["compile"] = True
    out = args.out or f"runs/{args.preset or 'rope-small'}-{time.strftime('%Y%m%d-%H%M%S')}"
    saved = None
    if args.resume and (Path(out) / "config.json").exists():
        saved = read_json(Path(out) / "config.json")
    model_cfg = _model_config(args, saved["model"] if saved else None)
    tdict = {**(saved["train"] if saved else {}), **explicit}
    tc = TrainConfig.from_dict(tdict)
    data = args.data or (saved["data"]["source"] if saved else "stdlib")
    from .data import load_corpus

    corpus = load_corpus(data)
    if model_cfg.vocab_size != corpus.tokenizer.vocab_size and not saved and "vocab_size" not in parse_overrides(args.set):
        print(f"note: vocab_size {model_cfg.vocab_size} -> {corpus.tokenizer.vocab_size} "
              f"to match the {corpus.tokenizer.name} tokenizer", file=sys.stderr)
        model_cfg = model_cfg.replace(vocab_size=corpus.tokenizer.vocab_size)
    summary = train(model_cfg, tc, corpus, out, resume=args.resume, progress=not args.quiet)
    print(json.dumps({k: summary[k] for k in ("run", "step", "params", "val_loss", "val_bpb",
                                              "val_ppl", "tok_per_s") if k in summary}, indent=2))
    return 0


def cmd_eval(args) -> int:
    from .checkpoint import load_run
    from .data import eval_windows, load_corpus
    from .train import evaluate, resolve_device

    device = resolve_device(args.device)
    model, run_cfg = load_run(args.run, device)
    corpus = load_corpus(args.data or run_cfg["data"]["source"])
    seq_len = args.seq_len or run_cfg["train"].get("seq_len") or model.cfg.max_seq_len
    if args.split == "all":
        tokens = corpus.tokens
    else:
        _, tokens = corpus.split(run_cfg["train"].get("val_fraction", 0.1), seq_len + 1)
    windows = eval_windows(tokens, seq_len, args.windows)
    res = evaluate(model, windows, corpus.tokenizer.token_bytes(), 16, device)
    res.update({"data": corpus.name, "fingerprint": corpus.fingerprint, "split": args.split,
                "windows": len(windows), "seq_len": seq_len})
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{corpus.name} [{args.split}] loss {res['val_loss']:.4f}  ppl {res['val_ppl']:.3f}  "
              f"bpb {res['val_bpb']:.4f}  ({res['val_tokens']} tokens)")
    return 0


def cmd_generate(args) -> int:
    import torch

    from .checkpoint import load_run
    from .tokenizer import get_tokenizer
    from .train import resolve_device

    if args.max_new_tokens < 0 or (args.top_k is not None and args.top_k < 1):
        raise PhaseloopError("--max-new-tokens must be >= 0 and --top-k >= 1")
    device = resolve_device(args.device)
    model, run_cfg = load_run(args.run, device)
    tok = get_tokenizer(run_cfg["data"].get("tokenizer", "bytes"))
    ids = tok.encode(args.prompt or "\n")
    idx = torch.as_tensor(ids, dtype=torch.long, device=device)[None]
    g = torch.Generator(device=device).manual_seed(args.seed)
    out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         generator=g, use_cache=not args.no_cache)
    sys.stdout.write(tok.decode(out[0].tolist()) + "\n")
    return 0


def cmd_params(args) -> int:
    from .config import PRESETS, ModelConfig
    from .params import count_params, format_count

    names = list(PRESETS) if args.all else [args.preset or "rope-small"]
    rows = [count_params(ModelConfig.from_preset(n, **parse_overrides(args.set)), args.seq_len)
            | {"preset": n} for n in names]
    if args.json:
        print(json.dumps(rows if args.all else rows[0], indent=2))
        return 0
    print(f"{'preset':<16}{'arch':<13}{'total':>10}{'embedding':>11}{'unembed':>10}"
          f"{'non-emb':>10}{'GFLOP/tok':>11}")
    for r in rows:
        print(f"{r['preset']:<16}{r['arch']:<13}{format_count(r['total']):>10}"
              f"{format_count(r['embedding']):>11}{format_count(r['unembedding']):>10}"
              f"{format_count(r['non_embedding']):>10}{r['flops_per_token'] / 1e9:>11.3f}")
    return 0


# ---------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="phaseloop", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a model on a data source")
    t.add_argument("--preset", help="model preset (phaseloop params --all lists them); default rope-small")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
    t.add_argument("--data", help="a text file or folder, or stdlib (default) | shakespeare")
    t.add_argument("--out", help="run folder (default runs/PRESET-TIMESTAMP)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    t.add_argument("--compile", action="store_true", help="torch.compile the model")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    for flag, field, typ, hlp in TRAIN_OPTS:
        t.add_argument(flag, dest=field, type=typ, default=None, help=hlp)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="validation loss / perplexity / bits per byte of a run")
    e.add_argument("run", help="run folder (or its checkpoint folder)")
    e.add_argument("--data", help="data source (default: the run's own)")
    e.add_argument("--split", choices=("val", "all"), default="val",
                   help="val: the held-out tail; all: every token (e.g. a separate test file)")
    e.add_argument("--windows", type=int, default=64, help="number of evaluation windows")
    e.add_argument("--seq-len", type=int, help="window length (default: the run's)")
    e.add_argument("--device", default="auto")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_eval)

    g = sub.add_parser("generate", help="sample text from a run")
    g.add_argument("run")
    g.add_argument("--prompt", default="")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-cache", action="store_true", help="recompute the full prefix every token")
    g.add_argument("--device", default="auto")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("params", help="parameter and FLOP counts of a preset (no weights allocated)")
    c.add_argument("--preset", help="preset name (default rope-small)")
    c.add_argument("--all", action="store_true", help="every preset")
    c.add_argument("--set", action="append", metavar="KEY=VALUE")
    c.add_argument("--seq-len", type=int, help="sequence length for FLOPs (default: the preset's)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_params)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PhaseloopError as e:
        print(f"phaseloop: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phaseloop: interrupted; the last checkpoint is intact (resume with --resume)",
              file=sys.stderr)
        return 130
