"""A ``.pte`` in ExecuTorch's Python runtime (executorch.runtime: no exporter, no torchao),
as a device-side program loads it: the tests and benchmarks/bench_deploy.py run files so."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time

import torch
from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
from executorch.runtime import Runtime

from phaseloop.errors import CheckpointError, ConfigError, first_line


@contextlib.contextmanager
def _quiet_native_log():
    """File descriptor 2 (and Python's stderr, where it is another stream) to /dev/null:
    ExecuTorch's native code logs there (loading XNNPACK's first program: five lines of its
    CPU probe per process; a file it cannot load: its loader's complaint). A load that fails
    raises, and the caller says so in one line."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 to quiet
        saved = None
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        if saved is not None:
            os.dup2(null, 2)
        with contextlib.redirect_stderr(io.StringIO()):  # where Python's sys.stderr is not fd 2
            yield
    finally:
        os.close(null)
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)


class PteModel:
    """A ``.pte`` loaded into ExecuTorch's Python runtime; ``model(tokens [1, T], start)``
    returns the logits of T new tokens at positions start .. start + T - 1, the cache kept
    inside the loaded method between calls. ``threads``: XNNPACK's thread pool, set only
    before the first program of the process is loaded (resetting it later crashes the
    process); a file the runtime cannot load is refused by name. A program with ACT step
    methods (program.py) runs them, each token until it halts (``adaptive=False``: its
    ``forward``, every step); ``last_passes``: the steps each new token of the last call ran."""

    _pool_set = False

    def __init__(self, path, threads: int | None = None, adaptive: bool = True):
        if threads is not None and not PteModel._pool_set:
            _unsafe_reset_threadpool(threads)
        PteModel._pool_set = True
        t0 = time.perf_counter()
        try:
            with _quiet_native_log():
                self.program = Runtime.get().load_program(str(path))
                # ACT: forward (every step unrolled, each packing the block's weights again in
                # XNNPACK) is not loaded; the host loads a step's method when a token first needs it
                adaptive = adaptive and "get_act_steps" in self.program.method_names
                self.method = None if adaptive else self.program.load_method("forward")
                self.act = _ActHost(self.program, self.constant("get_act_steps")[0]) if adaptive else None
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path} is not an ExecuTorch program this runtime loads ({str(e)[:80]}); "
                                  "export it again (phaseloop export --format executorch)") from None
        try:
            self.max_len = self.constant("get_max_seq_len")[0]
        except RuntimeError:  # a program without the runner's metadata: not checked
            self.max_len = None
        self.load_s = time.perf_counter() - t0
        self.last_passes: list[float] | None = None  # steps each new token ran (ACT), else None

    def __call__(self, tokens_1T: torch.Tensor, start: int) -> torch.Tensor:
        T = tokens_1T.shape[1]
        if self.max_len is not None and not 0 <= start <= start + T <= self.max_len:
            raise ConfigError(f"positions {start} .. {start + T - 1} are outside the program's cache of "
                              f"{self.max_len} (get_max_seq_len); start a new sequence at 0")
        try:
            if self.act is not None:
                logits, self.last_passes = self.act(tokens_1T.long(), start)
                return logits
            return self.method.execute([tokens_1T.long(), torch.arange(start, start + T)])[0]
        except RuntimeError as e:  # e.g. a token id past the embedding's rows
            raise CheckpointError(f"the program failed on tokens {start} .. {start + T - 1} ({first_line(e, 80)}); "
                                  "check that its tokenizer is the one exported with it") from None

    def constant(self, name: str):
        """A metadata method's value (``get_max_seq_len`` ...)."""
        out = self.program.load_method(name).execute([])
        return [v if not torch.is_tensor(v) else v.item() for v in out]


class _ActHost:
    """The host's side of the ACT step methods (program.py): run the steps a call's tokens
    need, catching up the earlier positions that stopped before a step (their pending
    step inputs, as ``UniversalTrunk``'s lazy step extension keeps them in eager decoding),
    and stop after the step where no new token runs. Each (position, step) runs once."""

    def __init__(self, program, steps: int):
        self.program, self.steps, self.loaded = program, steps, {}
        self.begin, self.end = program.load_method("act_begin"), program.load_method("act_end")
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}  # step t -> (first position, inputs [1, n, D])
        self.pos = 0  # positions computed so far (at their first step at least)

    def _step(self, t: int):
        """Step t's method, loaded at first use: its load zeros step t's cache slot, which no
        method wrote before (the XNNPACK delegates of each method pack their own copy of the
        block's weights: loading only the steps tokens reach keeps that memory down)."""
        if t not in self.loaded:
            with _quiet_native_log():
                self.loaded[t] = self.program.load_method(f"act_step_{t}")
        return self.loaded[t]

    def rollback(self, start: int) -> None:
        """Forget positions >= start (a new sequence at 0, or a rewrite of later positions)."""
        if start > self.pos:
            raise ConfigError(f"position {start} follows {self.pos} positions computed: an ACT program "
                              f"continues at {self.pos} or rewrites earlier positions (0 .. {self.pos})")
        self.pending = {t: (lo, x[:, :start - lo]) for t, (lo, x) in self.pending.items() if lo < start}
        self.pos = start

    def __call__(self, tokens_1T: torch.Tensor, start: int):
        self.rollback(start)
        try:
            return self._run(tokens_1T, start)
        except BaseException:  # a step failed midway: what the host kept is not the cache's
            self.pending, self.pos = {}, 0  # any call but a new sequence is then refused
            raise

    def _run(self, tokens_1T: torch.Tensor, start: int):
        T = tokens_1T.shape[1]
        end = start + T
        y = self.begin.execute([tokens_1T, torch.arange(start, end)])[0]
        z = torch.zeros(1, T)
        hp, rem, n, out, lo = z, z, z, torch.zeros_like(y), start
        for t in range(self.steps):
            if t in self.pending:  # catch up: the rows in front of the new tokens
                lo, x = self.pending.pop(t)
                y = torch.cat([x, y], 1)
            k = start - lo
            y, hp, rem, n, out, running = self._step(t).execute([
                y, torch.arange(lo, end), torch.cat([torch.ones(1, k), hp], 1), torch.cat([torch.zeros(1, k), rem], 1),
                torch.cat([torch.zeros(1, k), n], 1), torch.cat([torch.zeros(1, k, y.shape[2]), out], 1)])
            hp, rem, n, out = hp[:, k:], rem[:, k:], n[:, k:], out[:, k:]
            if not bool(running[0]):
                break
        if t + 1 < self.steps:  # step t+1 inputs of positions lo .. end - 1 wait for a token that needs them
            first, x = self.pending.get(t + 1, (lo, y[:, :0]))
            self.pending[t + 1] = (first, torch.cat([x, y], 1))
        self.pos = end
        return self.end.execute([out])[0], n[0].tolist()
