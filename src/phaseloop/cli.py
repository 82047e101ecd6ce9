"""`phaseloop` command line: a thin layer over the library functions.

Bad input (PhaseloopError) prints one line `phaseloop: error: ...` and exits with 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from . import kernels
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
    from .accounting import PRESETS as ENC_DEC
    from .config import PRESETS, ModelConfig
    from .params import count_params, format_count

    if args.match or args.shared or args.preset in ENC_DEC:
        return cmd_params_encdec(args)
    names = list(PRESETS) if args.all else [args.preset or "rope-small"]
    rows = [count_params(ModelConfig.from_preset(n, **parse_overrides(args.set)), args.seq_len)
            | {"preset": n} for n in names]
    if args.json:
        print(json.dumps(rows if args.all else rows[0], indent=2))
        return 0
    w = max(len(r["preset"]) for r in rows) + 2
    print(f"{'preset':<{w}}{'arch':<13}{'total':>10}{'embedding':>11}{'unembed':>10}"
          f"{'non-emb':>10}{'MFLOP/tok':>11}")
    for r in rows:
        print(f"{r['preset']:<{w}}{r['arch']:<13}{format_count(r['total']):>10}"
              f"{format_count(r['embedding']):>11}{format_count(r['unembedding']):>10}"
              f"{format_count(r['non_embedding']):>10}{r['flops_per_token'] / 1e6:>11.2f}")
    return 0


def cmd_params_encdec(args) -> int:
    """UT §3: tensor2tensor-convention encoder-decoder presets, and --match solving for
    the width of a weight-tied model with a preset's parameter count."""
    from . import accounting as acc

    if args.set or args.all:
        raise PhaseloopError("--set/--all do not apply to the encoder-decoder presets "
                             f"({', '.join(acc.PRESETS)}); drop them")
    if args.shared and not args.match:
        raise PhaseloopError("--shared needs --match PRESET, e.g. --match transformer-base --shared")
    seq_len = args.seq_len or acc.DEFAULT_SEQ_LEN
    rows = [acc.count(spec, seq_len) for spec in acc.PRESETS.values()]
    ref = rows[0]
    if args.match:
        res = acc.match(args.match, shared=args.shared, seq_len=seq_len)
        if args.json:
            print(json.dumps(res, indent=2))
            return 0
        kind = "weight-tied (1+1 layers, shared)" if args.shared else "6+6 distinct layers"
        print(f"{kind} encoder-decoder with the parameters of {args.match} "
              f"({res['target_total']:,}): d = {res['d_exact']:.1f} -> d = {res['d']}, "
              f"d_ff = {4 * res['d']}, {res['model']['total']:,} parameters\n")
        print(acc.table(rows + [res["model"]], ref))
        return 0
    row = acc.count(acc.get(args.preset), seq_len)
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    print(acc.table(rows, ref))
    return 0


def cmd_angles(args) -> int:
    """3PT: per-layer |θ_final − θ_init| of a trained run, printed and plotted."""
    from .checkpoint import load_run, write_json
    from .three_phase import angle_drift

    model, _ = load_run(args.run)
    rows = angle_drift(model)
    if not rows:
        raise PhaseloopError(f"{args.run} has no phase rotation (train with --preset 3pt-* "
                             "or --set phase_rotation=true)")
    print(f"{'layer':>5} {'theta_init':>10} {'mean|drift|':>12} {'max|drift|':>11}")
    for r in rows:
        print(f"{r['layer']:>5} {r['init']:>10.4f} {r['mean_abs_drift']:>12.5f} {r['max_abs_drift']:>11.5f}")
    run_dir = Path(args.run)
    write_json(run_dir / "angle_drift.json", rows)
    png = Path(args.png) if args.png else run_dir / "angle_drift.png"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r["layer"] for r in rows], [r["mean_abs_drift"] for r in rows], "o-", label="mean over pairs")
    ax.plot([r["layer"] for r in rows], [r["max_abs_drift"] for r in rows], "s--", alpha=0.6, label="max")
    ax.set_xlabel("layer")
    ax.set_ylabel("|θ_final − θ_init| (rad)")
    ax.set_title("3PT rotation-angle drift by depth")
    ax.legend()
    fig.tight_layout()
    _save_fig(fig, png)
    print(f"wrote {png} and {run_dir / 'angle_drift.json'}")
    return 0


