"""What the subcommands' parsers share: the parser class (one-line errors, exit 2, rank 0
only under torchrun), a subcommand that reads a run, and the option groups several
commands take (depth, exits, data, launchers), plus ``--set KEY=VALUE``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from phaseloop.analysis import plots
from phaseloop.cli import argtypes
from phaseloop.cli.exits import fail, rank
from phaseloop.decoding import MAX_DRAFT_TOKENS
from phaseloop.errors import PhaseloopError
from phaseloop.files import check_out_dir
from phaseloop.lm.train import check_seq_len


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too); rank 0 only
        raise SystemExit(fail(f"{self.prog}: error: {message} (see {self.prog} --help)", 2))

    def _print_message(self, message, file=None):  # --help, usage: once under torchrun (rank 0)
        if rank() == 0:
            super()._print_message(message, file)

    def _get_option_tuples(self, option_string):
        # a prefix of two spellings of one flag (--warm: --warmup, --warmup-steps) is not ambiguous
        found: dict = {}
        for t in super()._get_option_tuples(option_string):
            found.setdefault(id(t[0]), t)
        return list(found.values())


def on_a_run(sub, name: str, hlp: str, func, *, data: bool = True, windows: int | None = None,
             seq_len: bool = True, device: bool = True) -> argparse.ArgumentParser:
    """A subcommand that reads a trained run, with the options such commands share."""
    p = sub.add_parser(name, help=hlp)
    p.add_argument("run", help="run folder (or its checkpoint folder)")
    if data:
        p.add_argument("--data", help="data source (default: the run's own)")
    if windows is not None:
        # None when not given, so that a command can refuse it where it does not apply (eval --tasks)
        p.add_argument("--windows", type=argtypes.positive_int, help=f"evaluation windows (default {windows})")
        p.set_defaults(default_windows=windows)
        if seq_len:
            p.add_argument("--seq-len", type=argtypes.seq_len_int, help="window length (default: the run's)")
    if device:
        p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.set_defaults(func=func)
    return p


def windows_of(args) -> int:
    """``--windows``, or the subcommand's default when it was not given (``on_a_run``)."""
    return args.windows if args.windows is not None else args.default_windows


def run_seq_len(args, run_cfg: dict, cfg) -> int:
    """The windows a command reads a run's data in: ``--seq-len``, else the run's training
    length, else the model's ``max_seq_len``; longer than ``max_seq_len`` is refused."""
    seq_len = args.seq_len or run_cfg["train"].get("seq_len") or cfg.max_seq_len
    check_seq_len(seq_len, cfg)
    return seq_len


def png_path(flag: str, value, example: str) -> Path:
    """A PNG file to write, refused before anything is computed or written when it is a
    folder or its folder cannot be written (matplotlib missing too: ``plots.pyplot``)."""
    plots.pyplot()
    path = Path(value)
    if path.is_dir():
        raise PhaseloopError(f"{flag} {path} is a folder; name the PNG file to write (e.g. {path / example})")
    check_out_dir(path.parent, flag)
    return path


def depth_options(p, sweep: bool = False) -> None:
    """--depth: UT steps (ACT: the step limit) or loop passes at inference."""
    p.add_argument("--depth", type=argtypes.depth_list if sweep else argtypes.depth_int,
                   metavar="K[,K...]" if sweep else "K",
                   help="run the weight-tied trunk at this depth: UT steps, loop passes"
                   + (" (a comma list sweeps: one row per depth)" if sweep else ""))
    p.add_argument("--extend-loops", choices=("last",), help="past a Hyperloop's trained loops, "
                   "reuse the last loop's parameters (refused otherwise)")


