"""Early exit per position at inference, and the KV cache shared across passes: a
weight-tied trunk (UT, Looped, Hyperloop) stops refining a position once another pass
would change little, or, for a UT trained with ACT, halts it at another threshold.

Rules (``parse_exit``; after every pass t but the last, for each position still running;
p_t is the next-token distribution after pass t, h_t the state):

* ``kl:EPS`` — KL(p_{t-1} || p_t) < EPS with p_0 uniform, p_t read through the end block
  (if the trunk has one), the final norm and the head (Huginn, Geiping et al. 2025, arXiv
  2502.05171 §6.1; its code's ``criterion="kl"``, default 5e-4);
* ``kl-lens:EPS`` — KL(p_t || p_{t-1}) < EPS with p_t read from the state by the norm and
  the head alone (a logit lens: a looped model's end block skipped), p_0 from the loop's
  input;
* ``entropy:EPS`` — |H(p_t) - H(p_{t-1})| < EPS, p_t as for ``kl``, H_0 = 100 nats (Huginn's
  ``criterion="entropy-diff"``, default 1e-3): as H(p_1) <= ln V, no position exits after
  the first pass while EPS <= 100 - ln V (94.45 at V = 256); above it, those whose H(p_1)
  > 100 - EPS do (the least certain ones: calibrate EPS below that bound);
* ``argmax:K`` — the argmax of the lens readout has not changed in the last K passes;
* ``state:EPS`` — ||h_t - h_{t-1}|| / ||h_{t-1}|| < EPS (Hyperloop: all n streams);
* ``accel:EPS`` — the second-order rule of Pappone, Crisostomi, Rodolà 2025 ("Two-Scale
  Latent Dynamics for Recurrent-Depth Transformers", arXiv 2509.23314): a_t =
  ||Δ_t - Δ_{t-1}||_2 with Δ_t = h_t - h_{t-1}, exit once a_t < EPS at two successive passes
  (the "two-hit" check; a_t exists from pass 2, so the first exit follows pass 3);
* ``act:THRESHOLD`` — a UT trained with ACT halts a position once its summed halting
  probability exceeds THRESHOLD instead of the trained 1 - act_epsilon (UT §2.2).

An exited position's state is copied to every later pass unchanged (as the UT paper says of
a halted ACT position, §2.2; tensor2tensor instead keeps transforming it, which phaseloop's
ACT follows). The later passes compute only the positions still running (``passes``); the
others' keys/values at those passes are filled by ``Exits.fill``: ``recompute`` (projected
from the frozen state: the result of running every pass with dense masks) or ``latest``
(the deepest keys/values it computed; Huginn §6). Readouts through the end block read an
exited position's keys/values from its last readout. Decisions depend on a position's own
states (and, through an end-block readout, on the positions before it in its row) only, so
cached decoding equals the full pass under either fill.

``set_kv_share(model, K)``: pass i reads and writes KV slot i mod K (Huginn §6.2), so the
cache holds K slots per looped layer instead of one per pass. Decoded tokens then read each
earlier token's keys of the latest pass in their slot's class, where the full pass reads
those of the same pass: the output depends on how the sequence is fed (``inference``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.linalg import vector_norm

from phaseloop import registry
from phaseloop.errors import ConfigError
from phaseloop.layers import apply_rope, compute_dtype
from phaseloop.passes import FILLS, Running, deepest_kv
from phaseloop.validation import MAX_DEPTH

PASS_RULES = ("kl", "kl-lens", "entropy", "argmax", "state", "accel")  # any weight-tied trunk without ACT
END_READ = ("kl", "entropy")  # read p_t through the trunk's end block (``Trunk.exit_readout``)
LENS_READ = ("kl-lens", "argmax")  # read p_t from the state, p_0 included
RULES = {"kl": "EPS >= 0", "kl-lens": "EPS >= 0", "entropy": "EPS >= 0",
         "argmax": f"K passes from 1 to {MAX_DEPTH} (config.MAX_DEPTH)",
         "state": "EPS >= 0", "accel": "EPS >= 0", "act": "THRESHOLD in (0, 1]"}
_SYNTAX = ("write RULE:V[,V...] with RULE kl:EPS, kl-lens:EPS, entropy:EPS, argmax:K, state:EPS, "
           "accel:EPS or act:THRESHOLD, e.g. kl:5e-4")
HUGINN_H0 = 100.0  # Huginn's initial entropy (nats)
REST_BATCH = 1 << 21  # input elements of the passes ``Monitor.rest`` projects together (8 MB in fp32)


@dataclass(frozen=True)
class ExitRule:
    kind: str  # a key of RULES
    value: float  # EPS, K (an int) or the ACT threshold

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.value:g}"


def _value(kind: str, text: str) -> float:
    try:
        v = int(text) if kind == "argmax" else float(text)
    except ValueError:
        raise ConfigError(f"exit rule {kind}: {text!r} is not a number; {kind} takes {RULES[kind]}") from None
    if kind == "argmax" and 1 <= v <= MAX_DEPTH:  # K >= the depth never exits; no loop is longer
        return v
    if kind == "act" and 0 < v <= 1:
        return v
    if kind not in ("argmax", "act") and math.isfinite(v) and v >= 0:
        return v
    raise ConfigError(f"exit rule {kind}:{text} is out of range: {kind} takes {RULES[kind]}")


def parse_exit(text: str) -> list[ExitRule]:
    """``"kl:1e-4,1e-3"`` -> one ExitRule per value (a sweep); one-line ConfigError otherwise."""
    kind, sep, values = text.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in RULES:
        raise ConfigError(f"unknown exit rule {text!r}: {_SYNTAX}")
    items = [v.strip() for v in values.split(",")]
    if not sep or not all(items):
        raise ConfigError(f"exit rule {text!r} lacks a value: {_SYNTAX}")
    rules = [ExitRule(kind, _value(kind, v)) for v in items]
    if len(set(rules)) != len(rules):
        raise ConfigError(f"exit rule {text!r}: a value is repeated")
    return rules


@dataclass
class Exits:
    """What a trunk's ``exits`` holds: the rule, the KV fill of skipped passes and the
    model's readout (plain references, not submodules: the state dict is unchanged)."""

    rule: ExitRule
    norm: torch.nn.Module
    head: torch.nn.Module
    fill: str = "recompute"

    def readout(self, h):
        return self.head(self.norm(h))


