"""Compilation of a training run, applied from outside the model.

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
  chose and why. What earlier runs of the same block shapes measured on this machine
  (``records.json`` in the compile cache: a cold compile's seconds, a warm load's, the
  fraction of a step compiling saved) replaces the estimates below. A block never compiled
  here costs a cold compile, which the runs of a comparison that share it (``share``: the
  runner counts them) split: the first compiles, the others load it warm. The choice is
  kept in the run's checkpoints, so a resumed run computes as before; a checkpoint written
  while auto still probes keeps the probe's step times, so a resumed run of the same
  shapes, device and world size decides after the same step as the uninterrupted one (its
  own first step is a warm-up, not timed; a probe of another setup is dropped: probed anew).

Compiled artefacts persist in ``$PHASELOOP_CACHE/compile/`` (inductor's FX-graph and
AOTAutograd caches, keyed by inductor on the graph, the torch version and its settings),
so the runs of a comparison and a resumed run reuse what the first compiled.

A run whose first compiled step fails falls back to eager with a note (the step is
re-run from the same batch and random state), never a crash.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable

import torch
from torch import nn

from phaseloop.engine import compile_cache, dist
from phaseloop.errors import CheckpointError, PhaseloopError, first_line
from phaseloop.layers import Block

MODES = ("off", "block", "model", "auto")
PROBE = 5  # eager steps auto times before deciding (the first is warm-up, not timed)
MEASURE = 8  # compiled steps auto times after the first, to record the saving it measured
# Per device type, until a run here measured them: the fraction of an eager step block
# compilation saves, a cold compile's seconds and a warm load's. On the 2-core CPU
# (docs/performance.md): whole runs at the main job's settings gained 12 % (rope-small)
# and 20 % (hyperloop-small) training throughput, interleaved steps 12-26 %; a block
# never compiled took 8-10 s (12-15 s when inductor's first-use toolchain checks run
# too), a warm load 1.5-2.2 s. The CUDA figures are estimates, not measurements.
SAVING = {"cpu": 0.10, "cuda": 0.25}
COLD_S = {"cpu": 12.0, "cuda": 60.0}
LOAD_S = {"cpu": 2.0, "cuda": 5.0}


def targets(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, method name) pairs block mode compiles: the trunk's, or every Block's forward."""
    trunk = getattr(model, "trunk", None)
    if trunk is not None and hasattr(trunk, "compile_targets"):
        return trunk.compile_targets()

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
        compiled = torch.compile(eager, backend=compile_cache.backend())

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


def batch_key(tc) -> str:
    """The batch shape part of ``shape_key`` (a TrainConfig's)."""
    return f"{tc.batch_size}x{tc.seq_len}x{tc.grad_accum}"


def shape_key(model: nn.Module, batch_shape, device: torch.device, mode: str) -> str:
    """What a compile's cost depends on: the targets' code and parameter shapes, the batch."""
    parts = [torch.__version__, device.type, mode, str(tuple(batch_shape))]
    for module, name in targets(model):
        parts.append(f"{type(module).__qualname__}.{name}")
        parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def shares(runs: list[tuple[str, Callable[[], nn.Module], object]]) -> dict[str, int]:
    """For each (name, build, TrainConfig), in launch order: how many runs from it on
    compile the same blocks (built on the meta device: no memory), so auto can split one
    cold compile between them."""
    keys = []
    for name, build, tc in runs:
        with torch.device("meta"):
            keys.append((name, shape_key(build(), batch_key(tc), torch.device("meta"), "block")))
    return {name: sum(k == key for _, k in keys[i:]) for i, (name, key) in enumerate(keys)}