class _OneRule(argparse.Action):
    """--exit where one rule applies (generate, serve): a second is refused, not dropped
    (eval's --exit takes several, so a user may expect them to combine)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            raise argparse.ArgumentError(self, "given twice: this command applies one exit rule (eval "
                                         "compares several); keep one --exit")
        setattr(namespace, self.dest, values)


def exit_options(p, sweep: bool = False) -> None:
    """--exit: early exit per position at inference (early_exit.py)."""
    p.add_argument("--exit", type=argtypes.exit_rules, action="append" if sweep else _OneRule,
                   metavar="RULE:V[,V...]" if sweep else "RULE:V",
                   help="stop a position early: kl:EPS (next-token KL between passes, Huginn's), kl-lens:EPS "
                   "(the same read by the head alone), entropy:EPS (entropy change), argmax:K (argmax kept K "
                   "passes), state:EPS (relative state change), accel:EPS (second-order, two hits), "
                   "act:THRESHOLD (UT+ACT); docs/early_exit.md"
                   + ("; values separated by commas sweep, repeat for more rules" if sweep else ""))


def inference_options(p, sweep: bool = False) -> None:
    """--kv-fill, --kv-share (and generate's --speculative): a weight-tied trunk's decoding
    options (``phaseloop.inference``, docs/inference.md)."""
    p.add_argument("--kv-fill", choices=("recompute", "latest"), default="recompute",
                   help="with --exit, the keys/values of the passes an exited position skips: recompute "
                   "(projected from its frozen state; default) or latest (its deepest ones, Huginn)")
    p.add_argument("--kv-share", type=argtypes.share_list if sweep else argtypes.positive_int,
                   metavar="K[,K...]" if sweep else "K",
                   help="pass i reads and writes KV slot i mod K (Huginn §6.2): K slots per looped layer"
                   + (" (a list sweeps, 'full' = one per pass; evaluated token by token)" if sweep else ""))
    if not sweep:
        p.add_argument("--speculative", type=argtypes.positive_int, metavar="D",
                       help="self-speculative decoding: draft with D passes, verify at the full depth")
        p.add_argument("--draft-tokens", type=argtypes.int_in(1, MAX_DRAFT_TOKENS), metavar="K",
                       help=f"--speculative: tokens drafted per round (default 4, at most {MAX_DRAFT_TOKENS})")


def data_options(p) -> None:
    """train's data flags: default None (not given), so a config file or a resumed run's
    own settings apply (runconfig.DATA_DEFAULTS otherwise)."""
    g = p.add_argument_group("data (a config file's [data])")
    g.add_argument("--data", help="a file or folder (.txt, .jsonl, .parquet, .arrow, WikiText raw), "
                   "stdlib (default), shakespeare, or hf:NAME[:CONFIG]")
    g.add_argument("--tokenizer", help="bytes (default), a tokenizer.json or a folder holding one, "
                   "or a name trained with `phaseloop tokenizer train --name`")
    g.add_argument("--text-column", help="column of .jsonl/.parquet/.arrow/hf data (default: text)")
    g.add_argument("--data-split", help="split of an hf: dataset (default: train)")
    g.add_argument("--streaming", action=argparse.BooleanOptionalAction,
                   help="stream an hf: dataset (no full download; default: no)")
    g.add_argument("--doc-sep", metavar="TEXT", help="put this token between documents in the token store "
                   "(text of exactly one token, e.g. <|endoftext|> of a BPE, or $'\\n' for bytes; default: "
                   "the source's own joiner)")


def launcher_options(p) -> None:
    """compare's launchers (docs/compare.md); defaults None: the recipe's [launcher] table."""
    g = p.add_argument_group("launchers (a recipe's [launcher] table)")
    g.add_argument("--launcher", choices=("sequential", "local", "slurm"),
                   help="sequential (default: one run after another here), local (--jobs worker "
                   "processes, each on its own GPU or cores) or slurm (one array task per run)")
    g.add_argument("--jobs", type=argtypes.positive_int,
                   help="local: runs at once (default: GPUs / --nproc-per-run, 1 on CPU)")
    g.add_argument("--nproc-per-run", type=argtypes.positive_int, help="processes (GPUs) per run, under torchrun")
    g.add_argument("--partition", help="slurm: partition")
    g.add_argument("--time", type=argtypes.positive_int, metavar="MINUTES",
                   help="slurm: time limit per task; then it is requeued and resumes")
    g.add_argument("--gpus-per-task", type=argtypes.nonneg_int, help="slurm: GPUs per array task (= per run)")
    g.add_argument("--cpus-per-task", type=argtypes.positive_int, help="slurm: CPUs per Slurm task")
    g.add_argument("--account", help="slurm: account to charge")
    g.add_argument("--sbatch", action="append", metavar="--KEY=VALUE",
                   help="slurm: an extra sbatch option (repeat), e.g. --sbatch=--qos=high")
    g.add_argument("--wait", action="store_true", default=None,
                   help="slurm: wait for every task, then write the report")
    g.add_argument("--status", action="store_true", help="which runs of --out are done, running, "
                   "pending or failed; trains nothing")
    g.add_argument("--report", action="store_true", help="write the report from the runs finished "
                   "so far; trains nothing")


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
