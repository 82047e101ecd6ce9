"""`phaseloop` command line: a thin layer over the library functions.

One module per family of subcommands, each holding its parsers (``add_parsers``) beside
its ``cmd_*`` functions; ``options`` has what they share, ``exits`` how a command fails.

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

from safetensors import SafetensorError

from phaseloop import _startup, registry
from phaseloop.cli import compare_cmd, info_cmds, run_cmds, serve_cmd, ship_cmds, task_cmd, tool_cmds, train_cmd
from phaseloop.cli.exits import fail, interrupted
from phaseloop.cli.options import Parser, on_a_run  # noqa: F401  (on_a_run: plugins' commands use it)
from phaseloop.engine import dist
from phaseloop.engine.trainer import DivergedError, PeerFailed
from phaseloop.errors import ConfigError, PhaseloopError, first_line, raise_terminated, was_terminated
from phaseloop.files import as_os_error

DISTRIBUTED = ("train", "compare")  # the commands that run across torchrun's processes
# the order of `phaseloop --help`
COMMANDS = (train_cmd, run_cmds, info_cmds, compare_cmd, task_cmd, ship_cmds, serve_cmd, tool_cmds)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="phaseloop", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in COMMANDS:
        module.add_parsers(sub)
    for spec in registry.all_archs():  # an architecture's own commands (3PT: angles, zero-sum)
        try:
            add = registry.commands_of(spec)
            if add is not None:
                add(sub)
        except Exception as e:  # a plugin's hook (or a command name phaseloop has: argparse's conflict)
            raise ConfigError(f"the architecture plugin providing {spec.name!r} failed to add its commands "
                              f"({type(e).__name__}: {first_line(e, 120)}); reinstall or uninstall it") from None
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # loads the installed architecture plugins
    except PhaseloopError as e:
        return fail(f"phaseloop: error: {e}", 2)
    args = parser.parse_args(argv)
    try:
        previous = signal.signal(signal.SIGTERM, raise_terminated)
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
        return fail(f"phaseloop: error: {e}", 3)
    except PeerFailed as e:
        return fail(f"phaseloop: error: {e}", 4)
    except PhaseloopError as e:
        return fail(f"phaseloop: error: {e}", 2)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): no error of the input, no message
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
        return 141  # as a process killed by SIGPIPE
    except (OSError, SafetensorError) as e:  # the file system said no: name the file, no traceback
        if not isinstance(e, OSError):  # safetensors' own error, not turned into an OSError where
            e = as_os_error(e, None, "safetensors failed")  # phaseloop wrote or read the file
        where = f"{e.filename}: " if e.filename else ""
        return fail(f"phaseloop: error: {where}{e.strerror or e}; check the path, its permissions "
                    "and free space", 2)
    except KeyboardInterrupt as e:
        terminated = was_terminated(e)
        return fail(f"phaseloop: {interrupted(e, args.command, 'terminated' if terminated else 'interrupted')}",
                    143 if terminated else 130)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if sys.stdout is not stdout:
            sys.stdout.close()
            sys.stdout = stdout
        dist.close()
