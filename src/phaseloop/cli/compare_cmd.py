"""``phaseloop compare``: train every (variant, seed) of a recipe, then report."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from phaseloop import compare
from phaseloop.cli import argtypes
from phaseloop.cli.options import launcher_options
from phaseloop.compare.dryrun import dry_run
from phaseloop.engine import dist


def add_parsers(sub) -> None:
    """``phaseloop compare``."""
    cmp = sub.add_parser("compare", help="train model variants over seeds and report (default: the quick recipe)")
    cmp.add_argument("recipe", nargs="?", help="recipe .toml/.json (see recipes/) or a built-in name; default quick")
    cmp.add_argument("--out", help="comparison folder (default runs/compare-NAME); rerun to resume")
    cmp.add_argument("--variants", nargs="+", metavar="VARIANT",
                     help="recipe variant names or specs: ARCH[+MODIFIER] [KEY=VALUE ...] or a preset "
                     "(phaseloop archs lists architectures and modifiers)")
    cmp.add_argument("--seeds", type=argtypes.seed_list, help="comma-separated seeds, e.g. 0,1")
    cmp.add_argument("--steps", type=argtypes.positive_int, help="optimizer steps per run")
    cmp.add_argument("--data", help="a file or folder, stdlib | shakespeare | hf:NAME[:CONFIG]")
    cmp.add_argument("--tokenizer", help="bytes, a tokenizer.json / folder, or a trained name")
    cmp.add_argument("--match", choices=("none", "params", "flops", "depth"),
                     help="resize variants to the reference's parameters, FLOPs/token or depth")
    cmp.add_argument("--quiet", action="store_true", help="no progress bar")
    cmp.add_argument("--dry-run", action="store_true", help="build every variant at full size on the "
                     "meta device, count it, train 2 steps at a shrunk shape; write nothing")
    launcher_options(cmp)
    cmp.set_defaults(func=cmd_compare)


def cmd_compare(args) -> int:
    """Train every (variant, seed) of a recipe, then write summary.json, report.md, plots."""
    if args.recipe is None and args.out and (args.report or args.status):
        recipe = compare.stored_recipe(Path(args.out))  # the comparison there, not the built-in quick one
    else:
        recipe = compare.load_recipe(args.recipe)
    recipe = compare.apply_overrides(recipe, args.variants, args.seeds, args.steps, args.data,
                                     args.match, log=dist.say, tokenizer=args.tokenizer)
    if args.dry_run:
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
