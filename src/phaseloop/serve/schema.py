"""The requests ``phaseloop serve`` accepts, checked field by field: OpenAI's completions and
chat completions bodies (the fields of the legacy completions API and of chat), plus the
``phaseloop`` field of per-request options. Every invalid field is an ``APIError`` (400,
OpenAI's error object naming the field); nothing here reads a file or touches the model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 256


class APIError(Exception):
    """An answer other than 200: OpenAI's error object ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (``phaseloop serve`` flags)."""

    max_context: int  # prompt + max_tokens, in tokens
    vocab_size: int
    max_prompts: int = 64
    max_n: int = 16
    max_logprobs: int = 20
    max_body_bytes: int = 1 << 20


@dataclass
class Request:
    """One checked request: its prompts (token ids; ``texts`` the text each came from, or
    None for ids), what to generate and how, and the raw ``phaseloop`` options
    (``options.resolve`` checks them against the model)."""

    prompts: list[list[int]]
    texts: list[str | None]
    max_tokens: int
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None
    phaseloop: dict = field(default_factory=dict)
    chat: bool = False


# ------------------------------------------------------------------------------ field checks
def _int(body: dict, key: str, default, lo: int | None = None, hi: int | None = None, none_ok: bool = True):
    v = body.get(key)
    v = default if v is None else v  # null is the default, as OpenAI reads it (its client sends None as null)
    if v is None and none_ok:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise bad(key, f"{v!r} is not an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(key, f"{v} is out of range ({lo if lo is not None else '-inf'} .. {hi if hi is not None else 'inf'})")
    return v


def _float(body: dict, key: str, default, lo: float, hi: float, lo_open: bool = False):
    v = body.get(key)
    v = default if v is None else v  # null is the default (temperature: null samples at 1.0)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise bad(key, f"{v!r} is not a finite number")
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad(key, f"{v} is out of range ({'(' if lo_open else '['}{lo}, {hi}])")
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(key, f"{v!r} is not true or false")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad("stop", "must be a non-empty string or a list of them")
    if len(items) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in items):
        raise bad("stop", f"at most {MAX_STOP} sequences of at most {MAX_STOP_CHARS} characters")
    return list(items)


def _unsupported(body: dict, defaults: dict) -> None:
    """OpenAI fields phaseloop does not implement: accepted at their neutral value only."""
    for key, neutral in defaults.items():  # by type too: false == 0, but is no number
        if key in body and not any(body[key] == v and type(body[key]) is type(v) for v in neutral):
            raise bad(key, f"{body[key]!r} is not supported by phaseloop serve (leave it out)")


def _options(body: dict) -> dict:
    v = body.get("phaseloop", {})
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("phaseloop", "must be an object of phaseloop options, e.g. {\"depth\": 4}")
    return v


def _common(body: dict, known: set, limits: Limits, chat: bool) -> dict:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad(unknown[0], "unrecognized request argument")
    for key in ("model", "user"):  # user: an end-user id, kept by OpenAI for abuse checks; unused here
        if body.get(key) is not None and not isinstance(body[key], str):
            raise bad(key, f"{body[key]!r} is not a string")
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and (not stream or not isinstance(so, dict) or set(so) - {"include_usage"}
                           or not isinstance(so.get("include_usage", False), bool)):
        raise bad("stream_options", "takes {\"include_usage\": true|false}, with stream true")
    top_k = _int(body, "top_k", None, lo=-1)
    return {"temperature": _float(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _float(body, "top_p", None, 0.0, 1.0, lo_open=True),
            "top_k": None if top_k in (None, -1, 0) else top_k,
            "seed": _int(body, "seed", None, lo=0, hi=2**63 - 1),
            "stop": _stop(body), "n": _int(body, "n", 1, lo=1, hi=limits.max_n, none_ok=False),
            "stream": stream, "include_usage": bool((so or {}).get("include_usage", False)),
            "phaseloop": _options(body), "chat": chat}


def _check_length(prompts: list[list[int]], max_tokens: int, limits: Limits) -> None:
    for p in prompts:
        if len(p) + max_tokens > limits.max_context:
            raise APIError(400, f"this model's maximum context is {limits.max_context} tokens; the prompt has "
                           f"{len(p)} and max_tokens asks for {max_tokens}: shorten the prompt or lower "
                           "max_tokens (or start the server with a larger --max-context)", "max_tokens",
                           code="context_length_exceeded")


# ------------------------------------------------------------------------------ the two bodies
COMPLETION = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
              "stream", "stream_options", "echo", "logprobs", "user", "phaseloop", "suffix", "best_of",
              "presence_penalty", "frequency_penalty", "logit_bias"}
