"""Early exit per position at inference: a weight-tied trunk (UT, Looped,
Hyperloop) stops refining a position once another pass would change little, or, for a UT
trained with ACT, halts it at another threshold than the trained one.

Rules (``parse_exit``; after every pass t but the last, for each position still running):

* ``kl:EPS`` — KL(p_t || p_{t-1}) < EPS between the next-token distributions of two
  successive passes (CALM's "softmax response" family, Schuster et al. 2022, §3.2, with
  the distributions' change as the confidence);
* ``argmax:K`` — the argmax of p has not changed in the last K passes;
* ``state:EPS`` — ||h_t - h_{t-1}|| / ||h_{t-1}|| < EPS (the state's relative change;
  Hyperloop: all n streams);
* ``act:THRESHOLD`` — a UT trained with ACT halts a position once its summed halting
  probability exceeds THRESHOLD instead of the trained 1 - act_epsilon (UT §2.2).

p_t is read from the state as the model reads its output: the final norm and the LM head
applied to h_t (Hyperloop: to the streams' mean), p_0 from the loop's input. For a looped
model this skips the end block (a "logit lens"): the rule compares passes, not outputs.
Those readouts are the rules' extra cost, 2 d_model V FLOPs per running position and pass
(none after the last pass), counted in ``exit_flops``.

An exited position's state is carried forward unchanged (``Monitor.hold``: the layers of
a pass read it as their input and their result for it is discarded, each layer's, so a
pass's every layer projects its keys/values from the frozen state: CALM's state
propagation, §3.3); later positions keep attending to it. Every pass still runs for every
position (the masks are dense), so the KV cache holds the keys/values the full pass holds,
cached decoding equals the full pass with the same exit decisions, and a position's
decisions depend on its own states only, with or without the cache. The FLOPs an exit
saves are counted (``exit_flops``: a skipped pass costs its keys/values only), not taken
off the wall clock. Stacks have no passes to skip and are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phaseloop import registry
from phaseloop.errors import ConfigError
from phaseloop.layers import compute_dtype

PASS_RULES = ("kl", "argmax", "state")  # any weight-tied trunk without ACT
RULES = {"kl": "EPS >= 0", "argmax": "K >= 1 passes", "state": "EPS >= 0", "act": "THRESHOLD in (0, 1]"}
_SYNTAX = "write RULE:V[,V...] with RULE kl:EPS, argmax:K, state:EPS or act:THRESHOLD, e.g. kl:1e-3"


@dataclass(frozen=True)
class ExitRule:
    kind: str  # kl | argmax | state | act
    value: float  # EPS, K (an int) or the ACT threshold

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.value:g}"


def _value(kind: str, text: str) -> float:
    try:
        v = int(text) if kind == "argmax" else float(text)
    except ValueError:
        raise ConfigError(f"exit rule {kind}: {text!r} is not a number; {kind} takes {RULES[kind]}") from None
    if kind == "argmax" and v >= 1:
        return v
    if kind == "act" and 0 < v <= 1:
        return v
    if kind in ("kl", "state") and math.isfinite(v) and v >= 0:
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
    """What a trunk's ``exits`` holds: the rule and the model's readout (not submodules of
    the trunk: plain references, so the state dict is unchanged)."""

    rule: ExitRule
    norm: torch.nn.Module
    head: torch.nn.Module

    def readout(self, h):
        return self.head(self.norm(h))


def set_exit(model, rule: ExitRule | None) -> None:
    """Apply ``rule`` to ``model``'s trunk from now on (None: no early exit, ACT at its
    trained threshold); one-line ConfigError where the trunk cannot exit."""
    trunk = model.trunk
    rules = getattr(trunk, "exit_rules", ())
    if not rules:
        tied = ", ".join(s.name for s in registry.all_archs() if getattr(s.trunk, "exit_rules", ()))
        what = ("its trunk declares no early-exit rules (Trunk.exit_rules)" if trunk.dynamic_depth
                else "it is a stack of distinct layers")
        raise ConfigError(f"a {model.cfg.arch} model cannot exit early per position: {what} "
                          f"(--exit applies to: {tied})")
    if rule is not None and rule.kind not in rules:
        if rule.kind == "act":
            raise ConfigError(f"exit rule {rule.label} sets an ACT halting threshold, but this "
                              f"{model.cfg.arch} model has no ACT; use kl, argmax or state")
        raise ConfigError(f"exit rule {rule.label}: this {model.cfg.arch} model halts by ACT; "
                          "change its threshold with act:THRESHOLD (e.g. act:0.9)")
    trunk.exits = None if rule is None else Exits(rule, model.norm, model.head)


def monitor(trunk, x0, ctx, n_passes: int, merge=None) -> Monitor | None:
    """The hook a trunk calls before its loop (None when no pass rule is set)."""
    exits = trunk.exits
    if exits is None or exits.rule.kind not in PASS_RULES:
        return None
    return Monitor(exits, x0, ctx, n_passes, merge)


class Monitor:
    """Exit decisions of one forward call, per position ([B, T]); the trunk calls
    ``hold(before, after)`` after each layer of a pass and ``step(before, after)`` once per
    pass. ``ctx.stats``: ``exit_passes`` (passes each position ran) and ``exit_readouts``
    (readouts of the norm + head for it)."""

    def __init__(self, exits: Exits, x0, ctx, n_passes: int, merge=None):
        self.rule, self.exits, self.n, self.merge = exits.rule, exits, n_passes, merge
        B, T = x0.shape[:2]
        self.done = torch.zeros(B, T, dtype=torch.bool, device=x0.device)
        self.passes = ctx.stats["exit_passes"] = torch.zeros(B, T, dtype=torch.long, device=x0.device)
        self.readouts = ctx.stats["exit_readouts"] = torch.zeros_like(self.passes)
        self.t = 0
        if self.rule.kind != "state":
            self.prev = self._read(x0, ~self.done)
            self.same = torch.zeros_like(self.passes)  # argmax: passes that kept it

    def _mask(self, x):
        return self.done.view(*self.done.shape, *[1] * (x.dim() - 2))

    def hold(self, before, after):
        """``after`` with the exited positions' rows of ``before`` (their state frozen)."""
        return torch.where(self._mask(after), before, after)

    def step(self, before, after):
        """End of a pass: freeze the exited positions, then decide who exits now."""
        x = self.hold(before, after)
        running = ~self.done
        self.passes += running
        self.t += 1
        if self.t < self.n:  # nothing to decide after the last pass
            self.done = self.done | (running & self._stop(before, x, running))
        return x

    def _read(self, x, running):
        """log p of the next token read from state ``x`` (fp32 at least; float64 kept)."""
        self.readouts += running
        h = x if self.merge is None else self.merge(x)
        return F.log_softmax(self.exits.readout(h).to(compute_dtype(h.dtype)), dim=-1)

    def _stop(self, before, x, running):
        eps = self.rule.value
        if self.rule.kind == "state":
            change = (x - before).flatten(2).norm(dim=-1)
            return change < eps * before.flatten(2).norm(dim=-1)  # eps = 0: never
        logp = self._read(x, running)
        prev, self.prev = self.prev, logp
        if self.rule.kind == "kl":  # KL(p_t || p_{t-1}) >= 0 (rounding clamped): eps = 0 never exits
            return (logp.exp() * (logp - prev)).sum(-1).clamp_min(0) < eps
        kept = logp.argmax(-1) == prev.argmax(-1)
        self.same = torch.where(kept, self.same + 1, 0)
        return self.same >= eps