def _tied(attr: str) -> str:
    return ", ".join(s.name for s in registry.all_archs() if getattr(s.trunk, attr, ()))


def refuse_stack(model, what: str, flag: str, attr: str = "exit_rules") -> None:
    """One-line ConfigError where ``model``'s trunk has no passes for ``what``."""
    trunk = getattr(model, "trunk", None)
    if trunk is None:  # an encoder-decoder: its decoder cross-attends, which a pass over running rows does not
        raise ConfigError(f"a {model.cfg.arch} model cannot {what}: it is an encoder-decoder ({flag} applies to "
                          f"the decoder-only trunks: {_tied(attr)})")
    if getattr(trunk, attr, ()):
        return
    why = (f"its trunk declares no support (Trunk.{attr})" if trunk.dynamic_depth
           else "it is a stack of distinct layers")
    raise ConfigError(f"a {model.cfg.arch} model cannot {what}: {why} ({flag} applies to: {_tied(attr)})")


def set_exit(model, rule: ExitRule | None, fill: str = "recompute") -> None:
    """Apply ``rule`` to ``model``'s trunk from now on (None: no early exit, ACT at its
    trained threshold), the skipped passes' keys/values filled by ``fill``; one-line
    ConfigError where the trunk cannot."""
    if fill not in FILLS:  # before the model's own refusals: a bad value is named on any model
        raise ConfigError(f"--kv-fill {fill!r}: choose recompute or latest")
    refuse_stack(model, "exit early per position", "--exit")
    trunk = model.trunk
    if rule is not None and rule.kind not in trunk.exit_rules:
        if rule.kind == "act":
            raise ConfigError(f"exit rule {rule.label} sets an ACT halting threshold, but this "
                              f"{model.cfg.arch} model has no ACT; use {', '.join(PASS_RULES)}")
        raise ConfigError(f"exit rule {rule.label}: this {model.cfg.arch} model halts by ACT; "
                          "change its threshold with act:THRESHOLD (e.g. act:0.9)")
    if fill != "recompute" and (rule is None or rule.kind == "act"):
        raise ConfigError(f"--kv-fill {fill} applies to the pass rules ({', '.join(PASS_RULES)}): "
                          + ("add --exit RULE:V" if rule is None else "ACT keeps transforming a halted "
                             "position while the loop runs (tensor2tensor's semantics), so no pass is skipped"))
    trunk.exits = None if rule is None else Exits(rule, model.norm, model.head, fill)


