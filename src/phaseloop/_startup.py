"""Ctrl-C while the `phaseloop` command starts (importing torch takes seconds): one line
and exit 130, not a KeyboardInterrupt traceback. Standard library only: it runs before
any heavy import. ``phaseloop/__init__.py`` installs it when the process is the command
(the console script, or ``python -m phaseloop``), never when phaseloop is imported as a
library; ``cli.main`` hands SIGINT back to Python just before a command runs, whose
interruptions it reports itself."""

from __future__ import annotations

import logging
import os
import signal
import sys

MESSAGE = "phaseloop: interrupted while starting; nothing was done\n"


def started_as_command() -> bool:
    """Is this process the `phaseloop` command (not a Python program importing it)?"""
    if os.path.basename(sys.argv[0] or "") in ("phaseloop", "phaseloop.exe"):
        return True
    argv = list(getattr(sys, "orig_argv", []))
    return any(a == "-m" and argv[i + 1:i + 2] == ["phaseloop"] for i, a in enumerate(argv))


def _interrupted(signum, frame):
    rank = os.environ.get("RANK", "0")
    if rank in ("", "0"):  # under torchrun, rank 0 speaks for the world
        try:
            os.write(2, MESSAGE.encode())
        except OSError:
            pass
    os._exit(130)  # nothing has been written yet: no cleanup to run


def install() -> None:
    """Quiet Ctrl-C for the start of the command, where Python's own handler is set or
    SIGINT is ignored: a shell script starts a background command (``phaseloop ... &``)
    with SIGINT ignored, and ``kill -INT PID`` from that script must still stop it
    (``uninstall`` then gives it Python's KeyboardInterrupt, as to any command)."""
    try:
        if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, signal.SIG_IGN):
            signal.signal(signal.SIGINT, _interrupted)
    except (ValueError, OSError):  # not the main thread, or no signals here
        return
    ready = os.environ.get("PHASELOOP_STARTUP_READY_FILE")  # tests: signal only once installed
    if ready:
        try:
            open(ready, "w").close()
        except OSError:
            pass


def uninstall() -> None:
    """Python's own KeyboardInterrupt again (the command reports interruptions itself)."""
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError):
        pass


# Lines other libraries log while they are imported that say nothing to a phaseloop user
# (torchao, which transformers and the deploy extra import: its CUDA kernels are absent on
# a CPU machine; torch's pytree: a deprecation in torchao's own registrations). Every
# command's stderr is its notes and, on failure, one line (docs/reliability.md).
IMPORT_NOISE = {"torchao": ("Failed to load ",),
                "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",)}


def _drop_import_noise(record: logging.LogRecord) -> bool:
    starts = IMPORT_NOISE.get(record.name, ())
    return not (record.levelno <= logging.WARNING and str(record.msg).startswith(starts))


def quiet_import_noise() -> None:
    """Drop exactly those records (a filter on each logger; every other record stays)."""
    for name in IMPORT_NOISE:
        logger = logging.getLogger(name)
        if _drop_import_noise not in logger.filters:
            logger.addFilter(_drop_import_noise)