def decide(step_s: float, steps_left: int, device: torch.device, record: dict | None = None,
           share: int = 1, here: bool = False) -> tuple[str, str]:
    """auto's choice and the one line saying why. ``record``: ``read_record``'s; ``share``:
    the runs (this one included) that compile the same blocks and have not started;
    ``here``: this process compiled them already (a comparison's earlier run)."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    record = record or {}
    saving = record.get("saving", SAVING[kind])
    if here:
        runs, cost, where = 1, 0.0, "compiled by an earlier run in this process"
    elif "compile_s" in record or "load_s" in record:  # compiled here before: inductor's cache holds it
        runs, cost, where = 1, record.get("load_s", LOAD_S[kind]), "warm cache"
    else:
        runs = max(1, share)
        cost = COLD_S[kind] + (runs - 1) * LOAD_S[kind]
        where = "cold estimate" + (f"; one compile, then {runs - 1} warm loads, for {runs} runs" if runs > 1 else "")
    gain = runs * steps_left * saving * step_s
    mode = "block" if gain > cost else "off"
    return mode, (f"compile auto: {mode} (expected saving {gain:.1f} s over {steps_left} steps of "
                  f"{step_s * 1e3:.1f} ms at {saving:.1%} ({'measured' if 'saving' in record else 'estimated'})"
                  + (f" x {runs} runs" if runs > 1 else "")
                  + f" {'>' if gain > cost else '<='} {cost:.1f} s to compile, {where})")


def _cache_counts() -> tuple[int, int, int]:
    """Inductor's and AOTAutograd's cache hits and misses, and the graphs dynamo compiled,
    so far in this process."""
    from torch._dynamo.utils import counters

    return (counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
            counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"],
            counters["stats"]["unique_graphs"])


def _probe(probe, key: str) -> tuple[list[float], list[int]]:
    """A checkpoint's ``compile_probe``: (step times, warm-up indices), none where it was
    made with other shapes, device or world size (``key``); refused in one line if damaged."""
    num = lambda t: isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < float("inf")
    got = probe if isinstance(probe, dict) else {}
    times, warm = got.get("times"), got.get("warm")
    if not (isinstance(got.get("key"), str)
            and isinstance(times, list) and len(times) <= PROBE and all(num(t) for t in times)
            and isinstance(warm, list) and all(type(i) is int and 0 <= i < len(times) for i in warm)):
        raise CheckpointError(f"the checkpoint's compile_probe {str(probe)[:60]} is damaged (its key, up to {PROBE} "
                              "step times in seconds and their warm-up steps); restore the checkpoint or resume "
                              "with --compile off or block")
    return ([float(t) for t in times], list(warm)) if probe["key"] == key else ([], [0])


_COMPILED_HERE: set[str] = set()  # shape keys this process compiled: a later run reuses them free


def note(msg: str) -> None:
    """One line on stderr, on a line of its own under a progress bar (tqdm.write)."""
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stderr)


class RunCompiler:
    """The compile state of one run: which forward each step calls, auto's probe and
    choice, and the fallback to eager when the first compiled step fails.

    ``chosen``: the mode a resumed run recorded (auto's earlier choice), else None;
    ``probe``: the probe it recorded where auto had not chosen yet (``state``);
    ``share``: the runs, this one included, that compile the same blocks (``shares``)."""

    def __init__(self, mode: str, model: nn.Module, device: torch.device, key_extra: str,
                 chosen: str | None = None, sharded: bool = False, main: bool = True,
                 verbose: bool = True, share: int = 1, probe: dict | None = None):
        self.model, self.device, self.key_extra, self.main, self.share = model, device, key_extra, main, share
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
        self.times: list[float] = []  # auto's eager probe steps
        self.warm = [0]  # those that warmed a process up (its first step): not timed
        if self.mode == "auto" and probe is not None:
            times, warm = _probe(probe, self._probe_key())
            if times:  # the next step is this process's first
                self.times, self.warm = times, [*warm, len(times)]
        self.compiled: list[float] | None = None  # auto: compiled steps timed to measure the saving
        if self.mode == "block":  # before FSDP2 / DDP wrap the model (as torchtitan orders it)
            self._apply_block()

    @property
    def chosen(self) -> str | None:
        """The mode to record in checkpoints (None while auto has not decided)."""
        return None if self.mode == "auto" else self.mode

    def state(self) -> dict:
        """What a checkpoint keeps: the mode chosen, or auto's probe so far."""
        if self.chosen is not None:
            return {"compile": self.chosen}
        warm = [i for i in self.warm if i < len(self.times)]  # the steps taken
        return {"compile_probe": {"key": self._probe_key(), "times": list(self.times), "warm": warm}} \
            if self.times else {}

    def _probe_key(self) -> str:
        """What the probe's step times depend on: the shapes, batch and device, the world size."""
        return f"{shape_key(self.model, self.key_extra, self.device, 'auto')}/{dist.world().size}"

    def _say(self, msg: str) -> None:
        if self.main:
            note(msg)

    def attach(self, fwd: Callable) -> None:
        """The (parallelised) forward the steps call; ``model`` mode compiles it."""
        self.eager_fwd = self.fwd = fwd
        if self.mode == "model":
            compile_cache.use_cache()
            self.fwd = torch.compile(fwd, backend=compile_cache.backend())
            self.pending = True

    def _apply_block(self) -> None:
        compile_cache.use_cache()
        self.undo = compile_blocks(self.model)
        self.pending = True

    def _key(self) -> str:
        return shape_key(self.model, self.key_extra, self.device, self.mode)

    def step(self, run_step: Callable, snapshot: Callable, restore: Callable, steps_left: int):
        """Run one training step (``run_step(fwd)``), timing it for auto and falling back to
        eager if the first compiled step fails (``restore(snapshot())`` rewinds the data
        and random state, so the eager re-run takes the same batch)."""
        import time

        saved = snapshot() if self.pending else None
        cache = _cache_counts() if self.pending else None
        t0 = time.perf_counter()
        try:
            rec = run_step(self.fwd)
        except (PhaseloopError, KeyboardInterrupt):
            raise
        except Exception as e:
            if not self.pending:
                raise
            restore(saved)
            self._fall_back(e)
            return run_step(self.fwd)
        seconds = time.perf_counter() - t0
        if self.pending:
            self.pending = False
            hits, misses, graphs = (a - b for a, b in zip(_cache_counts(), cache))
            took = max(seconds - self._eager_s(), 0.0)
            if misses or (graphs and not hits):  # compiled (a backend without caches: compiled too)
                self._record(compile_s=took)
            elif hits:  # inductor loaded every graph from its cache
                self._record(load_s=took)
            # neither: dynamo reused what an earlier run in this process compiled (compare's
            # sequential runs), which costs nothing and says nothing about a new process
            _COMPILED_HERE.add(self._key())
            if self.times:  # auto: time a few compiled steps against the eager probe
                self.compiled = []
        elif self.mode == "auto":
            self.times.append(seconds)
            if len(self.times) > PROBE:
                self._decide(steps_left - 1)
        elif self.compiled is not None:
            self.compiled.append(seconds)
            if len(self.compiled) == MEASURE:
                self._record(saving=1.0 - compile_cache.median(self.compiled) / self._eager_s())
                self.compiled = None
        return rec

    def _eager_s(self) -> float:
        """The median eager probe step (auto; a process's first step is not timed), else 0."""
        timed = [t for i, t in enumerate(self.times) if i not in self.warm]
        return compile_cache.median(timed) if timed else 0.0

    def _record(self, **values: float) -> None:
        if self.main:
            compile_cache.update_record(self._key(), **values)

    def _decide(self, steps_left: int) -> None:

        key = shape_key(self.model, self.key_extra, self.device, "block")
        mode, line = decide(self._eager_s(), steps_left, self.device, compile_cache.read_record(key), self.share,
                            here=key in _COMPILED_HERE)
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
        first = first_line(e, 200)
        self._say(f"compile {self.mode}: the first compiled step failed ({type(e).__name__}: "
                  f"{first}); continuing eager")
        if self.undo is not None:
            self.undo()
            self.undo = None
        self.fwd, self.mode, self.pending = self.eager_fwd, "off", False