_NEUTRAL = {"suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
            "logit_bias": (None, {})}


def completion(body: dict, encode, limits: Limits) -> Request:
    """A ``POST /v1/completions`` body: ``prompt`` a string, a list of strings, a list of
    token ids or a list of such lists (an empty string is "\\n", as ``phaseloop generate``)."""
    common = _common(body, COMPLETION, limits, chat=False)
    _unsupported(body, {**_NEUTRAL, "best_of": (None, common["n"])})
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", "a string, a list of strings, a list of token ids or a list of such lists is required")
    if len(prompt) > limits.max_prompts:
        raise bad("prompt", f"{len(prompt)} prompts; at most {limits.max_prompts} per request")
    ids, texts = [], []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            ids.append(_encoded(encode, p or "\n", "prompt", f"prompt {i}"))
            texts.append(p or "\n")
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if not all(0 <= t < limits.vocab_size for t in p):
                raise bad("prompt", f"prompt {i} holds a token id outside 0 .. {limits.vocab_size - 1}")
            ids.append(list(p))
            texts.append(None)
        else:
            raise bad("prompt", f"prompt {i} is neither a string nor a non-empty list of token ids")
    max_tokens = _int(body, "max_tokens", 16, lo=0, none_ok=False)
    _check_length(ids, max_tokens, limits)
    return Request(ids, texts, max_tokens, echo=_bool(body, "echo"),
                   logprobs=_int(body, "logprobs", None, lo=0, hi=limits.max_logprobs), **common)


CHAT = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
        "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs", "user", "phaseloop",
        "presence_penalty", "frequency_penalty", "logit_bias"}
ROLES = ("system", "developer", "user", "assistant", "tool")


def messages(body: dict) -> list[dict]:
    """The ``messages`` of a chat body as {role, content: text}; text parts of a content list joined."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "a non-empty list of {\"role\", \"content\"} objects is required")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}]", f"needs a role among {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise bad(f"messages[{i}].content", "only text parts are supported: {\"type\": \"text\", "
                          "\"text\": ...}")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


def _encoded(encode, text: str, param: str, what: str) -> list[int]:
    """``text``'s token ids; a 400 naming ``param`` where the tokenizer keeps none of it (a
    vocabulary without these characters), which the model cannot start from."""
    ids = list(encode(text))
    if not ids:
        raise bad(param, f"{what} encodes to no token with this model's tokenizer; send other text or token ids")
    return ids


def chat(body: dict, render, encode, limits: Limits) -> Request:
    """A ``POST /v1/chat/completions`` body; ``render(messages) -> prompt text`` (the
    tokenizer's chat template, with the assistant's turn opened)."""
    common = _common(body, CHAT, limits, chat=True)
    _unsupported(body, _NEUTRAL)
    text = render(messages(body))
    ids = _encoded(encode, text or "\n", "messages", "the rendered messages")
    mt = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, mt, max(1, min(limits.max_context - len(ids), 256)), lo=0, none_ok=False)
    _check_length([ids], max_tokens, limits)
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, lo=0, hi=limits.max_logprobs)
    if top is not None and not want:
        raise bad("top_logprobs", "applies with logprobs true")
    return Request([ids], [text], max_tokens, logprobs=(top or 0) if want else None, **common)
