"""Universal Transformer (Dehghani et al. 2019, arXiv 1807.03819): what is new about it.

One ``layers.Block`` (self-attention + transition) with one set of weights is applied T
times in depth ("parameters are tied across positions and time steps", §2.1). Before every
step the coordinate signal P^t(i) = position signal(i) + step signal(t) is added. With
``act=True`` each position decides how many steps it takes (ACT, §2.2), through the one
implementation of the halting arithmetic in ``phaseloop.archs.act``.

Conventions (tensor2tensor ``universal_transformer_util``):

* Sinusoids are ``get_timing_signal_1d``: the sin half and the cos half *concatenated* (not
  interleaved as the paper writes them), timescales 1 .. 1e4; 0-based token positions and steps.
* ``step_signal="learned"``: one vector per trained step (``n_steps``, or the ACT max
  steps). Past the trained steps (depth extrapolation) the **last learned vector is
  reused** (clamped), so a model trained with T steps runs any number of steps.
* Depth at inference: ``trunk.set_steps(n)`` (or ``forward(..., steps=n)``) changes the
  number of applications (the ACT loop bound under ACT) without touching the weights.
* The block is the shared ``layers.Block``: by default Llama-style (RMSNorm, SwiGLU, no
  biases) *and RoPE in every attention*, on top of the coordinate signal. The published model
  is ``ffn="relu", norm="layer", bias=True, use_rope=False`` (ReLU transition with biases,
  LayerNorm with gain and bias, attention biases, the coordinate sinusoid the only position
  signal): the ``universal-paper-*`` presets.

ACT semantics (t2t "basic" / Graves "accumulated" / t2t's line as written, "t2t_literal":
``act.combine``): the halting unit reads the step input (state + coordinate signal); every
position's state keeps being transformed at every loop iteration, also after it halted — a
halted position only gets update weight 0 in the output, and it stays visible to attention
at later steps. Position j's output therefore depends only on positions <= j (those at
steps <= its own n_updates), never on how long other positions run. The forward stops the
loop once no (new) position runs (``act_early_exit``, as tensor2tensor), also with a cache.

KV cache under ACT (lazy step extension): slot ``("ut", t)`` holds the keys/values of the
positions computed at step t, a prefix [0, c_t) of the sequence with c_0 >= c_1 >= ...;
entry ``("ut_in", t)`` (``PendingInputs``) holds the step-t inputs (transformed states of
step t-1) of the positions [c_t, c_{t-1}) that stopped before step t. A call runs only the
steps its new tokens need (early exit); when step t runs, the earlier positions that
stopped before it are first caught up (their pending step-t inputs are prepended to the
new tokens), so every attention at step t sees all earlier positions at step t, exactly
as in the full pass. Each (position, step) is computed once, and never past the last step
any later token needed. Outputs equal the full forward pass (a caught-up step gets weight
0 and changes nothing a position attends to), which the tests check in float64.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from phaseloop.archs import act
from phaseloop.archs.act import ACTState, PendingInputs, combine, ponder_cost, ponder_diagnostics, ponder_loss
from phaseloop.archs.seq2seq import EncoderDecoder
from phaseloop.config import MAX_DEPTH, ModelConfig, fail
from phaseloop.data.tokenizer import PAD
from phaseloop.early_exit import PASS_RULES, monitor
from phaseloop.errors import ConfigError
from phaseloop.layers import Block, ForwardContext, position_table, timing_signal
from phaseloop.registry import ArchSpec, register_arch
from phaseloop.trunk import DerivedBuffers, Trunk
from phaseloop.validation import check_ints

_ACT_FIELDS = ("act_type", "act_epsilon", "act_max_steps", "act_loss_weight",
               "act_halting_bias_init", "act_early_exit")


@dataclass
class UniversalOptions:
    """arch='universal': one shared block (n_layers = 1) applied n_steps times (UT §2.1),
    optionally with per-position ACT halting (§2.2)."""

    # the weights replace the bias's initial value; the ponder weight is a training term; early
    # exit computes the same output (registry.same_function_fields)
    same_function: ClassVar[tuple[str, ...]] = ("act_halting_bias_init", "act_loss_weight", "act_early_exit")
    n_steps: int = 6  # T, applications of the shared block (overridable at inference)
    step_signal: str = "sinusoid"  # step part of the coordinate signal: sinusoid | learned
    act: bool = False  # adaptive computation time per position (UT §2.2)
    act_type: str = "basic"  # basic (interpolating) | accumulated (Graves) | t2t_literal (see act.py)
    act_epsilon: float = 0.01  # a position halts once its summed halting prob. > 1 - eps
    act_max_steps: int | None = None  # None -> 2 * n_steps (see act_steps)
    act_loss_weight: float = 0.01  # ponder loss weight (added to the loss, logged apart)
    act_halting_bias_init: float = 1.0  # bias of the halting unit (tensor2tensor: 1.0)
    act_early_exit: bool = True  # uncached forward stops once no position runs (same output)

    @property
    def act_steps(self) -> int:
        """ACT max steps: the field, else 2 x the nominal step count (UT §2.2)."""
        return self.act_max_steps or 2 * self.n_steps

    def validate(self, cfg: ModelConfig) -> None:
        if cfg.n_layers != 1:
            fail("n_layers", cfg.n_layers, "arch='universal' applies ONE shared block; set "
                 "n_layers=1 (its default) and the number of applications with n_steps")
        check_ints(self, ("n_steps",), "config")
        check_ints(self, ("act_max_steps",), "config", optional=True)
        if self.step_signal not in ("sinusoid", "learned"):
            fail("step_signal", self.step_signal, "choose sinusoid or learned")
        if self.act_type not in ("basic", "accumulated", "t2t_literal"):
            fail("act_type", self.act_type, "choose basic (tensor2tensor, documented), accumulated "
                 "(Graves) or t2t_literal (tensor2tensor's code as written)")
        if not 0 < self.act_epsilon < 1:
            fail("act_epsilon", self.act_epsilon, "must be in (0, 1); the threshold is 1 - eps")
        if not self.act_loss_weight >= 0:
            fail("act_loss_weight", self.act_loss_weight, "must be >= 0")
        if not self.act:
            for name in _ACT_FIELDS:
                if getattr(self, name) != ModelConfig.default_of(name):
                    fail(name, getattr(self, name), "is an ACT option; set act=true or drop it")


class CoordinateSignal(DerivedBuffers, nn.Module):
    """P^t(i) = position sinusoid(i) + step signal(t) (UT §2.1), added before every step."""

    def __init__(self, cfg: ModelConfig, trained_steps: int):
        super().__init__()
        self.d_model = cfg.d_model
        self.step_table: nn.Parameter | None = None
        if cfg.step_signal == "learned":
            # tensor2tensor: N(0, d^-1/2) scaled by sqrt(d), i.e. N(0, 1)
            self.step_table = nn.Parameter(torch.randn(trained_steps, cfg.d_model))
        else:  # precomputed for the trained steps (decoding calls step() once per step)
            self.register_buffer("step_sinusoid", timing_signal(torch.arange(trained_steps), cfg.d_model),
                                 persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the derived buffer (a model loaded onto the meta device first)."""
        if self.step_table is None:
            self.step_sinusoid.copy_(timing_signal(torch.arange(len(self.step_sinusoid)), self.d_model))

    def position(self, start: int, T: int, device, positions_BT: torch.Tensor | None = None, cache=None):
        """[T, D] at positions start .. start + T - 1 (``position_table``), or [B, T, D] at ``positions_BT``."""
        if positions_BT is not None:
            return timing_signal(positions_BT.flatten(), self.d_model).view(*positions_BT.shape, -1)
        return position_table(cache, ("ut", self.d_model), start, T, device, lambda p: timing_signal(p, self.d_model))

    def step(self, t: int, device) -> torch.Tensor:
        """[D] signal of 0-based step t; a learned table is clamped to its last row."""
        if self.step_table is not None:
            return self.step_table[min(t, self.step_table.shape[0] - 1)]
        if t < self.step_sinusoid.shape[0]:
            return self.step_sinusoid[t]
        return timing_signal(torch.tensor([t], device=device), self.d_model)[0]

    def forward(self, x_BTD: torch.Tensor, pos_TD: torch.Tensor, t: int) -> torch.Tensor:
        return x_BTD + (pos_TD + self.step(t, x_BTD.device)).to(x_BTD.dtype)

    def over(self, x_BTD: torch.Tensor, pos_TD: torch.Tensor, steps: list[int]) -> torch.Tensor:
        """[R, B, T, D]: ``forward(x, pos, t)`` for each t of ``steps``, bit for bit, in
        two ops (a slice of the step table where the steps are consecutive rows of it)."""
        table = self.step_table if self.step_table is not None else self.step_sinusoid
        if steps[-1] < table.shape[0] and steps == list(range(steps[0], steps[-1] + 1)):
            step_RD = table[steps[0]:steps[-1] + 1]
        else:
            step_RD = torch.stack([self.step(t, x_BTD.device) for t in steps])
        signal = (pos_TD[None] + step_RD.view(len(steps), *[1] * (pos_TD.dim() - 1), -1)).to(x_BTD.dtype)
        return x_BTD[None] + (signal[:, None] if pos_TD.dim() == 2 else signal)


