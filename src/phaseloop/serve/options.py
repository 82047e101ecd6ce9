"""Per-request phaseloop options (the request body's ``phaseloop`` field), resolved in one
place: ``resolve`` checks them against the served model and returns the ``Settings`` a
sequence decodes with; ``applied`` puts them on the model around one forward of the decode
loop. Requests with equal settings share a batch (``engine``); each settings group runs its
own forward, since rows at different depths would need different cache slots.

* ``depth`` (+ ``extend_loops``): UT steps / loop passes (``depth.set_model_depth``);
* ``exit``: one early-exit rule, ``kl:EPS`` ... (``early_exit.parse_exit`` / ``set_exit``);
* ``kv_share``: pass i uses KV slot i mod K (Huginn §6.2; ``early_exit.set_kv_share``),
  applied around each forward of its group as depth and exit are;
* ``speculative`` (+ ``draft_tokens``): self-speculative decoding, drafts at that many
  passes verified at the full depth (``inference.check`` refuses what cannot); such a
  sequence decodes as its own group, one draft/verify round per turn (``speculative``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

from phaseloop import inference
from phaseloop.config import MAX_DEPTH
from phaseloop.decoding import MAX_DRAFT_TOKENS
from phaseloop.depth import set_model_depth
from phaseloop.early_exit import ExitRule, parse_exit, set_exit, set_kv_share
from phaseloop.errors import PhaseloopError
from phaseloop.serve.schema import bad

FIELDS = ("depth", "extend_loops", "exit", "kv_share", "speculative", "draft_tokens")


@dataclass(frozen=True)
class Settings:
    """How one sequence decodes; hashable: the key of its batch group."""

    depth: int | None = None
    extend_loops: str | None = None
    exit: ExitRule | None = None
    kv_share: int | None = None
    speculative: int | None = None
    draft_tokens: int | None = None  # with speculative; None: inference.Options' default (4)

    def label(self) -> dict:
        return {k: (v.label if isinstance(v, ExitRule) else v) for k, v in self.__dict__.items() if v is not None}


def _positive(given: dict, key: str, hi: int = MAX_DEPTH) -> int | None:
    v = given.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi):
        raise bad(f"phaseloop.{key}", f"{v!r}: must be an integer in 1 .. {hi}")
    return v


def parse(given: dict, defaults: Settings | None = None) -> Settings:
    """The options' syntax (no model needed); fields left out keep ``defaults``."""
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise bad(f"phaseloop.{unknown[0]}", f"unknown option; the options are {', '.join(FIELDS)}")
    out = defaults = defaults or Settings()
    if "depth" in given or "extend_loops" in given:  # the one left out keeps its default
        ext = given["extend_loops"] if "extend_loops" in given else defaults.extend_loops
        if ext not in (None, "last"):
            raise bad("phaseloop.extend_loops", f"{ext!r}: the only choice is \"last\"")
        depth = _positive(given, "depth") if "depth" in given else defaults.depth
        if depth is None and "extend_loops" not in given:  # back at the trained depth: nothing to extend
            ext = None
        out = replace(out, depth=depth, extend_loops=ext)
    if "exit" in given:
        text = given["exit"]
        if text is None:
            out = replace(out, exit=None)
        elif not isinstance(text, str):
            raise bad("phaseloop.exit", f"{text!r}: write one rule as a string, e.g. \"kl:1e-3\"")
        else:
            try:
                rules = parse_exit(text)
            except PhaseloopError as e:
                raise bad("phaseloop.exit", str(e)) from None
            if len(rules) != 1:
                raise bad("phaseloop.exit", f"{text!r}: give one value (a list sweeps in `phaseloop eval` only)")
            out = replace(out, exit=rules[0])
    for key in ("kv_share", "speculative"):
        if key in given:
            out = replace(out, **{key: _positive(given, key)})
    if "draft_tokens" in given:
        out = replace(out, draft_tokens=_positive(given, "draft_tokens", MAX_DRAFT_TOKENS))
    if out.draft_tokens is not None and out.speculative is None:
        raise bad("phaseloop.draft_tokens", "applies with speculative D (the draft's passes); add it or drop "
                  "draft_tokens")
    return out


def speculative_options(settings: Settings, **kw) -> inference.Options:
    """The ``inference.Options`` of a speculative sequence (``kw``: its sampling)."""
    extra = {} if settings.draft_tokens is None else {"draft_tokens": settings.draft_tokens}
    return inference.Options(exit=settings.exit, kv_share=settings.kv_share, speculative=settings.speculative,
                             **extra, **kw)


def as_fields(e: Exception) -> str:
    """A CLI refusal worded for the request's field (``--kv-share`` -> ``kv_share``): serve's
    body and explore's query take these options by field name."""
    text = str(e)
    for flag in ("extend-loops", "depth", "exit", "kv-share", "kv-fill", "speculative", "draft-tokens"):
        text = text.replace(f"--{flag}", flag.replace("-", "_"))
    return text


def check(twin, settings: Settings, flags: bool = False) -> None:
    """Refuse (400, one line naming the option) what the served model cannot do; ``twin``
    is a meta-device copy of it, so the live model the decode loop runs is never touched.
    ``flags``: the server's own defaults, refused as the command line's error (its flags' words)."""
    if settings == Settings():
        return
    if twin is None:
        raise bad("phaseloop", "this model cannot be checked on the meta device, so it takes no per-request options")
    trunk, exits = twin.trunk, twin.trunk.exits
    param = "phaseloop.depth"
    try:
        set_model_depth(twin, settings.depth, settings.extend_loops)
        if settings.exit is not None:
            param = "phaseloop.exit"
            set_exit(twin, settings.exit)
        if settings.kv_share is not None:
            param = "phaseloop.kv_share"
            set_kv_share(twin, settings.kv_share)
        if settings.speculative is not None:
            param = "phaseloop.speculative"
            inference.check(twin, speculative_options(settings), None)
    except PhaseloopError as e:
        if flags:
            raise
        if param == "phaseloop.speculative" and "draft-tokens" in str(e):
            param = "phaseloop.draft_tokens"
        raise bad(param, as_fields(e)) from None
    finally:
        if settings.depth is not None:
            trunk.reset_depth()
        trunk.exits = exits
        trunk.kv_share = None


def resolve(twin, given: dict, defaults: Settings | None = None) -> Settings:
    """The settings of one request's ``phaseloop`` field, checked against the model."""
    settings = parse(given, defaults)
    if settings != (defaults or Settings()) or given:
        check(twin, settings)
    return settings


@contextmanager
def applied(model, settings: Settings):
    """``model`` at ``settings`` inside the block, at its trained depth with no exit rule after."""
    if model is None or settings == Settings():
        yield model
        return
    trunk = model.trunk
    exits = trunk.exits
    try:
        set_model_depth(model, settings.depth, settings.extend_loops)
        if settings.exit is not None:
            set_exit(model, settings.exit)
        if settings.kv_share is not None:
            set_kv_share(model, settings.kv_share)
        yield model
    finally:
        if settings.depth is not None:
            trunk.reset_depth()
        trunk.exits = exits
        if settings.kv_share is not None:
            trunk.kv_share = None
