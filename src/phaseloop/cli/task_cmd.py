"""The task subcommands (the UT paper's experiments): ``phaseloop task`` (algorithmic
tasks or a JSONL file, over seeds) and ``phaseloop babi`` (the bAbI QA tasks)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from phaseloop import registry
from phaseloop.analysis import plots
from phaseloop.cli import argtypes
from phaseloop.cli.options import parse_overrides
from phaseloop.engine import resolve_device
from phaseloop.errors import PhaseloopError
from phaseloop.tasks.babi_runner import run_babi_seeds
from phaseloop.tasks.report import (
    format_babi_depth_table,
    format_babi_table,
    format_depth_table,
    format_table,
    model_label,
    task_title,
)
from phaseloop.tasks.runner import run_task, task_model_config
from phaseloop.tasks.task_model import task_train_config


def add_parsers(sub) -> None:
    """``phaseloop task``, ``babi``."""
    for name, hlp in (("task", "train/evaluate on an algorithmic task or a JSONL file (UT paper)"),
                      ("babi", "train/evaluate on bAbI QA tasks (UT paper)")):
        task = sub.add_parser(name, help=hlp)
        if name == "task":
            task.add_argument("--task", required=True, help="copy | reverse | addition | parity | "
                              "lte-copy | lte-double | lte-reverse | jsonl:PATH")
            task.add_argument("--train-len", help="training lengths, e.g. 1-20 (default; --paper: 40)")
            task.add_argument("--test-len", help="test lengths, e.g. 40,80 (default; --paper: 400)")
            task.add_argument("--paper", action="store_true", help="the paper's setting: train 40, test 400, "
                              "random position offsets for UT")
            task.add_argument("--offsets", help="max random start offset in training: an integer or auto")
            task.add_argument("--n-test", type=int, help="test examples per test length (default 100; "
                              "a JSONL task tests its whole test file)")
            task.add_argument("--test-file", help="JSONL test file for --task jsonl:PATH (default: 10%% held out)")
            task.add_argument("--tokenizer", help="jsonl tasks: encode with this tokenizer (default: characters)")
        else:
            task.add_argument("--tasks", default="1,2,3", help="task numbers, e.g. 1,2,3")
            task.add_argument("--data-dir",
                              help="folder of qa*_train/test.txt (default $PHASELOOP_DATA_DIR/babi/en-1k)")
            task.add_argument("--joint", action="store_true", help="one model on all tasks (default: one per task)")
            task.add_argument("--max-sentences", default="20", help="keep the last N story sentences, or all")
            task.add_argument("--n-test", type=int, help="score the first N test questions per task (default all)")
        task.add_argument("--test-depth", type=argtypes.depth_list, metavar="K[,K...]", help="also test at these "
                          "depths (UT steps, loop passes): " + ("accuracy per test length" if name == "task"
                                                             else "error per task") + " x depth")
        task.add_argument("--depth-sample", metavar="LO:HI", help="train each step at a depth drawn uniformly "
                          "from LO..HI (seeded by seed and step); tested at the trained depth")
        task.add_argument("--extend-loops", choices=("last",), help="--test-depth / --depth-sample past a "
                          "Hyperloop's trained loops: reuse the last loop's parameters")
        task.add_argument("--arch", help="any decoder arch (uses its -tiny preset), or an encoder-decoder: "
                          f"{' | '.join(registry.seq2seq_archs())}")
        task.add_argument("--preset", help="model preset (overrides the -tiny default)")
        task.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
        task.add_argument("--steps", type=argtypes.positive_int, help="optimizer steps (default 400)")
        task.add_argument("--batch-size", type=argtypes.positive_int)
        task.add_argument("--lr", type=argtypes.positive_float)
        task.add_argument("--seeds", type=argtypes.seed_list, default="0", help="comma-separated seeds, e.g. 0,1")
        task.add_argument("--device", help="cpu (default) | auto | cuda[:N]")
        task.add_argument("--out", help="folder for the run folders (one per seed), metrics.json and the plot")
        task.add_argument("--resume", action="store_true", help="continue the run in --out (finished seeds "
                          "are reloaded, not retrained)")
        task.add_argument("--quiet", action="store_true")
        task.set_defaults(func=cmd_task if name == "task" else cmd_babi)


def _task_setup(args):

    if args.extend_loops and not (args.test_depth or args.depth_sample):
        raise PhaseloopError("--extend-loops applies with --test-depth or --depth-sample; add --test-depth "
                             "K[,K...] or --depth-sample LO:HI")
    cfg, arch = task_model_config(args.arch, args.preset, parse_overrides(args.set))
    device = str(resolve_device(args.device or "cpu"))
    depth = {"depth_sample": args.depth_sample, "extend_loops": args.extend_loops} if args.depth_sample else {}
    tc = task_train_config(device=device, **depth, **{k: v for k, v in (
        ("steps", args.steps), ("batch_size", args.batch_size), ("lr", args.lr)) if v is not None})
    items = [s.strip() for s in args.seeds.split(",")]
    if not all(s.isdecimal() for s in items):
        raise PhaseloopError(f"bad --seeds {args.seeds!r}; write integers like 0,1")
    seeds = [int(s) for s in items]
    if len(set(seeds)) != len(seeds):
        again = next(s for i, s in enumerate(seeds) if s in seeds[:i])
        raise PhaseloopError(f"--seeds {args.seeds}: seed {again} is repeated; name each seed once")
    return cfg, arch, tc, seeds


def _task_out(args, kind: str) -> Path:
    if args.resume and not args.out:
        raise PhaseloopError("--resume needs --out, the folder of the run to continue")
    if args.out == "":
        raise PhaseloopError("--out '': name a folder for the run (or drop --out for runs/KIND-TIME)")
    return Path(args.out or f"runs/{kind}-{time.strftime('%Y%m%d-%H%M%S')}")


def cmd_task(args) -> int:
    """Algorithmic task (or a JSONL file): train over seeds; table, metrics.json, plot."""

    given = [f for f, v in (("--train-len", args.train_len), ("--test-len", args.test_len),
                            ("--n-test", args.n_test), ("--paper", args.paper or None)) if v is not None]
    if args.task.startswith("jsonl:") and given:
        raise PhaseloopError(f"{'/'.join(given)}: --train-len/--test-len/--n-test/--paper set the lengths and "
                             "test examples of algorithmic tasks; a JSONL task's are those in its files: drop "
                             + ("it" if len(given) == 1 else "them"))
    cfg, arch, tc, seeds = _task_setup(args)
    train_len = args.train_len or ("40" if args.paper else "1-20")
    test_len = args.test_len or ("400" if args.paper else "40,80")
    spec = registry.seq2seq_archs().get(arch) or cfg.spec  # the paper's offsets where it used them
    offsets = args.offsets if args.offsets is not None else (
        "auto" if args.paper and spec.task_offsets else "0")
    if offsets != "auto" and not offsets.isdecimal():
        raise PhaseloopError(f"bad --offsets {offsets!r}; write auto or an integer >= 0")
    out = _task_out(args, f"task-{args.task.split(':')[0]}-{model_label(cfg, arch)}")
    n_test = 100 if args.n_test is None else args.n_test
    res = run_task(args.task, cfg, tc, seeds, train_len, test_len, out, n_test=n_test,
                   test_file=args.test_file, offsets=offsets if offsets == "auto" else int(offsets),
                   arch=arch, log=None if args.quiet else print, resume=args.resume,
                   tokenizer=args.tokenizer, test_depths=args.test_depth or (),
                   extend_loops=args.extend_loops)
    print(format_table(res["summary"], task_title(res)))
    if args.test_depth:
        print(format_depth_table(res["summary"]))
    print(f"wrote {out / 'metrics.json'}" + (f" and {out / 'accuracy_vs_length.png'}" if res["plot"]
                                              else f" (no plot: {plots.MISSING})"))
    return 0


def cmd_babi(args) -> int:
    """bAbI QA: error per task, failed tasks, ponder time by supporting facts."""

    cfg, arch, tc, seeds = _task_setup(args)
    data_dir = args.data_dir or Path(os.environ.get("PHASELOOP_DATA_DIR", "data")) / "babi" / "en-1k"
    try:
        tasks = [int(t) for t in args.tasks.split(",")]
    except ValueError:
        raise PhaseloopError(f"bad --tasks {args.tasks!r}; write task numbers like 1,2,3") from None
    window = None if args.max_sentences == "all" else args.max_sentences
    if window is not None and not window.isdecimal():
        raise PhaseloopError(f"bad --max-sentences {window!r}; write an integer or all")
    out = _task_out(args, f"babi-{arch or cfg.arch}")
    res = run_babi_seeds(cfg, data_dir, tasks, tc, seeds, args.joint, window and int(window), out, arch,
                         log=None if args.quiet else print, max_test=args.n_test, resume=args.resume,
                         test_depths=args.test_depth or (), extend_loops=args.extend_loops)
    print(format_babi_table(res))
    if args.test_depth:
        print(format_babi_depth_table(res))
    print(f"wrote {out / 'metrics.json'}")
    return 0
