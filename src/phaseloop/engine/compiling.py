"""Compilation of a training run, applied from outside the model (issue 30).

Modes (``TrainConfig.compile``):

* ``off``   eager.
* ``block`` each trunk's compile targets (``Trunk.compile_targets``: by default every
  ``Block``'s forward; trunks add their per-step extras: ACT's halting unit, the
  hyper-connection maths, mHC's branches) are compiled on the instance. Every layer of a
  stack and every pass of a weight-tied trunk runs the same code, so dynamo compiles one
  graph for all of them (torchtitan compiles per block for the same reason). Only calls
  that take gradients run compiled: an evaluation (no grad) runs the eager method, which
  costs less than compiling its graph for a few forward passes (bench_compile --train),
  and so does a call with a KV cache (decoding), whose slots are Python values a compiled
  graph would be specialised (and recompiled) on.
* ``model`` ``torch.compile`` of the whole forward (the former ``--compile``).
* ``auto``  (default) eager for the first ``PROBE`` steps, then ``block`` if the saving
  expected over the steps left beats the compile time, else ``off``; one line says what it
  chose and why. The compile time is the one measured by earlier runs of the same block
  shapes on this machine (``records.json`` in the compile cache), else a cold estimate.
  The choice is kept in the run's checkpoints, so a resumed run computes as before.

Compiled artefacts persist in ``$PHASELOOP_CACHE/compile/`` (inductor's FX-graph and
AOTAutograd caches, keyed by inductor on the graph, the torch version and its settings),
so the runs of a comparison and a resumed run reuse what the first compiled.

A run whose first compiled step fails falls back to eager with a note (the step is
re-run from the same batch and random state), never a crash.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Callable

import torch
from torch import nn

MODES = ("off", "block", "model", "auto")
PROBE = 3  # eager steps auto times before deciding (the first is warm-up, not timed)
# Fraction of an eager step block compilation saves, and a cold compile's seconds, per
# device type, when no earlier run measured them: benchmarks/bench_compile.py on a 2-core
# CPU measured savings of 1.6 % (rope-small, 4 layers), 2.9 % (universal-small) and 9.8 %
# (12 layers) and cold compiles of 12-15 s (docs/performance.md); the CUDA figures are
# conservative guesses (no GPU was lent to measure them).
SAVING = {"cpu": 0.05, "cuda": 0.25}
COLD_S = {"cpu": 15.0, "cuda": 60.0}


def cache_root():
    from ..files import cache_dir

    return cache_dir() / "compile"


def use_cache() -> None:
    """Point inductor's on-disk caches into phaseloop's cache folder (unless the user set one)."""
    root = cache_root() / f"torch-{torch.__version__}"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


def backend() -> str:
    """torch.compile's backend: inductor, or $PHASELOOP_COMPILE_BACKEND (aot_eager / eager
    capture the same graphs without code generation: to isolate an inductor problem)."""
    return os.environ.get("PHASELOOP_COMPILE_BACKEND") or "inductor"


def targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, method name) pairs block mode compiles: the trunk's, or every Block's forward."""
    trunk = getattr(model, "trunk", None)
    if trunk is not None and hasattr(trunk, "compile_targets"):
        return trunk.compile_targets()
    from ..layers import Block

    return [(m, "forward") for m in model.modules() if isinstance(m, Block)]


def _uses_cache(args, kwargs) -> bool:
    for a in (*args, *kwargs.values()):
        if getattr(a, "cache", None) is not None and hasattr(a, "start_pos"):
            return True
    return False


def compile_blocks(model: nn.Module) -> Callable[[], None]:
    """Compile each target on its instance; returns the function that undoes it."""
    done = []
    for module, name in targets(model):
        if name in module.__dict__ and getattr(module.__dict__[name], "_phaseloop_compiled", False):
            continue
        eager = getattr(module, name)
        compiled = torch.compile(eager, backend=backend())

        def call(*args, _eager=eager, _compiled=compiled, **kwargs):
            # training steps only: an evaluation (no grad, eval mode) would cost a second
            # compile for a few forward passes, a cached call a graph per cache slot
            wanted = torch.is_grad_enabled() and not _uses_cache(args, kwargs)
            return (_compiled if wanted else _eager)(*args, **kwargs)

        call._phaseloop_compiled = True
        had = name in module.__dict__  # e.g. activation checkpointing's partial on forward
        setattr(module, name, call)
        done.append((module, name, had, eager))

    def undo():
        for module, name, had, eager in done:
            if had:
                setattr(module, name, eager)
            else:
                delattr(module, name)
    return undo


def shape_key(model: nn.Module, batch_shape, device: torch.device, mode: str) -> str:
    """What a compile's cost depends on: the targets' code and parameter shapes, the batch."""
    parts = [torch.__version__, device.type, mode, str(tuple(batch_shape))]
    for module, name in targets(model):
        parts.append(f"{type(module).__qualname__}.{name}")
        parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _records_path():
    return cache_root() / "records.json"


