"""``phaseloop generate RUN --compile``: batch-1 decoding with the one-token step compiled
(docs/deploy.md, "Compiled decode").

The model decodes on a ``StaticKVCache`` (``program.RunnerProgram``, the shape of the
ExecuTorch program), so a decode step has the same tensor shapes at every position and is
one static graph. Inductor compiles it once with the weights frozen as constants and
``max_autotune``: on the CPU each Linear's weight is prepacked for inductor's GEMM
template (AVX-512 micro-kernels), which streams a one-row product's weights faster than
BLAS's matrix-vector path, and the rest of the step (norms, RoPE, attention over the
cache, the loop over layers) runs as generated C++ instead of one Python dispatch per op.

Dynamo's guards (a check of every weight and buffer the step reads, 0.6 ms of a 7 ms
step at rope-123m int4) run on the first compiled step after each prompt, the only point
where eager code (the prompt's forward) ran since the last check; the steps after it skip
them (``skip_guard_eval_unsafe``: one graph, inputs of a fixed shape and dtype that this
module builds itself).

The prompt's forward runs eagerly on the same cache and weights (a graph per prompt
length would prepack every weight again). The costs: the compile (``compile_seconds``,
reported apart from tokens/s) and the prepacked copy of each Linear weight beside the
eager one. A static graph runs a fixed depth: exits, ``--kv-share`` and speculation are
refused. UT + ACT compiles one graph per step (program.py's ``act_step_<t>`` on one row)
and one for the head, and decodes through ``program.ActHost``: each token runs the steps
it needs, until it halts; the prompt and the rows of earlier positions caught up at a step
run eagerly.
"""

from __future__ import annotations

import itertools
import time
import types
import weakref
from types import SimpleNamespace

import torch

from phaseloop.decoding import decode
from phaseloop.deploy.program import ActBegin, ActEnd, ActHost, ActStep, RunnerProgram
from phaseloop.errors import ConfigError
from phaseloop.inference import Generation, Options, recording_passes

# inductor's config while the step compiles: weights as constants (prepacked), GEMM templates
# tried. Set through config.patch around the compiling call: torch.compile(options=...) does
# not reach freezing (measured: the step then ran unfrozen, 38.6 against 56.2 tok/s at rope-123m)
COMPILE_OPTIONS = {"freezing": True, "max_autotune": True}
# when a template fails to generate (torch 2.13: the CPU BMM template's epilogue on mHC's
# stream mixing, an AssertionError in ir.py), the step compiles again without autotuning:
# frozen weights, ATen / oneDNN products (``CompiledDecoder.autotuned`` is then False)
FALLBACK_OPTIONS = {"freezing": True}


def check(model, options: Options, prompt_BT: torch.Tensor) -> None:
    """One line for what a compiled decode cannot do, before anything compiles."""
    fixed = options.dynamic_flags()
    if fixed:
        raise ConfigError(f"{fixed[0]} with --compile: the compiled step runs a fixed depth on a static KV "
                          f"cache; drop {fixed[0]} or --compile")
    if options.temperature < 0:
        raise ConfigError(f"temperature {options.temperature}: must be >= 0 (0 = greedy)")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ConfigError(f"--compile decodes on the CPU (inductor's CPU GEMM templates), the model is on "
                          f"{device}: drop --compile or use --device cpu")
    if prompt_BT.shape[0] != 1 or prompt_BT.shape[1] < 1:
        raise ConfigError(f"--compile decodes one non-empty prompt (batch 1), got shape {tuple(prompt_BT.shape)}")
    need, limit = options.cache_positions(prompt_BT.shape[1]), model.cfg.max_seq_len
    if need > limit:
        raise ConfigError(f"prompt ({prompt_BT.shape[1]} tokens) + --max-new-tokens {options.max_new_tokens} need "
                          f"{need} positions; --compile's static cache holds at most max_seq_len = {limit}: ask "
                          "for fewer tokens or drop --compile")


_NEXT = itertools.count()


def _run(module, *inputs):
    return module(*inputs)


def _own_step():
    """``_run`` with a code object of its own. Dynamo keeps compiled graphs per code object,
    at most ``recompile_limit`` (8) of them: compiling ``RunnerProgram.forward`` itself, the
    ninth decoder of a process failed, and every earlier one's frozen weights stayed alive.
    Each graph now lives and dies with its decoder."""
    code = _run.__code__.replace(co_name=f"decode_step_{next(_NEXT)}")
    return types.FunctionType(code, _run.__globals__, code.co_name)