def set_kv_share(model, k: int | None) -> None:
    """Pass i of the trunk's loop uses KV slot i mod ``k`` from now on (Huginn §6.2; None:
    one slot per pass); one-line ConfigError for a stack."""
    refuse_stack(model, "share its KV cache across passes", "--kv-share", "shares_kv")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ConfigError(f"--kv-share {k!r}: must be a positive integer (slots per looped layer)")
    model.trunk.kv_share = k


@dataclass
class Readout:
    """The logits [B*T, V] a rule read from ``state`` at the decision where every position
    stopped. Where the trunk returns that very state (a UT: nothing follows its loop) they
    are the model's logits (``take``, ``DecoderLM.forward``), not computed again, and that
    readout counts as the model's head: ``exit_readouts`` one fewer (``analysis.exits``)."""

    state: torch.Tensor
    logits_NV: torch.Tensor
    readouts: torch.Tensor

    def take(self, x_BTD: torch.Tensor) -> torch.Tensor | None:
        if x_BTD is not self.state:
            return None
        self.state = None  # taken once
        self.readouts.sub_(1)
        return self.logits_NV.view(*x_BTD.shape[:2], -1)


def monitor(trunk, x0, ctx, n_passes: int, merge=None) -> Monitor | None:
    """The hook a trunk calls before its loop (None when no pass rule is set)."""
    exits = trunk.exits
    if exits is None or exits.rule.kind not in PASS_RULES or n_passes < 2:  # one pass: no decision to make
        return None
    if ctx.cache is not None and ctx.cache.static:
        raise ConfigError(f"early exit ({exits.rule.label}) on a static KV cache: which positions run a pass "
                          "depends on the data, and a static cache holds a fixed depth; decode with a KVCache "
                          "or without the exit rule")
    return Monitor(trunk, x0, ctx, n_passes, merge)


def _vectors(x_N):
    """[N, ...] as [N, features] (a view; no op when it is that already)."""
    return x_N if x_N.dim() == 2 else x_N.flatten(1)


