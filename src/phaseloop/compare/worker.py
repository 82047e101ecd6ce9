"""``python -m phaseloop.compare.worker SPEC.json``: one run of a comparison
(``runs.CompareRun``, a tuning run or a reported one) in its own process, as the local
launcher starts it (alone, or under torchrun with ``--nproc-per-run``). It keeps to the
cores the launcher gave it (PHASELOOP_CPUS, PHASELOOP_THREADS) and exits as the command
line does: 0 done (a diverged tuning run too: it is finished, scored as infinite), 2 bad
input (one line), 3 a reported run diverged, 4 a peer process failed, 130 / 143
interrupted / terminated (resumable)."""

from __future__ import annotations

import os
import signal
import sys

from phaseloop.compare.grid import execute
from phaseloop.compare.runs import CompareRun
from phaseloop.engine import dist
from phaseloop.engine.trainer import DivergedError, PeerFailed
from phaseloop.errors import PhaseloopError, raise_terminated, was_terminated


def _pin() -> None:
    import torch

    cpus = os.environ.get("PHASELOOP_CPUS")
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    threads = os.environ.get("PHASELOOP_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m phaseloop.compare.worker SPEC.json", file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        _pin()
        spec = CompareRun.load(argv[0])
        dist.init(spec.train.device)
        s = execute(spec)
        if dist.world().main:
            print(f"{spec.name}: " + (f"done, val loss {s['val_loss']:.4f}" if s else "diverged"), flush=True)
        return 0
    except DivergedError as e:
        print(f"phaseloop: error: {e}", file=sys.stderr)
        return 3
    except PeerFailed as e:
        print(f"phaseloop: error: {e}", file=sys.stderr)
        return 4
    except PhaseloopError as e:
        print(f"phaseloop: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        term = was_terminated(e)
        print(f"phaseloop: {'terminated' if term else 'interrupted'}; the run resumes from its checkpoint",
              file=sys.stderr)
        return 143 if term else 130
    finally:
        dist.close()


if __name__ == "__main__":
    sys.exit(main())
