"""``phaseloop params``, ``archs`` and ``demo``: counts without weights, the registered
architectures, the explainer's runnable demo."""

from __future__ import annotations

import dataclasses
import json

from phaseloop import registry
from phaseloop.analysis import accounting as acc
from phaseloop.analysis.params import count_params, format_count
from phaseloop.cli import argtypes
from phaseloop.cli.options import parse_overrides
from phaseloop.config import PRESETS, ModelConfig
from phaseloop.errors import ConfigError, PhaseloopError
from phaseloop.tasks.parity_demo import render_demo


def add_parsers(sub) -> None:
    """``phaseloop params``, ``archs``, ``demo``."""
    params = sub.add_parser("params", help="parameter and FLOP counts of a preset (no weights allocated)")
    params.add_argument("--preset", help=f"preset name (default {registry.default_preset()})")
    params.add_argument("--all", action="store_true", help="every preset")
    params.add_argument("--set", action="append", metavar="KEY=VALUE")
    params.add_argument("--seq-len", type=argtypes.seq_len_int,
                        help="sequence length for FLOPs (default: the preset's)")
    params.add_argument("--json", action="store_true")
    params.add_argument("--match", metavar="PRESET",
                        help="UT §3: solve for the width d (d_ff=4d) with the parameters of PRESET "
                        "(transformer-base, ...); with --shared a weight-tied encoder-decoder")
    params.add_argument("--shared", action="store_true", help="with --match: one shared layer per side")
    params.add_argument("--built", action="store_true",
                        help="UT §3 presets: build the encoder-decoder (seq2seq.py, meta device) and "
                        "print its parameter and FLOP counts next to the closed form")
    params.set_defaults(func=cmd_params)

    archs = sub.add_parser("archs", help="the registered architectures (built in and plugins): options, "
                           "presets, what n_layers counts")
    archs.add_argument("--json", action="store_true")
    archs.set_defaults(func=cmd_archs)

    demo = sub.add_parser("demo", help="runnable explainer demos")
    demo.add_argument("which", choices=["parity"], help="parity: the hand-set prefix-parity scan")
    # the traces hold every step's state of every position: 65536 positions took 46 s and 14 GB
    demo.add_argument("--length", type=argtypes.int_in(1, 4096, " (the traces hold every step of every position)"),
                      default=100, help="bits in the input, 1-4096 (default 100)")
    demo.add_argument("--seed", type=argtypes.seed_int, default=0)
    demo.add_argument("--layers", type=argtypes.int_in(0, 4096, " (layers past log2(length) + 1 change nothing)"),
                      help="fixed-stack depth, 0-4096 (default: one layer short)")
    demo.set_defaults(func=cmd_demo)


def cmd_params(args) -> int:
    if args.match or args.shared or args.preset in acc.PRESETS:
        return _params_encdec(args)
    if args.built:
        raise PhaseloopError(f"--built applies to the encoder-decoder presets ({', '.join(acc.PRESETS)}); "
                             "a decoder-only preset is always counted from its built model")
    names = list(PRESETS) if args.all else [args.preset or registry.default_preset()]
    rows = []
    for n in names:
        try:
            cfg = ModelConfig.from_preset(n, **parse_overrides(args.set))
        except ConfigError as e:  # with --all: which preset the --set does not fit
            raise (ConfigError(f"preset {n}: {e}") if args.all else e) from None
        rows.append(count_params(cfg, args.seq_len) | {"preset": n})
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
              f"d_ff = {4 * res['d']}, {res['model']['total']:,} parameters")
        b = res["buildable"]
        if b["d"] != res["d"]:  # d = 979 counts; its 8 heads divide 976
            print(f"(its {b['n_heads']} heads need a width they divide: d = {b['d']}, d_ff = {4 * b['d']}, "
                  f"{b['model']['total']:,} parameters, is the nearest that can be built)")
        print()
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


def cmd_archs(args) -> int:
    """Every registered architecture (``registry``), built in or a plugin's."""
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
    print(render_demo(args.length, seed=args.seed, n_layers=args.layers))
    return 0