class CompiledDecoder:
    """``model`` on a static cache of ``max_len`` positions with its one-token step compiled
    (module docstring). ``step`` is ``decoding.decode``'s step: a one-token input runs the
    compiled graph, a longer one (the prompt) the eager model; ``reset`` starts a new sequence.
    The weights are frozen into the graph when it compiles: change the model, build another."""

    def __init__(self, model, max_len: int):
        self.program = RunnerProgram(model.eval(), max_len).allocate()  # one-line refusal: no static cache
        self.pos, self._guarded = 0, False
        t0 = time.perf_counter()
        try:
            try:
                self._compile(COMPILE_OPTIONS)
                self.autotuned = True
            except ConfigError:
                raise
            except Exception:  # a GEMM template inductor fails to generate: compile without them
                self._compile(FALLBACK_OPTIONS)
                self.autotuned = False
        except ConfigError:
            raise
        except Exception as e:  # no C++ compiler, an op inductor cannot lower
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"--compile: inductor could not compile this {model.cfg.arch} model's decode step "
                              f"({type(e).__name__}: {first}); decode without --compile") from None
        self.compile_seconds = time.perf_counter() - t0
        self.reset()

    def _compile(self, options: dict) -> None:
        """Compile the step (a graph of its own: ``_own_step``) under inductor ``options``; UT +
        ACT: a graph per step and one for the head, and the host that runs them."""
        import torch._inductor.config as inductor_config  # here: importing inductor takes a while

        self.pos, self.act, steps = 0, None, self.program.model.trunk.program_steps
        with torch.no_grad(), inductor_config.patch(options):
            if not steps:
                self._graph = torch.compile(_own_step(), fullgraph=True, dynamic=False)
                self._compiled(torch.zeros(1, 1, dtype=torch.long))
                return
            D = self.program.model.cfg.d_model
            self._modules = [ActStep(self.program, t) for t in range(steps)] + [ActEnd(self.program)]
            self._graphs = [torch.compile(_own_step(), fullgraph=True, dynamic=False) for _ in self._modules]
            row = (torch.zeros(1, 1, D), torch.zeros(1, dtype=torch.long), *(torch.zeros(1, 1) for _ in range(3)),
                   torch.zeros(1, 1, D))
            for i, (graph, module) in enumerate(zip(self._graphs, self._modules)):  # compile each once
                graph(module, *(row if i < steps else row[:1]))
        me = weakref.ref(self)  # the host holds no reference back: the graphs die with their decoder (_own_step)
        self.act = ActHost(ActBegin(self.program), lambda t, *a: me()._on_graph(t, *a),
                           lambda out: me()._on_graph(-1, out), steps)

    def _on_graph(self, i: int, *inputs):
        """Module ``i`` (step i; -1: the head) on one row through its graph (fresh contiguous
        inputs: the strides it was traced with), on more rows eagerly (a prompt, caught-up rows)."""
        if inputs[0].shape[1] != 1:
            return self._modules[i](*inputs)
        with torch.compiler.set_stance("fail_on_recompile"):
            return self._graphs[i](self._modules[i], *(a.clone(memory_format=torch.contiguous_format)
                                                       for a in inputs))

    @property
    def cache(self):
        return self.program.cache

    @property
    def kv_cache_bytes(self) -> int:
        return sum(b.nbytes for b in self.cache.buffers())

    def reset(self) -> None:
        self.cache.reset()
        self.pos, self._guarded = 0, False
        if self.act is not None:
            self.act.rollback(0)

    def _compiled(self, x_11: torch.Tensor) -> torch.Tensor:
        # the graph reads positions from input_pos only; cache.pos stays at the value it was
        # traced with (as in the exported program), so no call recompiles
        self.cache.pos = 0
        x_11 = x_11.reshape(1).to(torch.long, copy=True).view(1, 1)  # the traced strides: no guard fails
        logits = self._graph(self.program, x_11, torch.tensor([self.pos]))
        self.pos += 1
        return logits

    @torch.no_grad()  # the graph was traced without autograd: a grad-mode guard never fails
    def step(self, x_BT: torch.Tensor, _cache=None) -> SimpleNamespace:
        T = x_BT.shape[1]
        if x_BT.dim() != 2 or x_BT.shape[0] != 1 or T < 1:
            raise ConfigError(f"the compiled step decodes one row of at least one token id, shape [1, T]; got "
                              f"{tuple(x_BT.shape)}")
        if self.pos + T > self.program.max_len:
            raise ConfigError(f"{self.pos + T} positions exceed the compiled step's cache of "
                              f"{self.program.max_len}; start a new sequence (reset)")
        if self.act is not None:  # UT + ACT: the steps each token needs (ActHost)
            try:
                logits, passes = self.act(x_BT, self.pos)
            except BaseException:  # the host forgot its positions (ActHost): so does the decoder
                self.reset()
                raise
            self.pos += T
            return SimpleNamespace(logits=logits, stats={}, passes=passes[-1])
        if T == 1 and self.pos > 0:
            # guards once after eager code ran (module docstring); a failing one raises
            with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=self._guarded):
                logits = self._compiled(x_BT)
            self._guarded = True
        else:
            logits = self.program(x_BT, torch.arange(self.pos, self.pos + T))
            self.pos, self._guarded = self.pos + T, False
        return SimpleNamespace(logits=logits, stats={})


@torch.no_grad()
def generate(model, prompt_BT: torch.Tensor, options: Options, on_output=None) -> Generation:
    """Decode ``prompt_BT`` [1, T] with the step compiled (``Generation.compile_seconds``:
    the compile, not in ``seconds``)."""
    check(model, options, prompt_BT)
    if options.max_new_tokens == 0:  # nothing to decode: nothing to compile
        return Generation(prompt_BT, prompt_BT[:, :0], 0.0, [], 0, compile_seconds=0.0)
    was_training = model.training
    try:
        dec = CompiledDecoder(model, options.cache_positions(prompt_BT.shape[1]))
        gen = torch.Generator().manual_seed(options.seed)
        passes, seen = recording_passes(model.trunk.passes, on_output)  # UT + ACT: the steps each token ran
        t0 = time.perf_counter()
        ids = decode(dec.step, prompt_BT, options.max_new_tokens, temperature=options.temperature,
                     top_k=options.top_k, generator=gen, eos_id=options.eos_id, on_output=seen)
        seconds = time.perf_counter() - t0
    finally:
        model.train(was_training)
    n = ids.shape[1] - prompt_BT.shape[1]
    return Generation(ids, ids[:, prompt_BT.shape[1]:], seconds, passes[:n], dec.kv_cache_bytes,
                      compile_seconds=dec.compile_seconds, compile_autotuned=dec.autotuned)
