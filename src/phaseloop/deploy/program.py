"""A ``DecoderLM`` in the shape ExecuTorch's LLM runner expects (executorch
extension/llm/runner, the contract of its llama export):

* ``forward(tokens [1, T], input_pos [T]) -> logits [1, T, V]``, T = 1 .. max_len
  (prefill and decode in one method; the runner passes ``input_pos`` = start .. start
  + T - 1 because the exported input has more than one element);
* the KV cache in module buffers: phaseloop's own model with a ``StaticKVCache``
  (kvcache.py), written at ``input_pos``, so a later call sees the earlier ones;
* constant methods the runner reads: ``get_max_seq_len``, ``get_max_context_len``,
  ``get_vocab_size``, ``get_bos_id``, ``get_eos_ids``, ``use_kv_cache``,
  ``use_sdpa_with_kv_cache``, ``enable_dynamic_shape`` (``metadata``).

The depth is fixed when the program is made (``prepare``: ``depth.set_model_depth``);
in ``forward`` ACT runs every step with the halting arithmetic as tensor operations (the
static cache turns off its host-side early exit: universal.py), so the method has no
data-dependent branch. Nothing here imports executorch: ``pte.py`` lowers the program.

A trunk that halts per position (``trunk.program_steps`` = S > 0: UT + ACT) also gets
methods a host runs step by step, on the same cache buffers, so that a token stops
computing once it halted (docs/deploy.md, "ACT in the runtime"; ``runtime.PteModel``):

* ``act_begin(tokens [1, T], input_pos [T]) -> x [1, T, D]`` (the embedding);
* ``act_step_<t>(x [1, n, D], input_pos [n], halting_prob [1, n], remainders [1, n],
  n_updates [1, n], output [1, n, D]) -> (x', halting_prob', remainders', n_updates',
  output', running [1])`` for t = 0 .. S - 1: step t over n contiguous positions, their
  keys/values written at step t's slot. The new tokens' accumulators start at zeros; rows
  in front of them are earlier positions that stopped before step t and are caught up
  (halting probability 1: no weight), because later positions attend to every earlier one
  at step t. The host stops after the step whose ``running`` is false, and keeps the x'
  of the positions that stopped: their step-t+1 inputs, for a later token that needs it;
* ``act_end(output [1, T, D]) -> logits [1, T, V]``; ``get_act_steps`` = S.
"""

from __future__ import annotations

import torch
from torch import nn

from phaseloop.archs.act import PendingInputs
from phaseloop.data.tokenizer import ByteTokenizer
from phaseloop.depth import set_model_depth
from phaseloop.errors import ConfigError
from phaseloop.kvcache import StaticKVCache
from phaseloop.model import DecoderLM


