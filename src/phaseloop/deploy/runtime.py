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

from phaseloop.deploy.program import ActHost, refuse_gap
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
                self.act = self._act_host() if adaptive else None
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path} is not an ExecuTorch program this runtime loads ({str(e)[:80]}); "
                                  "export it again (phaseloop export --format executorch)") from None
        try:
            self.max_len = self.constant("get_max_seq_len")[0]
        except RuntimeError:  # a program without the runner's metadata: not checked
            self.max_len = None
        self.load_s = time.perf_counter() - t0
        self.last_passes: list[float] | None = None  # steps each new token ran (ACT), else None
        self.pos = 0  # positions whose keys the cache holds (forward; the ACT host keeps its own)

    def __call__(self, tokens_1T: torch.Tensor, start: int) -> torch.Tensor:
        if tokens_1T.dim() != 2 or tokens_1T.shape[0] != 1 or tokens_1T.shape[1] < 1:
            raise ConfigError(f"a program decodes one row of at least one token id, shape [1, T]; got "
                              f"{tuple(tokens_1T.shape)}")
        T = tokens_1T.shape[1]
        if self.max_len is not None and not 0 <= start <= start + T <= self.max_len:
            raise ConfigError(f"positions {start} .. {start + T - 1} are outside the program's cache of "
                              f"{self.max_len} (get_max_seq_len); start a new sequence at 0")
        if self.act is None:  # the ACT host checks its own positions
            refuse_gap(start, self.pos)
        try:
            if self.act is not None:
                logits, self.last_passes = self.act(tokens_1T.long(), start)
                return logits
            self.pos = 0  # until the call succeeds: only a new sequence may follow a failure
            logits = self.method.execute([tokens_1T.long(), torch.arange(start, start + T)])[0]
            self.pos = start + T
            return logits
        except RuntimeError as e:  # e.g. a token id past the embedding's rows
            raise CheckpointError(f"the program failed on tokens {start} .. {start + T - 1} ({first_line(e, 80)}); "
                                  "check that its tokenizer is the one exported with it") from None

    def _act_host(self) -> ActHost:
        """The host over this program's ACT methods; a step's method loads at its first use
        (its load zeros step t's cache slot, which no method wrote before; XNNPACK packs the
        block's weights again in every method's delegates, so only the steps tokens reach
        take that memory)."""
        begin, end, loaded = self.program.load_method("act_begin"), self.program.load_method("act_end"), {}

        def step(t: int, *inputs):
            if t not in loaded:
                with _quiet_native_log():
                    loaded[t] = self.program.load_method(f"act_step_{t}")
            return loaded[t].execute(list(inputs))

        return ActHost(lambda *a: begin.execute(list(a))[0], step, lambda out: end.execute([out])[0],
                       self.constant("get_act_steps")[0])

    def constant(self, name: str):
        """A metadata method's value (``get_max_seq_len`` ...)."""
        out = self.program.load_method(name).execute([])
        return [v if not torch.is_tensor(v) else v.item() for v in out]