class Monitor:
    """Exit decisions of one forward call, per position ([B, T]). The trunk runs each pass
    under ``ctx`` (its ``running``: the positions still computing), calls ``hold(before,
    after)`` where a result of an exited position must be discarded and ``step(before,
    after)`` once per pass; ``finished``: nothing is left to compute or fill.
    ``ctx.stats``: ``exit_passes`` (passes each position ran), ``exit_readouts``."""

    def __init__(self, trunk, x0, ctx, n_passes: int, merge=None):
        exits = trunk.exits
        self.trunk, self.rule, self.exits, self.n, self.merge = trunk, exits.rule, exits, n_passes, merge
        B, T = x0.shape[:2]
        self.done = torch.zeros(B, T, dtype=torch.bool, device=x0.device)
        # passes and readouts of a position that runs to the end; those that stop after pass t
        # get t (``step``); a read (``_read``) at each decision, and p_0 from the input
        self.p0, self.reading = int(self.rule.kind in LENS_READ), self.rule.kind in END_READ + LENS_READ
        reads = n_passes - 1 + self.p0 if self.reading else 0
        self.passes = ctx.stats["exit_passes"] = torch.full((B, T), n_passes, dtype=torch.long, device=x0.device)
        self.readouts = ctx.stats["exit_readouts"] = torch.full((B, T), reads, dtype=torch.long, device=x0.device)
        self.t, self.base, self.exited, self.read = 0, ctx, False, None  # exited: some position stopped
        self.latest, self.read_latest, self.deepest = {}, {}, {}  # deepest: idle_pass's keys/values
        self._set_running(Running.uniform(~self.done, exits.fill, self.latest, True))
        kind, dtype = self.rule.kind, compute_dtype(x0.dtype)
        if kind in LENS_READ:
            self.prev = self._read(x0, None)  # p_0 from the loop's input
            self.same = torch.zeros(B * T, dtype=torch.long, device=x0.device)  # argmax: passes kept
        elif kind == "kl":
            V = exits.head.out_features
            self.prev = torch.full((B * T, V), -math.log(V), dtype=dtype, device=x0.device)
        elif kind == "entropy":
            self.prev = torch.full((B * T,), HUGINN_H0, dtype=dtype, device=x0.device)
        elif kind == "accel":
            self.delta = torch.zeros(B * T, x0[0, 0].numel(), dtype=x0.dtype, device=x0.device)
            self.hits = torch.zeros(B * T, dtype=torch.long, device=x0.device)

    def _set_running(self, run: Running | None = None):
        self.run = Running(~self.done, self.exits.fill, self.latest) if run is None else run
        self.ctx = self._with(self.run)

    def _with(self, run: Running):
        """The forward's context with ``run`` (dataclasses.replace without its __init__)."""
        ctx = object.__new__(type(self.base))
        ctx.__dict__.update(self.base.__dict__, running=run)
        return ctx

    @property
    def finished(self) -> bool:
        """No position runs and no cache waits for this pass's keys/values."""
        return not self.run.any and self.base.cache is None

    @property
    def idle(self) -> bool:
        """No position runs and the cache takes the deepest keys/values (``fill=latest``):
        the pass only copies them into its slots (``idle_pass``), its layers are not run."""
        return not self.run.any and self.run.fill == "latest"

    def idle_pass(self, x, layers) -> torch.Tensor:
        """A pass while ``idle``: each ``(layer, slot)``'s attention writes every position's
        deepest keys/values into ``slot`` (its ``forward_running`` with no position running),
        the rest of the layer is not called; then the pass's ``step``."""
        cache = self.base.cache
        if cache is not None:
            for layer, slot in layers:
                kv = self.deepest.get(id(layer.attn))
                if kv is None:  # idle from now on: ``latest`` no longer changes in this forward
                    kv = self.deepest[id(layer.attn)] = deepest_kv(layer.attn, self.run)
                cache.owe(slot, *kv)  # no query reads them before the slot's next write
        return self.step(x, x)

    @property
    def at_rest(self) -> bool:
        """No position runs (in this pass or any later one) and the cache takes each pass's keys/values."""
        return not self.run.any and self.base.cache is not None

    def rest(self, x, block, slots: dict, pass_inputs) -> torch.Tensor:
        """The passes left while ``at_rest``, for a trunk of one block (UT): pass s writes the
        block's keys/values into ``slots[s]`` and runs nothing else, then its ``step``. Under
        ``latest`` the deepest ones (``idle_pass``); under ``recompute`` those projected from
        ``pass_inputs(x, [s, ...])`` ([R, B, T, D]: the block's inputs at passes s, ..., of the
        frozen state), the passes' in batches: one norm, projection and rotation for a batch
        instead of one a pass, a batch holding at most ``REST_BATCH`` input elements (one pass
        a batch for a long prefill, all of them at decode). Either is owed to the cache."""
        if self.run.fill == "latest":
            for slot in slots.values():
                x = self.idle_pass(x, [(block, slot)])
            return x
        left, attn = list(slots.items()), block.attn
        group = max(1, REST_BATCH // x.numel())
        for chunk in (left[i:i + group] for i in range(0, len(left), group)):
            h_RBTD = pass_inputs(x, [s for s, _ in chunk])
            R, B = h_RBTD.shape[:2]
            k_NKTE, v_NKTE = attn.project_kv(block.attn_norm(h_RBTD.flatten(0, 1)))
            if attn.use_rope:  # tables [T, E], or per row [B, 1, T, E] (row r * B + b: row b's)
                cos, sin = (t if t.dim() == 2 else t.repeat(R, 1, 1, 1) for t in (self.base.cos, self.base.sin))
                k_NKTE = apply_rope(k_NKTE, cos, sin)
            for i, (_, slot) in enumerate(chunk):
                self.base.cache.owe(slot, k_NKTE[i * B:(i + 1) * B], v_NKTE[i * B:(i + 1) * B])
                x = self.step(x, x)
        return x

    def _mask(self, x):
        return self.done.view(*self.done.shape, *[1] * (x.dim() - 2))

    def hold(self, before, after):
        """``after`` with the exited positions' rows of ``before`` (their state frozen)."""
        if not self.exited:  # nothing to freeze
            return after
        return before if not self.run.any else torch.where(self._mask(after), before, after)

    def step(self, before, after):
        """End of a pass: freeze the exited positions, then decide who exits now."""
        run = self.run
        self.t += 1
        self.base.stats["exit_loop"] = self.t  # passes run (the keys filled); an int: no tensor a pass
        if not run.any:  # every position exited: the state is ``before``, nothing to decide
            if self.t < self.n and self.rule.kind in END_READ and self.base.cache is not None and \
                    self.trunk.readout_blocks:
                self._end_readout(before)  # the readout's cache slot still gets every position's keys
            return before
        x = self.hold(before, after)
        if self.t < self.n:  # nothing to decide after the last pass
            rows = None if run.all else run.flat_N
            stop_N = self._stop(before, x, rows)
            # the decision's host read (of a single position: no reduction); none stopped: the same positions
            # run on, and no new ``Running`` (whose gather indices read the device again, ``passes.Running``)
            stopped = int(stop_N) if stop_N.numel() == 1 else int(stop_N.sum())
            if stopped:
                if rows is not None:
                    stop_N = torch.zeros_like(self.done).view(-1).index_copy(0, rows, stop_N)
                stop_BT = stop_N.view_as(self.done)
                if rows is None and self.exited:  # a pass that ran the exited positions too (dense)
                    stop_BT = stop_BT & ~self.done
                self.done, self.exited = self.done | stop_BT, True
                self.passes.masked_fill_(stop_BT, self.t)
                if self.reading:
                    self.readouts.masked_fill_(stop_BT, self.t + self.p0)
                none_left = stopped == run.n  # every running position stopped: no new reduction
                if none_left and rows is None and self.read is not None and self.read[0] is x:
                    self.base.readout = Readout(x, self.read[1], self.readouts)
                self._set_running(Running.uniform(~self.done, self.exits.fill, self.latest, False) if none_left
                                  else None)
        return x

    @staticmethod
    def _rows(x, rows, flat: bool = False):
        """[N, ...] rows of [B, T, ...] (of [B*T, ...] if ``flat``; all when ``rows`` is None)."""
        x = x if flat else x.flatten(0, 1)
        return x if rows is None else x.index_select(0, rows)

    def _read(self, x, rows, end: bool = False):
        """log p [N, V] of the next token for ``rows``, read from state ``x`` (fp32 at least)."""
        h = self._end_readout(x) if end else x if self.merge is None else self.merge(x)
        h_N = self._rows(h, rows)
        logits_NV = self.exits.readout(h_N)
        self.read = (x, logits_NV) if rows is None and h is x else None  # the model's own, if x is final
        return F.log_softmax(logits_NV.to(compute_dtype(h_N.dtype)), dim=-1)

    def _end_readout(self, x):
        """The state after this pass through the trunk's end block, over the running
        positions; the others' keys/values there are those of their last readout."""
        ctx = self._with(self.run.with_fill("latest", self.read_latest))
        return self.trunk.exit_readout(x if self.merge is None else self.merge(x), ctx, self.t - 1)

    def _stop(self, before, x, rows):
        eps, kind = self.rule.value, self.rule.kind
        if kind in ("state", "accel"):
            b = _vectors(self._rows(before, rows))
            delta = _vectors(self._rows(x, rows)) - b
            if kind == "state":  # eps = 0: never
                return vector_norm(delta, dim=-1) < eps * vector_norm(b, dim=-1)
            prev = self._rows(self.delta, rows, flat=True)
            hit = vector_norm(delta - prev, dim=-1) < eps
            hits = torch.where(hit, self._rows(self.hits, rows, flat=True) + 1, 0) * (self.t >= 2)
            self._put("delta", rows, delta)
            self._put("hits", rows, hits)
            return hits >= 2
        logp = self._read(x, rows, end=kind in END_READ)
        prev = self._rows(self.prev, rows, flat=True)
        if kind == "entropy":
            H = -(logp.exp() * logp).sum(-1)
            self._put("prev", rows, H)
            return (H - prev).abs() < eps
        self._put("prev", rows, logp)
        if kind == "kl":  # KL(p_{t-1} || p_t), as Huginn's F.kl_div(log p_t, log p_{t-1}, log_target=True)
            return (prev.exp() * (prev - logp)).sum(-1).clamp_min(0) < eps
        if kind == "kl-lens":  # KL(p_t || p_{t-1}) >= 0 (rounding clamped): eps = 0 never exits
            return (logp.exp() * (logp - prev)).sum(-1).clamp_min(0) < eps
        kept = logp.argmax(-1) == prev.argmax(-1)
        same = torch.where(kept, self._rows(self.same, rows, flat=True) + 1, 0)
        self._put("same", rows, same)
        return same >= eps

    def _put(self, name, rows, value):
        """Store ``value`` [N, ...] as the rows of attribute ``name`` [B*T, ...]."""
        old = getattr(self, name)
        setattr(self, name, value.to(old.dtype) if rows is None else old.index_copy(0, rows, value.to(old.dtype)))