def cmd_zero_sum(args) -> int:
    """3PT: Σ_i mean(stripe i) averaged over positions, at the embedding and each layer."""
    from .checkpoint import load_run
    from .data import eval_windows, load_corpus
    from .three_phase import zero_sum_profile

    model, run_cfg = load_run(args.run)
    if args.phases:
        model.cfg = model.cfg.replace(n_phases=args.phases)
    corpus = load_corpus(args.data or run_cfg["data"]["source"])
    seq_len = args.seq_len or model.cfg.max_seq_len
    _, val = corpus.split(run_cfg["train"].get("val_fraction", 0.1), seq_len + 1)
    windows = eval_windows(val, seq_len, args.windows)[:, :-1]
    N, T = model.cfg.n_phases, seq_len
    expect = N * sum(1 / k for k in range(1, T + 1)) / T
    print(f"zero-sum diagnostic, N={N}, T={T} (horn value N*H_T/T = {expect:.4f})")
    for r in zero_sum_profile(model, windows):
        print(f"  {r['site']:<10} {r['zero_sum']:+.5f}")
    return 0


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PhaseloopError("plots need matplotlib; pip install 'phaseloop[plot]'") from None
    return plt


def _save_fig(fig, path: Path) -> None:
    """Render to a temporary file, then rename (nothing half-written)."""
    import io

    from .data import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    atomic_write_bytes(Path(path), buf.getvalue())
    _pyplot().close(fig)


def cmd_compare(args) -> int:
    """Train every (variant, seed) of a recipe, then write summary.json, report.md, plots."""
    from . import compare

    recipe = compare.load_recipe(args.recipe)
    recipe = compare.apply_overrides(recipe, args.variants, args.seeds, args.steps, args.data,
                                     args.match, log=compare._stderr)
    out = args.out or f"runs/compare-{compare.slugify(recipe.name)}"
    command = " ".join(shlex.quote(a) for a in ["phaseloop", *sys.argv[1:]])
    try:
        s = compare.run_comparison(recipe, out, progress=not args.quiet, command=command)
    except KeyboardInterrupt:
        print(f"phaseloop: interrupted; rerun the same command to resume ({out} keeps the "
              "finished runs and the last checkpoints)", file=sys.stderr)
        return 130
    print(compare.format_table(s))
    print(f"wrote {Path(out) / 'report.md'}, summary.json and {len(s['plots'])} plots")
    return 0


# ---------------------------------------------------------------------------- tasks (UT paper)
def _task_setup(args):
    from .tasks.runner import TaskRunConfig, task_model_config
    from .train import resolve_device

    cfg, arch = task_model_config(args.arch, args.preset, parse_overrides(args.set))
    device = str(resolve_device(args.device or "cpu"))
    rc = TaskRunConfig(device=device, **{k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size),
                                                           ("lr", args.lr)) if v is not None})
    items = [s.strip() for s in args.seeds.split(",")]
    if not all(s.isdigit() for s in items):
        raise PhaseloopError(f"bad --seeds {args.seeds!r}; write integers like 0,1")
    seeds = list(dict.fromkeys(int(s) for s in items))
    return cfg, arch, rc, seeds