class RunnerProgram(nn.Module):
    """``model`` (a DecoderLM, left as it is: no copied code) and its static cache
    (buffers ``cache.k<i>`` / ``cache.v<i>``: the names ``InitializedMutableBufferPass
    (["cache"])`` matches, so the program starts with zeros)."""

    def __init__(self, model: DecoderLM, max_len: int):
        super().__init__()
        self.model = model
        self.cache = StaticKVCache(max_len, batch=1)

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def forward(self, tokens_1T: torch.Tensor, input_pos_T: torch.Tensor) -> torch.Tensor:
        return self.model(tokens_1T, cache=self.cache, positions_BT=input_pos_T[None]).logits

    @torch.no_grad()
    def allocate(self) -> RunnerProgram:
        """One forward at position 0 makes every slot's buffers (a trunk that cannot run
        on a static cache says so here, in one line); then the cache is empty again."""
        self(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        self.cache.reset()
        return self


class _Method(nn.Module):
    """A method of the program besides ``forward``: the same model and cache (the same
    buffer names, which the methods share in the ``.pte``)."""

    def __init__(self, program: RunnerProgram):
        super().__init__()
        self.model, self.cache = program.model, program.cache


class ActBegin(_Method):
    def forward(self, tokens_1T: torch.Tensor, input_pos_T: torch.Tensor) -> torch.Tensor:
        return self.model.embed(tokens_1T, 0, positions_BT=input_pos_T[None])


class ActStep(_Method):
    def __init__(self, program: RunnerProgram, t: int):
        super().__init__(program)
        self.t = t

    def forward(self, x_1ND, input_pos_N, hp_1N, rem_1N, n_1N, out_1ND):
        return self.model.trunk.program_step(self.t, x_1ND, input_pos_N, hp_1N, rem_1N, n_1N, out_1ND, self.cache)


class ActEnd(_Method):
    def forward(self, out_1TD: torch.Tensor) -> torch.Tensor:
        return self.model.head(self.model.norm(out_1TD))


def step_methods(program: RunnerProgram) -> dict[str, tuple[nn.Module, tuple, tuple]]:
    """name -> (module, example inputs, the dimension of each input that is the row count)
    for the host-driven ACT methods (module docstring); none for other trunks."""
    steps, D = program.model.trunk.program_steps, program.model.cfg.d_model
    if not steps:
        return {}
    n, tokens = min(2, program.max_len), torch.zeros(1, min(2, program.max_len), dtype=torch.long)
    rows = (torch.zeros(1, n, D), torch.arange(n), torch.zeros(1, n), torch.zeros(1, n), torch.zeros(1, n),
            torch.zeros(1, n, D))
    out = {"act_begin": (ActBegin(program), (tokens, torch.arange(n)), (1, 0))}
    out.update({f"act_step_{t}": (ActStep(program, t), rows, (1, 0, 1, 1, 1, 1)) for t in range(steps)})
    out["act_end"] = (ActEnd(program), (torch.zeros(1, n, D),), (1,))
    return out


def refuse_gap(start: int, pos: int) -> None:
    """A program's cache holds the keys of positions 0 .. pos - 1: a call may continue at
    ``pos`` or rewrite from an earlier position, not start past it (keys never written)."""
    if start > pos:
        raise ConfigError(f"position {start} follows {pos} positions computed: a program continues at "
                          f"{pos} or rewrites earlier positions (0 .. {pos})")


class ActHost:
    """The host's side of the ACT methods (module docstring), over callables ``begin(tokens,
    input_pos) -> x``, ``step(t, x, input_pos, hp, rem, n, out) -> 6 outputs`` and ``end(out)
    -> logits`` (a ``.pte``'s methods: runtime.PteModel; compiled graphs: compiled.py): run
    the steps a call's tokens need, catching up the earlier positions that stopped before a
    step (their pending step inputs, ``PendingInputs`` as ``UniversalTrunk``'s lazy step
    extension keeps them in eager decoding), and stop after the step where no new token runs. Each (position,
    step) runs once. ``host(tokens, start) -> (logits, steps each token ran)``."""

    def __init__(self, begin, step, end, steps: int):
        self.begin, self.step, self.end, self.steps = begin, step, end, steps
        self.pending: dict[int, PendingInputs] = {}  # step t -> the step-t inputs of positions that stopped
        self.pos = 0  # positions computed so far (at their first step at least)

    def rollback(self, start: int) -> None:
        """Forget positions >= start (a new sequence at 0, or a rewrite of later positions)."""
        refuse_gap(start, self.pos)
        kept = {t: p.truncate(start) for t, p in self.pending.items()}
        self.pending = {t: p for t, p in kept.items() if p is not None}
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
        y = self.begin(tokens_1T, torch.arange(start, end))
        z = torch.zeros(1, T)
        hp, rem, n, out, lo = z, z, z, torch.zeros_like(y), start
        for t in range(self.steps):
            caught = self.pending.pop(t, None)
            if caught is not None:  # catch up: the rows in front of the new tokens
                lo, y = caught.start, torch.cat([caught.x, y], 1)
            k = start - lo
            ones, zeros = torch.ones(1, k), torch.zeros(1, k)  # the caught-up rows: halted, no weight
            y, hp, rem, n, out, running = self.step(
                t, y, torch.arange(lo, end), torch.cat([ones, hp], 1), torch.cat([zeros, rem], 1),
                torch.cat([zeros, n], 1), torch.cat([torch.zeros(1, k, y.shape[2]), out], 1))
            hp, rem, n, out = hp[:, k:], rem[:, k:], n[:, k:], out[:, k:]
            if not bool(running[0]):
                break
        if t + 1 < self.steps:  # step t+1 inputs of positions lo .. end - 1 wait for a token that needs them
            waiting = self.pending.get(t + 1)
            if waiting is None:
                self.pending[t + 1] = PendingInputs(lo, y)
            else:
                waiting.extend(lo, y)
        self.pos = end
        return self.end(out), n[0].tolist()


def prepare(model: DecoderLM, depth: int | None = None, extend_loops: str | None = None,
            max_len: int | None = None) -> RunnerProgram:
    """``model`` (fp32, eval) at ``depth`` with every block application input-independent,
    wrapped with a static cache of ``max_len`` positions (default: its max_seq_len), its
    buffers allocated. One-line ConfigError for what a program cannot hold. ``model`` itself
    is changed (export loads its own): fp32, eval, that depth, and UT + ACT runs every step
    in eager decoding too (the same outputs; ``trunk.early_exit = True`` restores the stop)."""
    cfg = model.cfg
    if getattr(model.trunk, "exits", None) is not None:
        raise ConfigError(f"early exit per position ({model.trunk.exits.rule.label}) cannot be exported: "
                          "which positions run a pass depends on the data, and a program runs a fixed "
                          "depth (--depth K; docs/inference.md); export without it")
    if max_len is None:
        max_len = cfg.max_seq_len
    if not isinstance(max_len, int) or isinstance(max_len, bool) or not 2 <= max_len <= cfg.max_seq_len:
        raise ConfigError(f"--max-seq-len {max_len}: choose 2 .. {cfg.max_seq_len} (the model's "
                          "max_seq_len): the static cache holds that many positions per slot")
    set_model_depth(model, depth, extend_loops)
    model.trunk.fix_depth()
    return RunnerProgram(model.float().eval(), max_len).allocate()


def _single_id(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text).tolist()
    return ids[0] if len(ids) == 1 else None


def metadata(program: RunnerProgram, tokenizer=None) -> dict:
    """The constant methods of the program (names as executorch's llama export writes
    them). phaseloop trains on raw text with no BOS or EOS token: ``get_bos_id`` is the
    token of a newline (which ends every document phaseloop trains on; 0 if it is no
    single token), for a runner that must prepend one; ``get_eos_ids`` is empty, so a
    runner stops at its token budget or ``get_max_seq_len``."""
    tokenizer = tokenizer or ByteTokenizer()
    bos = _single_id(tokenizer, "\n")
    meta = {"get_max_seq_len": program.max_len, "get_max_context_len": program.max_len,
            "get_vocab_size": program.model.cfg.vocab_size, "get_bos_id": 0 if bos is None else bos,
            "get_eos_ids": [], "use_kv_cache": True, "use_sdpa_with_kv_cache": False,
            "enable_dynamic_shape": True}
    if program.model.trunk.program_steps:
        meta["get_act_steps"] = program.model.trunk.program_steps
    return meta
