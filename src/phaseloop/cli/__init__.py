"""`phaseloop` command line: a thin layer over the library functions (``commands``).

Exit status (docs/reliability.md): 0 done; 2 bad input or a refused / damaged file (one
line `phaseloop: error: ...`, nothing changed); 3 training diverged (non-finite loss);
4 another process of a torchrun world failed; 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM); anything else is a bug.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ..engine import dist
from ..engine.trainer import DivergedError, Interrupted, PeerFailed

DISTRIBUTED = ("train", "compare")  # the commands that run across torchrun's processes
from safetensors import SafetensorError

from .. import _startup, registry
from ..errors import PhaseloopError
from ..files import as_os_error
from . import argtypes as T
from . import commands as C
from . import task_commands as K
from .trainflags import add_train_flags


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too); rank 0 only
        raise SystemExit(_fail(f"{self.prog}: error: {message} (see {self.prog} --help)", 2))

    def _print_message(self, message, file=None):  # --help, usage: once under torchrun (rank 0)
        if _rank() == 0:
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
        p.add_argument("--windows", type=T.positive_int, default=windows, help="evaluation windows")
        if seq_len:
            p.add_argument("--seq-len", type=T.seq_len_int, help="window length (default: the run's)")
    if device:
        p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.set_defaults(func=func)
    return p


def _depth_options(p, sweep: bool = False) -> None:
    """--depth: UT steps (ACT: the step limit) or loop passes at inference (issue 25)."""
    p.add_argument("--depth", type=T.depth_list if sweep else T.depth_int,
                   metavar="K[,K...]" if sweep else "K",
                   help="run the weight-tied trunk at this depth: UT steps, loop passes"
                   + (" (a comma list sweeps: one row per depth)" if sweep else ""))
    p.add_argument("--extend-loops", choices=("last",), help="past a Hyperloop's trained loops, "
                   "reuse the last loop's parameters (refused otherwise)")


def _exit_options(p, sweep: bool = False) -> None:
    """--exit: early exit per position at inference (issue 25, early_exit.py)."""
    p.add_argument("--exit", type=T.exit_rules, action="append" if sweep else None,
                   metavar="RULE:V[,V...]" if sweep else "RULE:V",
                   help="stop a position early: kl:EPS (next-token KL between passes), argmax:K "
                   "(argmax kept K passes), state:EPS (relative state change), act:THRESHOLD "
                   "(UT+ACT)" + ("; values separated by commas sweep, repeat for more rules"
                                 if sweep else ""))


def _data_options(p) -> None:
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


def _launcher_options(p) -> None:
    """compare's launchers (docs/compare.md); defaults None: the recipe's [launcher] table."""
    g = p.add_argument_group("launchers (a recipe's [launcher] table)")
    g.add_argument("--launcher", choices=("sequential", "local", "slurm"),
                   help="sequential (default: one run after another here), local (--jobs worker "
                   "processes, each on its own GPU or cores) or slurm (one array task per run)")
    g.add_argument("--jobs", type=T.positive_int, help="local: runs at once (default: GPUs / --nproc-per-run, 1 on CPU)")
    g.add_argument("--nproc-per-run", type=T.positive_int, help="processes (GPUs) per run, under torchrun")
    g.add_argument("--partition", help="slurm: partition")
    g.add_argument("--time", type=T.positive_int, metavar="MINUTES",
                   help="slurm: time limit per task; then it is requeued and resumes")
    g.add_argument("--gpus-per-task", type=T.nonneg_int, help="slurm: GPUs per array task (= per run)")
    g.add_argument("--cpus-per-task", type=T.positive_int, help="slurm: CPUs per Slurm task")
    g.add_argument("--account", help="slurm: account to charge")
    g.add_argument("--sbatch", action="append", metavar="--KEY=VALUE",
                   help="slurm: an extra sbatch option (repeat), e.g. --sbatch=--qos=high")
    g.add_argument("--wait", action="store_true", default=None,
                   help="slurm: wait for every task, then write the report")
    g.add_argument("--status", action="store_true", help="which runs of --out are done, running, "
                   "pending or failed; trains nothing")
    g.add_argument("--report", action="store_true", help="write the report from the runs finished "
                   "so far; trains nothing")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="phaseloop", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a model on a data source")
    t.add_argument("--config", metavar="FILE", help="a TOML file of [model], [train] and [data] settings "
                   "(--print-config writes one); flags override it")
    t.add_argument("--print-config", action="store_true", help="print the resolved configuration as "
                   "TOML (a --config file) and exit: nothing is trained, no data is read")
    t.add_argument("--preset", help="model preset (phaseloop params --all lists them; default "
                   f"{registry.default_preset()}); replaces a --config file's")
    t.add_argument("--arch", help="an architecture at its own defaults instead of a preset "
                   "(phaseloop archs lists the registered ones, plugins included)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
    t.add_argument("--out", help="run folder (default runs/PRESET-TIMESTAMP)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    _data_options(t)
    add_train_flags(t)
    t.set_defaults(func=C.cmd_train)

    e = on_a_run(sub, "eval", "validation loss / perplexity / bits per byte of a run", C.cmd_eval,
                  windows=64)
    e.add_argument("--split", choices=("val", "all"), default="val",
                   help="val: the held-out tail; all: every token (e.g. a separate test file)")
    e.add_argument("--json", action="store_true")
    _depth_options(e, sweep=True)
    _exit_options(e, sweep=True)
    e.add_argument("--plot", metavar="PNG", help="with --depth: loss and BPB against depth; with "
                   "--exit: loss against mean depth; as a PNG")

    g = on_a_run(sub, "generate", "sample text from a run", C.cmd_generate, data=False)
    g.add_argument("--prompt", default="")
    g.add_argument("--max-new-tokens", type=T.nonneg_int, default=200)
    g.add_argument("--temperature", type=T.finite_float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=T.positive_int, default=None)
    g.add_argument("--seed", type=T.seed_int, default=0)
    g.add_argument("--no-cache", action="store_true", help="recompute the full prefix every token")
    _depth_options(g)
    _exit_options(g)

    c = sub.add_parser("params", help="parameter and FLOP counts of a preset (no weights allocated)")
    c.add_argument("--preset", help=f"preset name (default {registry.default_preset()})")
    c.add_argument("--all", action="store_true", help="every preset")
    c.add_argument("--set", action="append", metavar="KEY=VALUE")
    c.add_argument("--seq-len", type=T.seq_len_int, help="sequence length for FLOPs (default: the preset's)")
    c.add_argument("--json", action="store_true")
    c.add_argument("--match", metavar="PRESET",
                   help="UT §3: solve for the width d (d_ff=4d) with the parameters of PRESET "
                        "(transformer-base, ...); with --shared a weight-tied encoder-decoder")
    c.add_argument("--shared", action="store_true", help="with --match: one shared layer per side")
    c.add_argument("--built", action="store_true",
                   help="UT §3 presets: build the encoder-decoder (seq2seq.py, meta device) and "
                        "print its parameter and FLOP counts next to the closed form")
    c.set_defaults(func=C.cmd_params)

    r = sub.add_parser("archs", help="the registered architectures (built in and plugins): options, "
                       "presets, what n_layers counts")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=C.cmd_archs)

    m = sub.add_parser("compare", help="train model variants over seeds and report (default: the quick recipe)")
    m.add_argument("recipe", nargs="?", help="recipe .toml/.json (see recipes/) or a built-in name; default quick")
    m.add_argument("--out", help="comparison folder (default runs/compare-NAME); rerun to resume")
    m.add_argument("--variants", nargs="+", metavar="VARIANT",
                   help="recipe variant names or specs: ARCH[+MODIFIER] [KEY=VALUE ...] or a preset "
                   "(phaseloop archs lists architectures and modifiers)")
    m.add_argument("--seeds", type=T.seed_list, help="comma-separated seeds, e.g. 0,1")
    m.add_argument("--steps", type=T.positive_int, help="optimizer steps per run")
    m.add_argument("--data", help="a file or folder, stdlib | shakespeare | hf:NAME[:CONFIG]")
    m.add_argument("--tokenizer", help="bytes, a tokenizer.json / folder, or a trained name")
    m.add_argument("--match", choices=("none", "params", "flops", "depth"),
                   help="resize variants to the reference's parameters, FLOPs/token or depth")
    m.add_argument("--quiet", action="store_true", help="no progress bar")
    m.add_argument("--dry-run", action="store_true", help="build every variant at full size on the "
                   "meta device, count it, train 2 steps at a shrunk shape; write nothing")
    _launcher_options(m)
    m.set_defaults(func=C.cmd_compare)

    for name, hlp in (("task", "train/evaluate on an algorithmic task or a JSONL file (UT paper)"),
                      ("babi", "train/evaluate on bAbI QA tasks (UT paper)")):
        k = sub.add_parser(name, help=hlp)
        if name == "task":
            k.add_argument("--task", required=True, help="copy | reverse | addition | parity | "
                           "lte-copy | lte-double | lte-reverse | jsonl:PATH")
            k.add_argument("--train-len", help="training lengths, e.g. 1-20 (default; --paper: 40)")
            k.add_argument("--test-len", help="test lengths, e.g. 40,80 (default; --paper: 400)")
            k.add_argument("--paper", action="store_true", help="the paper's setting: train 40, test 400, "
                           "random position offsets for UT")
            k.add_argument("--offsets", help="max random start offset in training: an integer or auto")
            k.add_argument("--n-test", type=int, default=100, help="test examples per test length")
            k.add_argument("--test-file", help="JSONL test file for --task jsonl:PATH (default: 10%% held out)")
            k.add_argument("--tokenizer", help="jsonl tasks: encode with this tokenizer (default: characters)")
        else:
            k.add_argument("--tasks", default="1,2,3", help="task numbers, e.g. 1,2,3")
            k.add_argument("--data-dir", help="folder of qa*_train/test.txt (default $PHASELOOP_DATA_DIR/babi/en-1k)")
            k.add_argument("--joint", action="store_true", help="one model on all tasks (default: one per task)")
            k.add_argument("--max-sentences", default="20", help="keep the last N story sentences, or all")
            k.add_argument("--n-test", type=int, help="score the first N test questions per task (default all)")
        k.add_argument("--test-depth", type=T.depth_list, metavar="K[,K...]", help="also test at these "
                       "depths (UT steps, loop passes): " + ("accuracy per test length" if name == "task"
                                                             else "error per task") + " x depth")
        k.add_argument("--depth-sample", metavar="LO:HI", help="train each step at a depth drawn uniformly "
                       "from LO..HI (seeded by seed and step); tested at the trained depth")
        k.add_argument("--extend-loops", choices=("last",), help="--test-depth / --depth-sample past a "
                       "Hyperloop's trained loops: reuse the last loop's parameters")
        k.add_argument("--arch", help="any decoder arch (uses its -tiny preset), or an encoder-decoder: "
                       f"{' | '.join(registry.seq2seq_archs())}")
        k.add_argument("--preset", help="model preset (overrides the -tiny default)")
        k.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a model config field")
        k.add_argument("--steps", type=T.positive_int, help="optimizer steps (default 400)")
        k.add_argument("--batch-size", type=T.positive_int)
        k.add_argument("--lr", type=T.positive_float)
        k.add_argument("--seeds", type=T.seed_list, default="0", help="comma-separated seeds, e.g. 0,1")
        k.add_argument("--device", help="cpu (default) | auto | cuda[:N]")
        k.add_argument("--out", help="folder for the run folders (one per seed), metrics.json and the plot")
        k.add_argument("--resume", action="store_true", help="continue the run in --out (finished seeds "
                       "are reloaded, not retrained)")
        k.add_argument("--quiet", action="store_true")
        k.set_defaults(func=K.cmd_task if name == "task" else K.cmd_babi)

    q = on_a_run(sub, "quantize", "weight-only INT8/INT4 quantisation of a run, with validation "
                  "loss/BPB before and after", C.cmd_quantize, windows=64, seq_len=False)
    q.add_argument("--bits", type=int, choices=(8, 4), required=True)
    q.add_argument("--group-size", type=T.int_in(-1), default=128, help="input columns per scale "
                   "(-1: one per row; a layer it does not divide falls back to per row)")
    q.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="rtn: round to nearest; gptq: Frantar et al. 2022, Hessians of shared "
                   "layers pooled over all loop passes")
    q.add_argument("--calib-batches", type=T.positive_int, default=8, help="GPTQ calibration batches")
    q.add_argument("--calib-batch-size", type=T.positive_int, default=8)
    q.add_argument("--seed", type=T.seed_int, default=0, help="seed of the calibration windows")
    q.add_argument("--out", help="folder for the weights and report (default: the run folder)")

    x = on_a_run(sub, "export", "a run as a Hugging Face folder (AutoModelForCausalLM.from_pretrained)",
                  C.cmd_export, data=False, device=False)
    x.add_argument("--out", required=True, help="new (or empty) folder to write")
    x.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    x.add_argument("--quantized", metavar="FILE", help="a quant-*.safetensors of `phaseloop quantize`: "
                   "export its dequantised weights (the function the quantised model computes)")
    _depth_options(x)

    v = on_a_run(sub, "lm-eval", "lm-evaluation-harness on a run (local: lambada_local, "
                  "wikitext2_local)", C.cmd_lm_eval, data=False)
    v.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    v.add_argument("--include-path", help="a folder of extra lm-eval task YAMLs")
    v.add_argument("--limit", type=T.positive_float, help="examples per task (a fraction if < 1)")
    v.add_argument("--batch-size", type=int, default=8)  # harness.lm_eval_run checks it
    _depth_options(v)
    v.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    v.add_argument("--data-dir", help="folder holding lambada/ and wikitext-2/ (default $PHASELOOP_DATA_DIR)")

    k = sub.add_parser("tokenizer", help="train a BPE / word-level tokenizer; encode, decode, stats")
    ks = k.add_subparsers(dest="action", required=True, parser_class=_Parser)
    kt = ks.add_parser("train", help="train on a data source, write DIR/tokenizer.json")
    kt.add_argument("--data", default="stdlib", help="the data source (as train --data)")
    kt.add_argument("--kind", choices=("bpe", "wordlevel"), default="bpe",
                    help="byte-level BPE, or a word-level vocabulary with [UNK]")
    kt.add_argument("--vocab-size", type=T.int_in(2), default=8192, help="tokens in the vocabulary")
    kt.add_argument("--min-frequency", type=T.nonneg_int, default=2, help="bpe: rarest pair merged")
    kt.add_argument("--out", help="folder to write tokenizer.json into")
    kt.add_argument("--name", type=T.safe_name, help="keep it under this name ($PHASELOOP_CACHE/tokenizers/NAME)")
    for name, hlp in (("encode", "text -> token ids"), ("decode", "token ids -> text"),
                      ("stats", "tokens per byte of a data source")):
        p_ = ks.add_parser(name, help=hlp)
        p_.add_argument("-t", "--tokenizer", default="bytes", help="bytes, a tokenizer.json, a folder or a name")
        if name == "stats":
            p_.add_argument("--data", default="stdlib", help="the data source (as train --data)")
        else:
            p_.add_argument("text", nargs="+", help="the text" if name == "encode" else "token ids")
    for p_ in (kt, ks.choices["stats"]):
        p_.add_argument("--text-column", default="text")
        p_.add_argument("--data-split", default="train")
        p_.add_argument("--streaming", action="store_true")
        p_.add_argument("--quiet", action="store_true", help="no progress bar")
    k.set_defaults(func=C.cmd_tokenizer)

    d = sub.add_parser("demo", help="runnable explainer demos")
    d.add_argument("which", choices=["parity"], help="parity: the hand-set prefix-parity scan")
    d.add_argument("--length", type=T.positive_int, default=100)
    d.add_argument("--seed", type=T.seed_int, default=0)
    d.add_argument("--layers", type=T.nonneg_int, help="fixed-stack depth (default: one layer short)")
    d.set_defaults(func=C.cmd_demo)

    x = sub.add_parser("explore", help="a local web app: the Learn pages, runs, inside a model "
                       "(needs the explore extra)")
    x.add_argument("paths", nargs="*", metavar="RUN_OR_COMPARE_DIR", help="folders to serve (none: Learn only)")
    x.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    x.add_argument("--port", type=T.int_in(0, 65535), default=0, help="0 or a taken port: a free one")
    x.add_argument("--no-browser", action="store_true", help="print the URL only")
    x.set_defaults(func=C.cmd_explore)

    for spec in registry.all_archs():  # an architecture's own commands (3PT: angles, zero-sum)
        if spec.commands is not None:
            spec.commands(sub)
    return p


def _rank() -> int:
    """This process's rank: the process group's, or before it is joined (argparse, bad
    input found before training) torchrun's RANK; 0 without torchrun."""
    w = dist.world()
    if w.size > 1:
        return w.rank
    try:
        return int(os.environ.get("RANK", "0")) if dist.launched() else 0
    except ValueError:
        return 0