def cmd_task(args) -> int:
    """Algorithmic task (or a JSONL file): train over seeds; table, metrics.json, plot."""
    from .tasks.runner import format_table, run_task

    cfg, arch, rc, seeds = _task_setup(args)
    train_len = args.train_len or ("40" if args.paper else "1-20")
    test_len = args.test_len or ("400" if args.paper else "40,80")
    offsets = args.offsets if args.offsets is not None else (
        "auto" if args.paper and "universal" in (arch or cfg.arch) else "0")
    if offsets != "auto" and not offsets.isdigit():
        raise PhaseloopError(f"bad --offsets {offsets!r}; write auto or an integer >= 0")
    name = args.task.split(":")[0]
    out = Path(args.out or f"runs/task-{name}-{arch or cfg.arch}-{time.strftime('%Y%m%d-%H%M%S')}")
    res = run_task(args.task, cfg, rc, seeds, train_len, test_len, out, n_test=args.n_test,
                   test_file=args.test_file, offsets=offsets if offsets == "auto" else int(offsets),
                   arch=arch, log=None if args.quiet else print)
    print(format_table(res["summary"], f"{args.task} | {arch or cfg.arch} | train {train_len} | "
                       f"seeds {','.join(map(str, seeds))} (mean ±std over seeds)"))
    print(f"wrote {out / 'metrics.json'}" + (f" and {out / 'accuracy_vs_length.png'}" if res["plot"]
                                              else " (no plot: pip install matplotlib)"))
    return 0


def cmd_babi(args) -> int:
    """bAbI QA: error per task, failed tasks, ponder time by supporting facts."""
    import os

    from .tasks.runner import format_babi_table, run_babi_seeds

    cfg, arch, rc, seeds = _task_setup(args)
    data_dir = args.data_dir or Path(os.environ.get("PHASELOOP_DATA_DIR", "data")) / "babi" / "en-1k"
    try:
        tasks = [int(t) for t in args.tasks.split(",")]
    except ValueError:
        raise PhaseloopError(f"bad --tasks {args.tasks!r}; write task numbers like 1,2,3") from None
    window = None if args.max_sentences == "all" else args.max_sentences
    if window is not None and not window.isdigit():
        raise PhaseloopError(f"bad --max-sentences {window!r}; write an integer or all")
    out = Path(args.out or f"runs/babi-{arch or cfg.arch}-{time.strftime('%Y%m%d-%H%M%S')}")
    res = run_babi_seeds(cfg, data_dir, tasks, rc, seeds, args.joint, window and int(window), out, arch,
                         log=None if args.quiet else print, max_test=args.n_test)
    print(format_babi_table(res))
    print(f"wrote {out / 'metrics.json'}")
    return 0


def cmd_demo(args) -> int:
    """Hand-set prefix-parity scan (UT paper): shared step vs fixed stack vs no step signal."""
    from .tasks.parity_demo import render_demo

    print(render_demo(args.length, seed=args.seed, n_layers=args.layers))
    return 0