def recorded_seconds(key: str) -> float | None:
    try:
        return float(json.loads(_records_path().read_text())[key])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no record (or an unreadable one: it is only an estimate's input)


def record_seconds(key: str, seconds: float) -> None:
    from ..files import atomic_write_bytes

    path = _records_path()
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[key] = round(seconds, 3)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())
    except OSError:
        pass  # a read-only cache costs only the estimate


def decide(step_s: float, steps_left: int, device: torch.device, compile_s: float | None) -> tuple[str, str]:
    """auto's choice and the one line saying why."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    cost = compile_s if compile_s is not None else COLD_S[kind]
    gain = steps_left * SAVING[kind] * step_s
    where = "measured before (warm cache)" if compile_s is not None else "cold estimate"
    mode = "block" if gain > cost else "off"
    return mode, (f"compile auto: {mode} (expected saving {gain:.1f} s over {steps_left} steps of "
                  f"{step_s * 1e3:.1f} ms {'>' if gain > cost else '<='} {cost:.1f} s to compile, {where})")


def note(msg: str) -> None:
    """One line on stderr, on a line of its own under a progress bar (tqdm.write)."""
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stderr)


class RunCompiler:
    """The compile state of one run: which forward each step calls, auto's probe and
    choice, and the fallback to eager when the first compiled step fails.

    ``chosen``: the mode a resumed run recorded (auto's earlier choice), else None."""

    def __init__(self, mode: str, model: nn.Module, device: torch.device, key_extra: str,
                 chosen: str | None = None, sharded: bool = False, main: bool = True,
                 verbose: bool = True):
        self.model, self.device, self.key_extra, self.main = model, device, key_extra, main
        self.verbose = verbose  # auto's line on stderr (a quiet run keeps it in its summary)
        self.line: str | None = None  # what auto chose and why (summary.json: compile_note)
        self.mode = chosen if mode == "auto" and chosen in ("off", "block") else mode
        if self.mode == "auto" and sharded:  # blocks must be compiled before FSDP2 wraps them
            self.mode = "off"
            self.line = ("compile auto: off (under FSDP2 blocks are compiled before sharding: "
                         "ask for --compile block to compile them)")
            if verbose:
                self._say(self.line)
        self.eager_fwd = self.fwd = None
        self.undo: Callable[[], None] | None = None
        self.pending = False  # the next step is the first compiled one
        self.times: list[float] = []
        if self.mode == "block":  # before FSDP2 / DDP wrap the model (as torchtitan orders it)
            self._apply_block()

    @property
    def chosen(self) -> str | None:
        """The mode to record in checkpoints (None while auto has not decided)."""
        return None if self.mode == "auto" else self.mode

    def _say(self, msg: str) -> None:
        if self.main:
            note(msg)

    def attach(self, fwd: Callable) -> None:
        """The (parallelised) forward the steps call; ``model`` mode compiles it."""
        self.eager_fwd = self.fwd = fwd
        if self.mode == "model":
            use_cache()
            self.fwd = torch.compile(fwd, backend=backend())
            self.pending = True

    def _apply_block(self) -> None:
        use_cache()
        self.undo = compile_blocks(self.model)
        self.pending = True

    def _key(self) -> str:
        return shape_key(self.model, self.key_extra, self.device, self.mode)

    def step(self, run_step: Callable, snapshot: Callable, restore: Callable, steps_left: int):
        """Run one training step (``run_step(fwd)``), timing it for auto and falling back to
        eager if the first compiled step fails (``restore(snapshot())`` rewinds the data
        and random state, so the eager re-run takes the same batch)."""
        import time

        from ..errors import PhaseloopError

        saved = snapshot() if self.pending else None
        t0 = time.perf_counter()
        try:
            rec = run_step(self.fwd)
        except (PhaseloopError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the first compiled step
            if not self.pending:
                raise
            restore(saved)
            self._fall_back(e)
            return run_step(self.fwd)
        seconds = time.perf_counter() - t0
        if self.pending:
            self.pending = False
            eager = sorted(self.times[1:])[len(self.times[1:]) // 2] if len(self.times) > 1 else 0.0
            record_seconds(self._key(), max(seconds - eager, 0.0))
        elif self.mode == "auto":
            self.times.append(seconds)
            if len(self.times) > PROBE:
                self._decide(steps_left - 1)
        return rec

    def _decide(self, steps_left: int) -> None:
        from . import dist

        probe = sorted(self.times[1:])
        step_s = probe[len(probe) // 2]
        mode, line = decide(step_s, steps_left, self.device,
                            recorded_seconds(shape_key(self.model, self.key_extra, self.device, "block")))
        if dist.world().size > 1:  # every rank must compile alike: the majority's choice
            votes = float(dist.all_sum(1.0 if mode == "block" else 0.0)[0])
            mode = "block" if votes * 2 > dist.world().size else "off"
        self.line = line
        if self.verbose:
            self._say(line)
        self.mode = mode
        if mode == "block":
            self._apply_block()

    def _fall_back(self, e: Exception) -> None:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        self._say(f"compile {self.mode}: the first compiled step failed ({type(e).__name__}: "
                  f"{first}); continuing eager")
        if self.undo is not None:
            self.undo()
            self.undo = None
        self.fwd, self.mode, self.pending = self.eager_fwd, "off", False