def _say(msg: str) -> None:
    """One line on stderr, on a line of its own even after a progress bar (rank 0 of a
    torchrun world only: every rank meets the same error)."""
    if _rank() != 0:
        return
    sys.stderr.write(("\n" if sys.stderr.isatty() else "") + msg + "\n")
    sys.stderr.flush()


def _tell_torchrun(msg: str, code: int) -> None:
    """Under torchrun (which sets TORCHELASTIC_ERROR_FILE for each worker), write the line
    and the exit status to the error file torchrun reads: its failure summary then shows
    ``traceback : phaseloop: error: ...`` and ``exitcode : 2`` for the root cause instead of
    a pointer to its docs, and a scheduler reading torchrun's own error file gets both
    (torchrun copies the root cause's file there with errorCode = the exit status)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    data = {"message": {"message": msg, "errorCode": code,
                        "extraInfo": {"py_callstack": msg, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # torchrun then says "To enable traceback see ..."; rank 0 printed the line


PEER_EXIT_DELAY_S = 3.0  # under torchrun, how long a rank > 0 waits before it exits failed


def _fail(msg: str, code: int) -> int:
    """The end of a failed command: one line (rank 0), torchrun told; returns ``code``.
    Every rank of a torchrun world meets the same bad input at about the same moment; the
    others wait a little before exiting so rank 0 prints its line and is the root cause
    of torchrun's summary (torchrun stops the remaining ranks when the first one exits)."""
    _say(msg)
    _tell_torchrun(msg, code)
    if _rank() != 0:
        import time

        try:  # torchrun's SIGTERM ends the wait quietly: the line is said and recorded
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread
            pass
        time.sleep(PEER_EXIT_DELAY_S)
    return code