class UniversalTrunk(Trunk):
    """One shared block applied ``steps`` times, with the coordinate signal and optional ACT.

    ``forward(x, ctx, steps=None)``: ``steps`` overrides ``self.steps`` (the number of
    applications, or the ACT loop bound). ``cross=True`` gives the block a cross-attention
    sub-layer to ``ctx.memory`` (the UT decoder, seq2seq.py), shared across steps.
    Under ACT: ``ctx.aux_losses["ponder_loss"]`` = act_loss_weight * mean(n_updates +
    remainders); ``ctx.stats["ponder_time"]`` [B, T] = n_updates + remainders and
    ``ctx.stats["halting_probs"]`` [steps run, B, T].
    """

    def __init__(self, cfg: ModelConfig, cross: bool = False):
        super().__init__()
        if UniversalOptions not in cfg.spec.options:
            raise ConfigError.invalid(f"arch={cfg.arch!r}: UniversalTrunk needs arch='universal'")
        self.cfg = cfg
        self.block = Block(cfg, 0, 1, cross=cross)
        self.trained_steps = cfg.act_steps if cfg.act else cfg.n_steps
        self.steps = self.trained_steps
        self.signal = CoordinateSignal(cfg, self.trained_steps)
        self.halting = act.HaltingUnit(cfg) if cfg.act else None
        self.depth = cfg.n_steps  # nominal residual layer applications (init scaling)
        # ACT may stop once every position halted (same output); FSDP2 turns it off, as
        # its block all-gathers need every rank to apply the block equally often
        self.early_exit = cfg.act_early_exit
        self.exit_rules = ("act",) if cfg.act else PASS_RULES  # early_exit.set_exit

    dynamic_depth = True
    exit_rules = (*PASS_RULES, "act")  # this arch's, with or without ACT
    shares_kv = True  # step t uses slot ("ut", kv_slot(t))

    @property
    def passes(self) -> int:
        return self.steps

    def set_steps(self, steps: int) -> None:
        """Depth extrapolation: run ``steps`` applications (ACT: max steps) from now on."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError(f"invalid steps={steps!r}: must be a positive integer")
        if steps > MAX_DEPTH:
            raise ConfigError(f"invalid steps={steps}: at most {MAX_DEPTH} steps (config.MAX_DEPTH)")
        self.steps = steps

    def set_depth(self, n: int, extend: str | None = None) -> None:
        """= ``set_steps``; every step shares the weights, so ``extend`` changes nothing
        (a learned step signal past the trained steps already reuses the last vector)."""
        if extend not in (None, "last"):
            raise ConfigError(f"invalid extend={extend!r}: choose 'last' (or leave it unset)")
        self.set_steps(n)

    def compile_targets(self) -> list:  # the shared block, and ACT's halting unit
        return super().compile_targets() + ([(self.halting, "forward")] if self.halting is not None else [])

    def reset_depth(self) -> None:
        self.steps = self.trained_steps

    def fix_depth(self) -> None:
        self.early_exit = False  # every step runs; halted positions keep weight 0 (same output)

    def cache_slots(self) -> list:  # ACT also keeps the pending step inputs ("ut_in", t)
        pending = [("ut_in", t) for t in range(1, self.steps + 1)] if self.halting is not None else []
        return list(dict.fromkeys(("ut", self.kv_slot(t)) for t in range(self.steps))) + pending

    def forward(self, x_BTD: torch.Tensor, ctx: ForwardContext, steps: int | None = None) -> torch.Tensor:
        steps = self.steps if steps is None else steps
        pos_TD = self.signal.position(ctx.start_pos, x_BTD.shape[1], x_BTD.device, ctx.positions, ctx.cache)
        if self.halting is None:
            mon = monitor(self, x_BTD, ctx, steps)  # early exit per position (early_exit.py)
            for t in range(steps):
                if mon is not None and mon.finished:
                    break
                if mon is not None and mon.at_rest:  # no position runs again: the passes left fill keys/values
                    return mon.rest(x_BTD, self.block, {s: ("ut", self.kv_slot(s)) for s in range(t, steps)},
                                    lambda x, ss: self.signal.over(x, pos_TD, ss))
                y_BTD = self.block(self.signal(x_BTD, pos_TD, t), mon.ctx if mon else ctx, ("ut", self.kv_slot(t)))
                x_BTD = y_BTD if mon is None else mon.step(x_BTD, y_BTD)
            return x_BTD
        return self._act(x_BTD, ctx, steps, pos_TD)

    def _act(self, x_BTD, ctx: ForwardContext, steps: int, pos_TD) -> torch.Tensor:
        cfg = self.cfg
        # an inference-time threshold (early_exit rule act:THRESHOLD) replaces the trained one
        threshold = 1.0 - cfg.act_epsilon if self.exits is None else self.exits.rule.value
        cache, end = ctx.cache, ctx.start_pos + x_BTD.shape[1]
        # the lazy step extension below keeps pending step inputs in a KVCache; a static
        # cache (export) holds keys/values of every step instead: all steps run, none pends
        lazy = cache is not None and not cache.static
        # meta tensors (``phaseloop params``) cannot be read: count all max steps
        early_exit = self.early_exit and x_BTD.device.type != "meta" and (cache is None or lazy)
        state: ACTState | None = None
        out_BTD = torch.zeros_like(x_BTD)  # previous_state
        probs = []
        y_BND, lo, ctx_t = x_BTD, ctx.start_pos, ctx  # step input of positions [lo, end)
        for t in range(steps):
            pending = cache.entries.pop(("ut_in", t), None) if lazy else None
            if pending is not None:  # catch up earlier positions that stopped before step t
                y_BND, lo = torch.cat([pending.x, y_BND], 1), pending.start
                ctx_t, pos_TD = self._widen(ctx, lo, end)
            new = slice(ctx.start_pos - lo, None)  # own tokens; [:, 0:] is a free alias
            y_BND, out_BTD, state, p_BT = self.act_step(t, y_BND, ctx_t, pos_TD, state, out_BTD, threshold, new)
            probs.append(p_BT.detach())
            # the early exit reads a tensor on the host: compiled, every step runs (a halted
            # position's weights are 0 from then on, so the output is the same)
            if early_exit and not torch.compiler.is_compiling() and not bool(state.running(threshold, steps).any()):
                break
        if lazy:  # step t+1 inputs of [lo, end) wait for a token that needs it
            waiting = cache.entries.get(("ut_in", t + 1))
            if waiting is None:
                cache.entries[("ut_in", t + 1)] = PendingInputs(lo, y_BND)
            else:
                waiting.extend(lo, y_BND)
        ctx.aux_losses["ponder_loss"] = ponder_loss(state, cfg.act_loss_weight)
        ctx.stats["ponder_time"] = ponder_cost(state).detach()
        ctx.stats["exit_passes"] = state.n_updates.detach()  # steps each position used
        ctx.stats["halting_probs"] = torch.stack(probs)
        return out_BTD

    def act_step(self, t: int, y_BND, ctx: ForwardContext, pos_TD, state: ACTState | None, out_BTD,
                 threshold: float, new: slice = slice(None)):
        """ACT step ``t`` (UT §2.2) over step inputs ``y_BND`` of the positions ``ctx`` covers; rows
        ``new`` halt, the others are caught up (no weight). -> (next inputs, output, state, p)."""
        h_BND = self.signal(y_BND, pos_TD, t)
        p_BT = self.halting(h_BND[:, new])
        if state is None:
            state = ACTState.like(p_BT)
        w_BT = state.step(p_BT, threshold)  # the one implementation (act.py)
        y_BND = self.block(h_BND, ctx, ("ut", self.kv_slot(t)))  # transformed = next step input
        return y_BND, combine(out_BTD, y_BND[:, new], w_BT.to(out_BTD.dtype), self.cfg.act_type), state, p_BT

    @property
    def program_steps(self) -> int:
        """ACT's loop bound: an exported program runs it one step method at a time (Trunk)."""
        return self.steps if self.halting is not None else 0

    def program_step(self, t: int, x_1ND, input_pos_N, hp_1N, rem_1N, n_1N, out_1ND, cache):
        """ACT step ``t`` as an exported method (deploy/program.py ``ActStep``: its contract)."""
        ctx = ForwardContext.at(self.cfg, 0, x_1ND.shape[1], x_1ND.device, input_pos_N[None], cache=cache)
        pos_TD = self.signal.position(0, x_1ND.shape[1], x_1ND.device, input_pos_N[None])
        threshold = 1.0 - self.cfg.act_epsilon
        y, out, state, _ = self.act_step(t, x_1ND, ctx, pos_TD, ACTState(hp_1N, rem_1N, n_1N), out_1ND, threshold)
        return (y, state.halting_probability, state.remainders, state.n_updates, out,
                state.running(threshold, self.steps).any().reshape(1))

    def _widen(self, ctx: ForwardContext, lo: int, end: int):
        """ForwardContext and position signal for positions [lo, end) (catch-up with a cache)."""
        wide = ForwardContext.at(self.cfg, lo, end - lo, ctx.cos.device)
        return (dataclasses.replace(ctx, cos=wide.cos.to(ctx.cos.dtype), sin=wide.sin.to(ctx.sin.dtype),
                                    start_pos=lo),
                self.signal.position(lo, end - lo, ctx.cos.device))


