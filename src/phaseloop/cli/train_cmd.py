"""``phaseloop train``: resolve a run once (a preset or a config file, flags over it, a
resumed run's own settings), then print it (``--print-config``) or train it."""

from __future__ import annotations

import json
import sys

from phaseloop import registry
from phaseloop.cli import trainflags
from phaseloop.cli.options import data_options, parse_overrides
from phaseloop.engine import dist
from phaseloop.lm.runconfig import resolve_run, train_run


def add_parsers(sub) -> None:
    """``phaseloop train``."""
    train = sub.add_parser("train", help="train a model on a data source")
    train.add_argument("--config", metavar="FILE", help="a TOML file of [model], [train] and [data] settings "
                       "(--print-config writes one); flags override it")
    train.add_argument("--print-config", action="store_true", help="print the resolved configuration as "
                       "TOML (a --config file) and exit: nothing is trained, no data is read")
    train.add_argument("--preset", help="model preset (phaseloop params --all lists them; default "
                       f"{registry.default_preset()}); replaces a --config file's")
    train.add_argument("--arch", help="an architecture at its own defaults instead of a preset "
                       "(phaseloop archs lists the registered ones, plugins included)")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
    train.add_argument("--out", help="run folder (default runs/PRESET-TIMESTAMP)")
    train.add_argument("--resume", action="store_true", help="continue the run in --out")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    data_options(train)
    trainflags.add_train_flags(train)
    train.set_defaults(func=cmd_train)


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
            dist.say(note)
        sys.stdout.write(spec.to_toml())
        return 0
    summary = train_run(spec, progress=not args.quiet, log=dist.say)
    print(json.dumps({k: summary[k] for k in ("run", "step", "params", "val_loss", "val_bpb",
                                              "val_ppl", "tok_per_s") if k in summary}, indent=2))
    return 0
