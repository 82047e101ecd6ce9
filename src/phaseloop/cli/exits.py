"""How a command ends when it fails: one line on stderr (rank 0 of a torchrun world),
torchrun told the line and the status, and the exit status (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from phaseloop.engine import dist
from phaseloop.engine.trainer import Interrupted

PEER_EXIT_DELAY_S = 3.0  # under torchrun, how long a rank > 0 waits before it exits failed


def rank() -> int:
    """This process's rank: the process group's, or before it is joined (argparse, bad
    input found before training) torchrun's RANK; 0 without torchrun."""
    w = dist.world()
    if w.size > 1:
        return w.rank
    try:
        return int(os.environ.get("RANK", "0")) if dist.launched() else 0
    except ValueError:
        return 0


def say(msg: str) -> None:
    """One line on stderr, on a line of its own even after a progress bar (rank 0 of a
    torchrun world only: every rank meets the same error)."""
    if rank() != 0:
        return
    sys.stderr.write(("\n" if sys.stderr.isatty() else "") + msg + "\n")
    sys.stderr.flush()


def tell_torchrun(msg: str, code: int) -> None:
    """Under torchrun (which sets TORCHELASTIC_ERROR_FILE for each worker), write the line
    and the exit status to the error file torchrun reads: its failure summary then shows
    ``traceback : phaseloop: error: ...`` and ``exitcode : 2`` for the root cause instead of
    a pointer to its docs, and a scheduler reading torchrun's own error file gets both
    (torchrun copies the root cause's file there with errorCode = the exit status).

    torchrun's root cause is the failure with the smallest timestamp (whole seconds, read
    from this file; ties go to the failure it saw first). A rank > 0 records the moment it
    will exit (``fail``: after PEER_EXIT_DELAY_S), not the moment it writes: rank 0, which
    fails before then (torchrun stops the others once it has exited), is then never later
    than it, even when it reached the same error a second boundary after rank 1."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    when = time.time() + (PEER_EXIT_DELAY_S if rank() != 0 else 0.0)
    data = {"message": {"message": msg, "errorCode": code,
                        "extraInfo": {"py_callstack": msg, "timestamp": str(int(when))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # torchrun then says "To enable traceback see ..."; rank 0 printed the line


def fail(msg: str, code: int) -> int:
    """The end of a failed command: one line (rank 0), torchrun told; returns ``code``.
    Every rank of a torchrun world meets the same bad input at about the same moment; the
    others wait a little before exiting so rank 0 prints its line and is the root cause
    of torchrun's summary (torchrun stops the remaining ranks when the first one exits)."""
    say(msg)
    tell_torchrun(msg, code)
    if rank() != 0:
        try:  # torchrun's SIGTERM ends the wait quietly: the line is said and recorded
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread
            pass
        time.sleep(PEER_EXIT_DELAY_S)
    return code


def interrupted(e: KeyboardInterrupt, command: str, what: str) -> str:
    again = "rerun the same command" + (" with --resume" if command in ("train", "task", "babi") else "")
    if isinstance(e, Interrupted):
        if e.saved is None:
            return f"{what} at step {e.step}, before the first checkpoint; {again} to start again"
        return f"{what} at step {e.step}; the checkpoint of step {e.saved} is intact ({again} to continue)"
    if command not in ("train", "task", "babi", "compare"):  # writes nothing, or one file renamed in at its end
        return f"{what}; nothing was left half-written"
    return f"{what}; checkpoints already written are intact ({again} to continue)"