def cmd_quantize(args) -> int:
    """Hyperloop §4: weight-only INT8/INT4 quantisation of a run (RTN or GPTQ with the
    Hessians of weight-shared layers pooled over their loop passes), validation loss/BPB
    before and after, packed safetensors + JSON report written atomically."""
    import os

    from .checkpoint import load_run, write_json
    from .data import TrainBatches, eval_windows, load_corpus
    from .params import format_count
    from .quant import quantize_model, save_quantized
    from .train import evaluate, resolve_device

    if args.group_size < 1 and args.group_size != -1:
        raise PhaseloopError(f"--group-size {args.group_size}: use a positive size or -1 (per row)")
    if args.windows < 1 or args.calib_batches < 1 or args.calib_batch_size < 1:
        raise PhaseloopError("--windows, --calib-batches and --calib-batch-size must be >= 1")
    device = resolve_device(args.device)
    model, run_cfg = load_run(args.run, device)
    run_path = Path(args.run)
    run_dir = run_path.parent if (run_path / "model.safetensors").exists() else run_path
    corpus = load_corpus(args.data or run_cfg["data"]["source"],
                         run_cfg["data"].get("tokenizer", "bytes"))
    seq_len = run_cfg["train"].get("seq_len") or model.cfg.max_seq_len
    train_tok, val_tok = corpus.split(run_cfg["train"].get("val_fraction", 0.1), seq_len + 1)
    windows = eval_windows(val_tok, seq_len, args.windows)
    token_bytes = corpus.tokenizer.token_bytes()
    before = evaluate(model, windows, token_bytes, 16, device)
    calib = None
    if args.method == "gptq":  # calibration windows from the run's training split
        batches = TrainBatches(train_tok, seq_len, args.calib_batch_size, args.seed)
        calib = [batches.next()[0] for _ in range(args.calib_batches)]
    group = None if args.group_size == -1 else args.group_size
    report = quantize_model(model, args.bits, group, args.method, calib)
    after = evaluate(model, windows, token_bytes, 16, device)

    out_dir = Path(args.out) if args.out else run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"quant-w{args.bits}-g{args.group_size}-{args.method}"
    weights = out_dir / f"{stem}.safetensors"
    tmp = out_dir / f".{stem}.safetensors.tmp"
    try:
        save_quantized(model, tmp, {"run": str(run_dir), "arch": model.cfg.arch})
        os.replace(tmp, weights)
    finally:
        tmp.unlink(missing_ok=True)
    report.update({"run": str(run_dir), "arch": model.cfg.arch, "weights": str(weights),
                   "before": before, "after": after, "data": corpus.name,
                   "fingerprint": corpus.fingerprint, "windows": len(windows), "seq_len": seq_len,
                   "calib": None if calib is None else {"batches": len(calib),
                                                        "batch_size": args.calib_batch_size,
                                                        "seed": args.seed}})
    write_json(out_dir / f"{stem}.json", report)
    print(f"{model.cfg.arch} {stem}: val loss {before['val_loss']:.4f} -> {after['val_loss']:.4f}, "
          f"bpb {before['val_bpb']:.4f} -> {after['val_bpb']:.4f}, params "
          f"{format_count(report['bytes_before'])}B -> {format_count(report['bytes_after'])}B "
          f"({report['n_quantized']} Linears) -> {weights}")
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
    c.add_argument("--match", metavar="PRESET",
                   help="UT §3: solve for the width d (d_ff=4d) with the parameters of PRESET "
                        "(transformer-base, ...); with --shared a weight-tied encoder-decoder")
    c.add_argument("--shared", action="store_true", help="with --match: one shared layer per side")
    c.set_defaults(func=cmd_params)

    a = sub.add_parser("angles", help="3PT: per-layer rotation-angle drift of a run (+ PNG)")
    a.add_argument("run")
    a.add_argument("--png", help="plot path (default RUN/angle_drift.png)")
    a.set_defaults(func=cmd_angles)

    z = sub.add_parser("zero-sum", help="3PT: zero-sum diagnostic of a run's residual stream")
    z.add_argument("run")
    z.add_argument("--data", help="data source (default: the run's own)")
    z.add_argument("--windows", type=int, default=8)
    z.add_argument("--seq-len", type=int)
    z.add_argument("--phases", type=int, help="stripes to measure (default: the model's N)")
    z.set_defaults(func=cmd_zero_sum)

    m = sub.add_parser("compare", help="train model variants over seeds and report (default: the quick recipe)")
    m.add_argument("recipe", nargs="?", help="recipe .toml/.json (see recipes/) or a built-in name; default quick")
    m.add_argument("--out", help="comparison folder (default runs/compare-NAME); rerun to resume")
    m.add_argument("--variants", nargs="+", metavar="VARIANT",
                   help="recipe variant names or specs, e.g. rope 'three_phase N=1' universal+act")
    m.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1")
    m.add_argument("--steps", type=int, help="optimizer steps per run")
    m.add_argument("--data", help="a text file or folder, or stdlib | shakespeare")
    m.add_argument("--match", choices=("none", "params", "flops", "depth"),
                   help="resize variants to the reference's parameters, FLOPs/token or depth")
    m.add_argument("--quiet", action="store_true", help="no progress bar")
    m.set_defaults(func=cmd_compare)

    for name, hlp in (("task", "train/evaluate on an algorithmic task or a JSONL file (UT paper)"),
                      ("babi", "train/evaluate on bAbI QA tasks (UT paper)")):
        k = sub.add_parser(name, help=hlp)
        if name == "task":
            k.add_argument("--task", required=True, help="copy | reverse | addition | parity | jsonl:PATH")
            k.add_argument("--train-len", help="training lengths, e.g. 1-20 (default; --paper: 40)")
            k.add_argument("--test-len", help="test lengths, e.g. 40,80 (default; --paper: 400)")
            k.add_argument("--paper", action="store_true", help="the paper's setting: train 40, test 400, "
                           "random position offsets for UT")
            k.add_argument("--offsets", help="max random start offset in training: an integer or auto")
            k.add_argument("--n-test", type=int, default=100, help="test examples per test length")
            k.add_argument("--test-file", help="JSONL test file for --task jsonl:PATH (default: 10%% held out)")
        else:
            k.add_argument("--tasks", default="1,2,3", help="task numbers, e.g. 1,2,3")
            k.add_argument("--data-dir", help="folder of qa*_train/test.txt (default $PHASELOOP_DATA_DIR/babi/en-1k)")
            k.add_argument("--joint", action="store_true", help="one model on all tasks (default: one per task)")
            k.add_argument("--max-sentences", default="20", help="keep the last N story sentences, or all")
            k.add_argument("--n-test", type=int, help="score the first N test questions per task (default all)")
        k.add_argument("--arch", help="any decoder arch (uses its -tiny preset), or transformer-seq2seq | "
                       "universal-seq2seq")
        k.add_argument("--preset", help="model preset (overrides the -tiny default)")
        k.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
        k.add_argument("--steps", type=int, help="optimizer steps (default 400)")
        k.add_argument("--batch-size", type=int)
        k.add_argument("--lr", type=float)
        k.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1")
        k.add_argument("--device", help="cpu (default) | auto | cuda[:N]")
        k.add_argument("--out", help="run folder for metrics.json (and the plot)")
        k.add_argument("--quiet", action="store_true")
        k.set_defaults(func=cmd_task if name == "task" else cmd_babi)

    q = sub.add_parser("quantize", help="weight-only INT8/INT4 quantisation of a run, "
                       "with validation loss/BPB before and after")
    q.add_argument("run", help="run folder (or its checkpoint folder)")
    q.add_argument("--bits", type=int, choices=(8, 4), required=True)
    q.add_argument("--group-size", type=int, default=128, help="input columns per scale "
                   "(-1: one per row; a layer it does not divide falls back to per row)")
    q.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="rtn: round to nearest; gptq: Frantar et al. 2022, Hessians of shared "
                   "layers pooled over all loop passes")
    q.add_argument("--calib-batches", type=int, default=8, help="GPTQ calibration batches")
    q.add_argument("--calib-batch-size", type=int, default=8)
    q.add_argument("--seed", type=int, default=0, help="seed of the calibration windows")
    q.add_argument("--windows", type=int, default=64, help="validation windows")
    q.add_argument("--data", help="data source (default: the run's own)")
    q.add_argument("--out", help="folder for the weights and report (default: the run folder)")
    q.add_argument("--device", default="auto")
    q.set_defaults(func=cmd_quantize)

    d = sub.add_parser("demo", help="runnable explainer demos")
    d.add_argument("which", choices=["parity"], help="parity: the hand-set prefix-parity scan")
    d.add_argument("--length", type=int, default=100)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--layers", type=int, help="fixed-stack depth (default: one layer short)")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        kernels.mode()  # a bad $PHASELOOP_KERNELS is refused before anything is written
        return args.func(args)
    except PhaseloopError as e:
        print(f"phaseloop: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("phaseloop: interrupted; the last checkpoint is intact (resume with --resume)",
              file=sys.stderr)
        return 130