# ---------------------------------------------------------------------------- seq2seq
def _side(cfg: ModelConfig, act: bool | None) -> ModelConfig:
    """The config of one side: ``act`` overrides cfg.act (the ACT options go with it)."""
    if act is None or act == cfg.act:
        return cfg
    if act:
        return cfg.replace(act=True)
    return cfg.replace(act=False, **{k: ModelConfig.default_of(k) for k in _ACT_FIELDS})


class UniversalSeq2Seq(EncoderDecoder):
    """UT encoder-decoder (UT §2): shared encoder block, shared decoder block with its
    cross-attention to the encoder's final state; ACT on either side.
    Depth at inference: ``model.set_steps(n)`` (both sides)."""

    def __init__(self, cfg: ModelConfig, encoder_act: bool | None = None,
                 decoder_act: bool | None = None, pad_id: int = PAD):
        if UniversalOptions not in cfg.spec.options:
            raise ConfigError.invalid(f"arch={cfg.arch!r}: UniversalSeq2Seq needs "
                              "arch='universal' (use TransformerSeq2Seq for a stack)")
        super().__init__(cfg, pad_id)
        self.encoder = UniversalTrunk(_side(cfg, encoder_act))
        self.decoder = UniversalTrunk(_side(cfg, decoder_act), cross=True)
        self.depth = 2 * cfg.n_steps
        self._init(self.depth)

    dynamic_depth = True

    def set_steps(self, steps: int) -> None:
        self.encoder.set_steps(steps)
        self.decoder.set_steps(steps)

    def set_depth(self, n: int, extend: str | None = None) -> None:
        """The trunk interface's name for ``set_steps`` (both sides; ``extend`` as UniversalTrunk's)."""
        self.encoder.set_depth(n, extend)
        self.decoder.set_depth(n, extend)

    def reset_depth(self) -> None:  # each side's own trained steps (ACT may be on one side only)
        self.encoder.reset_depth()
        self.decoder.reset_depth()