def _interrupted(e: KeyboardInterrupt, command: str, what: str) -> str:
    again = "rerun the same command" + (" with --resume" if command in ("train", "task", "babi") else "")
    if isinstance(e, Interrupted):
        if e.saved is None:
            return f"{what} at step {e.step}, before the first checkpoint; {again} to start again"
        return f"{what} at step {e.step}; the checkpoint of step {e.saved} is intact ({again} to continue)"
    return f"{what}; checkpoints already written are intact ({again} to continue)"


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler preempting the job): handled as Ctrl-C, exit 143."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # loads the installed architecture plugins
    except PhaseloopError as e:
        return _fail(f"phaseloop: error: {e}", 2)
    args = parser.parse_args(argv)
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    stdout = sys.stdout
    try:
        if dist.launched() and args.command in DISTRIBUTED:
            if not dist.init(getattr(args, "device", None) or "auto").main:
                sys.stdout = open(os.devnull, "w")  # rank 0 reports
        _startup.uninstall()  # from here on Ctrl-C is reported below (exit 130)
        return args.func(args)
    except DivergedError as e:
        return _fail(f"phaseloop: error: {e}", 3)
    except PeerFailed as e:
        return _fail(f"phaseloop: error: {e}", 4)
    except PhaseloopError as e:
        return _fail(f"phaseloop: error: {e}", 2)
    except (OSError, SafetensorError) as e:  # the file system said no: name the file, no traceback
        if not isinstance(e, OSError):  # safetensors' own error, not turned into an OSError where
            e = as_os_error(e, None, "safetensors failed")  # phaseloop wrote or read the file
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"phaseloop: error: {where}{e.strerror or e}; check the path, its permissions "
                     "and free space", 2)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, _Terminated) or isinstance(e.__context__, _Terminated)
        return _fail(f"phaseloop: {_interrupted(e, args.command, 'terminated' if terminated else 'interrupted')}",
                     143 if terminated else 130)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if sys.stdout is not stdout:
            sys.stdout.close()
            sys.stdout = stdout
        dist.close()
