"""The subcommands: each turns parsed arguments into one call of a library function and
prints its result. Nothing here is needed by the library, the benchmarks or the tests."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from .. import compare, plots, registry
from ..checkpoint import load_run
from ..config import ModelConfig
from ..checkpoint import run_folder, run_tokenizer
from ..data import load_corpus, run_corpus
from ..engine import dist, resolve_device
from ..errors import PhaseloopError
from ..train import check_seq_len, eval_set, evaluate
from ..runconfig import resolve_run, train_run
from . import trainflags
from .sweeps import eval_depths, eval_exits


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


def _stderr(msg: str) -> None:
    if dist.world().main:  # one voice in a torchrun world
        print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- LM runs
def cmd_train(args) -> int:
    """Resolve the run once (preset or file, flags over it, a resumed run's settings), then
    print it (--print-config) or train it."""
    data = {k: v for k, v in (("source", args.data), ("tokenizer", args.tokenizer),
                              ("text_column", args.text_column), ("split", args.data_split),
                              ("streaming", args.streaming), ("doc_sep", args.doc_sep)) if v is not None}
    spec = resolve_run(args.config, preset=args.preset, arch=args.arch, model=parse_overrides(args.set),
                       train=trainflags.given(args), data=data, out=args.out, resume=args.resume)
    if args.print_config:
        for note in spec.notes:
            _stderr(note)
        sys.stdout.write(spec.to_toml())
        return 0
    summary = train_run(spec, progress=not args.quiet, log=_stderr)
    print(json.dumps({k: summary[k] for k in ("run", "step", "params", "val_loss", "val_bpb",
                                              "val_ppl", "tok_per_s") if k in summary}, indent=2))
    return 0


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
    from ..depth import set_model_depth
    from ..early_exit import set_exit

    set_model_depth(model, args.depth, args.extend_loops or None)
    if args.exit:
        if len(args.exit) > 1:
            raise PhaseloopError(f"--exit {args.exit[0].kind}: give one value here (a list sweeps "
                                 "in `phaseloop eval` only)")
        set_exit(model, args.exit[0])


def cmd_generate(args) -> int:
    import torch

    from ..early_exit import tally

    if args.temperature < 0:  # the parser's types check the rest (finite, counts in range)
        raise PhaseloopError(f"--temperature {args.temperature}: must be a finite number >= 0 "
                             "(0 = greedy, 1 = the model's distribution)")
    device = resolve_device(args.device)
    model, run_cfg = load_run(args.run, device)
    _depth_args(args, model)
    tok = run_tokenizer(args.run, run_cfg)
    idx = torch.as_tensor(tok.encode(args.prompt or "\n"), dtype=torch.long, device=device)[None]
    if idx.shape[1] + args.max_new_tokens > model.cfg.max_seq_len:
        _stderr(f"note: prompt + new tokens ({idx.shape[1] + args.max_new_tokens}) exceed the model's "
                f"max_seq_len {model.cfg.max_seq_len}: later positions are beyond what it was trained on")
    g = torch.Generator(device=device).manual_seed(args.seed)
    with tally(model) as t:
        out = model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             generator=g, use_cache=not args.no_cache)
    if args.exit and t.positions:
        _stderr(f"note: --exit {args.exit[0].label}: mean depth {t.mean('passes'):.2f} of "
                f"{model.trunk.passes} passes per position computed")
    sys.stdout.write(tok.decode(out[0].tolist()) + "\n")
    return 0


def cmd_params(args) -> int:
    from .. import accounting as acc
    from ..config import PRESETS
    from ..params import count_params, format_count

    if args.match or args.shared or args.preset in acc.PRESETS:
        return _params_encdec(args)
    if args.built:
        raise PhaseloopError(f"--built applies to the encoder-decoder presets ({', '.join(acc.PRESETS)}); "
                             "a decoder-only preset is always counted from its built model")
    names = list(PRESETS) if args.all else [args.preset or registry.default_preset()]
    rows = [count_params(ModelConfig.from_preset(n, **parse_overrides(args.set)), args.seq_len)
            | {"preset": n} for n in names]
    if args.json:
        print(json.dumps(rows if args.all else rows[0], indent=2))
        return 0
    w = max(len(r["preset"]) for r in rows) + 2
    print(f"{'preset':<{w}}{'arch':<13}{'total':>10}{'embedding':>11}{'unembed':>10}"
          f"{'non-emb':>10}{'w/o in-emb':>11}{'MFLOP/tok':>11}")
    for r in rows:
        print(f"{r['preset']:<{w}}{r['arch']:<13}{format_count(r['total']):>10}"
              f"{format_count(r['embedding']):>11}{format_count(r['unembedding']):>10}"
              f"{format_count(r['non_embedding']):>10}{format_count(r['without_input_embedding']):>11}"
              f"{r['flops_per_token'] / 1e6:>11.2f}")
    return 0


def _params_encdec(args) -> int:
    """UT §3: tensor2tensor-convention encoder-decoder presets, and --match solving for
    the width of a weight-tied model with a preset's parameter count."""
    from .. import accounting as acc

    if args.set or args.all:
        raise PhaseloopError("--set/--all do not apply to the encoder-decoder presets "
                             f"({', '.join(acc.PRESETS)}); drop them")
    if args.shared and not args.match:
        raise PhaseloopError("--shared needs --match PRESET, e.g. --match transformer-base --shared")
    if args.built and args.match:
        raise PhaseloopError("--built builds one of the presets; drop --match (or --built)")
    seq_len = args.seq_len or acc.DEFAULT_SEQ_LEN
    rows = [acc.count(spec, seq_len) for spec in acc.PRESETS.values()]
    if args.match:
        res = acc.match(args.match, shared=args.shared, seq_len=seq_len)
        if args.json:
            print(json.dumps(res, indent=2))
            return 0
        kind = "weight-tied (1+1 layers, shared)" if args.shared else "6+6 distinct layers"
        print(f"{kind} encoder-decoder with the parameters of {args.match} "
              f"({res['target_total']:,}): d = {res['d_exact']:.1f} -> d = {res['d']}, "
              f"d_ff = {4 * res['d']}, {res['model']['total']:,} parameters\n")
        print(acc.table(rows + [res["model"]], rows[0]))
        return 0
    spec = acc.get(args.preset)
    row = acc.count(spec, seq_len)
    if args.built:
        row |= acc.count_built(spec, seq_len)
        row["built_equals_closed_form"] = row["built_total"] == row["total"]
    if args.json:
        print(json.dumps(row, indent=2))
        return 0
    print(acc.table(rows, rows[0]))
    if args.built:
        same = "equal" if row["built_equals_closed_form"] else "DIFFERENT"
        print(f"\n{spec.name} built ({row['built_class']}, meta device): {row['built_total']:,} "
              f"parameters; closed form {row['total']:,} ({same})\n"
              f"forward FLOPs/token at {seq_len} keys: built {row['built_flops_per_token']:,}, "
              f"closed form {row['flops_per_token']:,}"
              + (" (a shared decoder projects the encoder's keys/values for cross-attention once "
                 "for all steps; the closed form counts them at every step)" if spec.shared else ""))
    return 0


def cmd_compare(args) -> int:
    """Train every (variant, seed) of a recipe, then write summary.json, report.md, plots."""
    recipe = compare.load_recipe(args.recipe)
    recipe = compare.apply_overrides(recipe, args.variants, args.seeds, args.steps, args.data,
                                     args.match, log=_stderr, tokenizer=args.tokenizer)
    if args.dry_run:
        from ..compare.dryrun import dry_run

        dry_run(recipe)
        return 0
    out = args.out or f"runs/compare-{compare.slugify(recipe.name)}"
    command = " ".join(shlex.quote(a) for a in ["phaseloop", *sys.argv[1:]])
    if args.status:
        print(compare.format_status(compare.comparison_status(out)))
        return 0
    if args.report:
        s = compare.report_finished(recipe, out, command=command)
    else:
        launch = compare.LaunchOptions.resolve(recipe.launcher, {
            k: getattr(args, k) for k in ("launcher", "jobs", "nproc_per_run", "partition", "time",
                                          "gpus_per_task", "cpus_per_task", "account", "sbatch", "wait")})
        s = compare.run_comparison(recipe, out, progress=not args.quiet, command=command, launch=launch)
    if not s:  # a rank > 0 of a torchrun world (rank 0 reports), or runs left to Slurm / other processes
        return 0
    print(compare.format_table(s))
    print(f"wrote {Path(out) / 'report.md'}, summary.json and {len(s['plots'])} plots")
    return 0


def cmd_quantize(args) -> int:
    """Hyperloop §4: weight-only INT8/INT4 quantisation of a run (``quant.quantize_run``)."""
    from ..params import format_count
    from ..quant import quantize_run

    r = quantize_run(args.run, args.bits, args.group_size, args.method, calib_batches=args.calib_batches,
                     calib_batch_size=args.calib_batch_size, seed=args.seed, windows=args.windows,
                     data=args.data, out=args.out, device=args.device)
    b, a = r["before"], r["after"]
    print(f"{r['arch']} {r['stem']}: val loss {b['val_loss']:.4f} -> {a['val_loss']:.4f}, "
          f"bpb {b['val_bpb']:.4f} -> {a['val_bpb']:.4f}, params {format_count(r['bytes_before'])}B -> "
          f"{format_count(r['bytes_after'])}B ({r['n_quantized']} Linears) -> {r['weights']}")
    return 0


# ---------------------------------------------------------------------------- Hugging Face
def cmd_export(args) -> int:
    """A run as a Hugging Face folder (``hf.export_run``)."""
    from .. import hf

    hf.require()
    out = hf.export_run(args.run, args.out, dtype=args.dtype, quantized=args.quantized,
                        depth=args.depth, extend_loops=args.extend_loops)
    print(f"exported {args.run} -> {out} (AutoModelForCausalLM.from_pretrained({str(out)!r}) "
          "after `import phaseloop`, or with trust_remote_code=True)")
    return 0


def cmd_lm_eval(args) -> int:
    """lm-evaluation-harness on a run (``hf.harness.lm_eval_run``)."""
    from .. import hf

    hf.require("transformers", "lm_eval")
    from ..hf.harness import lm_eval_run

    tasks = [t.strip() for t in args.tasks.split(",")]
    res = lm_eval_run(args.run, tasks, include_path=args.include_path, limit=args.limit,
                      batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                      data=args.data_dir, depth=args.depth, extend_loops=args.extend_loops)
    from lm_eval.utils import make_table

    print(make_table(res))
    print(f"results: {run_folder(args.run) / 'lm_eval' / 'results.json'} (table: results.md)")
    return 0


def cmd_archs(args) -> int:
    """Every registered architecture (``registry``), built in or a plugin's."""
    import dataclasses

    from ..config import PRESETS

    rows = []
    for spec in registry.all_archs():
        groups = registry.groups_of(spec)
        rows.append({"arch": spec.name, "aliases": list(spec.aliases), "module": spec.trunk.__module__,
                     "trunk": spec.trunk.__name__, "layers": {spec.layers_name: spec.layers},
                     "paper": spec.paper,
                     "defaults": {k: v for k, v in spec.defaults.items()},
                     "options": {g.__name__: [f.name for f in dataclasses.fields(g)] for g in groups},
                     "modifiers": sorted(spec.modifiers), "seq2seq": spec.seq2seq_name,
                     "presets": [n for n, d in PRESETS.items() if d.get("arch") == spec.name]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        alias = f" (also {', '.join(r['aliases'])})" if r["aliases"] else ""
        print(f"{r['arch']}{alias}: {r['trunk']} from {r['module']}")
        print(f"  paper: {r['paper'] or '-'}")
        (name, what), = r["layers"].items()
        print(f"  {name}: {what}")
        for g, names in r["options"].items():
            print(f"  {g}: {', '.join(names)}")
        if r["defaults"]:
            print(f"  defaults: {', '.join(f'{k}={v!r}' for k, v in r['defaults'].items())}")
        extra = [f"+{m}" for m in r["modifiers"]] + ([f"task --arch {r['seq2seq']}"] if r["seq2seq"] else [])
        if extra:
            print(f"  recipes: {', '.join(extra)}")
        print(f"  presets: {', '.join(r['presets']) or '-'}")
    return 0


def cmd_demo(args) -> int:
    """Hand-set prefix-parity scan (UT paper): shared step vs fixed stack vs no step signal."""
    from ..tasks.parity_demo import render_demo

    print(render_demo(args.length, seed=args.seed, n_layers=args.layers))
    return 0


def cmd_explore(args) -> int:
    """Serve the explore web app until Ctrl-C (which ends it cleanly: exit 0)."""
    from ..explore.app import serve  # a missing explore extra: one line, exit 2

    try:
        return serve(args.paths, args.host, args.port, open_browser=not args.no_browser)
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the signal
        print("phaseloop explore: stopped", file=sys.stderr)
        return 0


# ---------------------------------------------------------------------------- tokenizers
def cmd_tokenizer(args) -> int:
    """Train a tokenizer, encode / decode with one, or measure one on a data source."""
    from ..tokenizer import load_tokenizer

    if args.action == "train":
        from ..tokenizer_train import train_tokenizer

        tok = train_tokenizer(args.data, args.kind, args.vocab_size, args.out, args.name,
                              text_column=args.text_column, split=args.data_split, streaming=args.streaming,
                              min_frequency=args.min_frequency, progress=not args.quiet)
        print(f"wrote {tok.path} ({tok.kind}, {tok.vocab_size} tokens, sha256 {tok.sha256[:12]}...)")
        return 0
    tok = load_tokenizer(args.tokenizer)
    if args.action == "encode":
        print(" ".join(map(str, tok.encode(" ".join(args.text)).tolist())))
    elif args.action == "decode":
        try:
            ids = [int(t) for t in " ".join(args.text).replace(",", " ").split()]
        except ValueError:
            raise PhaseloopError("decode takes token ids, e.g. `phaseloop tokenizer decode -t T 12 40 7`") from None
        if any(not 0 <= i < tok.vocab_size for i in ids):
            raise PhaseloopError(f"token ids must lie in [0, {tok.vocab_size}) for this tokenizer")
        sys.stdout.write(tok.decode(ids) + "\n")
    else:  # stats
        c = load_corpus(args.data, tok, text_column=args.text_column, split=args.data_split,
                        streaming=args.streaming, progress=not args.quiet)
        d = c.describe()
        stats = {k: d[k] for k in ("source", "tokenizer", "tokenizer_kind", "tokenizer_vocab", "bytes",
                                   "tokens", "documents", "tokens_per_byte")}
        if tok.kind == "wordlevel" and "[UNK]" in tok.tok.get_vocab():
            unk = tok.tok.token_to_id("[UNK]")
            stats["unknown_fraction"] = float((c.tokens[:] == unk).mean())
        print(json.dumps(stats, indent=2))
    return 0