# Token embeddings at std d^-1/2 times sqrt(d) (tensor2tensor), so they are not drowned
# by the unit-scale coordinate signal.
def _ut(d: int, **kw) -> dict:
    return dict(n_layers=1, d_model=d, embed_scale=True,
                embed_init_std=d ** -0.5, **kw)


# The published block (Dehghani et al. 2019 / tensor2tensor): ReLU FFN with d_ff = 4d,
# biases, LayerNorm, no RoPE, plain multi-head attention, embedding shared with the softmax.
def _ut_paper(d: int, **kw) -> dict:
    return _ut(d, d_ff=4 * d, ffn="relu", norm="layer", bias=True, use_rope=False,
               tie_embeddings=True, **kw)


SPEC = register_arch(ArchSpec(
    name="universal",
    trunk=UniversalTrunk,
    options=(UniversalOptions,),
    defaults={"n_layers": 1},
    layers="1: the one shared block (the depth is n_steps, or ACT's per-position steps)",
    paper="Dehghani et al., Universal Transformers, ICLR 2019 (arXiv 1807.03819)",
    aliases=("ut",),
    preset_prefixes=("universal", "ut"),
    modifiers={"act": {"act": True}},  # ACT halting (UT §2.2)
    shrink=lambda cfg: {},  # n_layers is 1 already
    seq2seq=UniversalSeq2Seq,
    seq2seq_name="universal-seq2seq",
    task_offsets=True,  # --paper: random position offsets for length generalisation (UT §4)
    diagnostics=ponder_diagnostics,
    presets={
        "universal-paper-tiny": _ut_paper(96, n_heads=6, n_steps=4, vocab_size=256, max_seq_len=64),
        "universal-paper-small": _ut_paper(192, n_heads=6, n_steps=6, vocab_size=256, max_seq_len=128),
        "universal-tiny": _ut(96, n_heads=6, n_kv_heads=3, d_ff=256, n_steps=4, vocab_size=256,
                              max_seq_len=64),
        "universal-act-tiny": _ut(96, n_heads=6, n_kv_heads=3, d_ff=256, n_steps=3, act=True,
                              vocab_size=256, max_seq_len=64),
        "universal-small": _ut(192, n_heads=6, n_kv_heads=3, d_ff=768, n_steps=6, vocab_size=256,
                           max_seq_len=128),
        "universal-act-small": _ut(192, n_heads=6, n_kv_heads=3, d_ff=768, n_steps=6, act=True,
                               vocab_size=256, max_seq_len=128),
},
))
