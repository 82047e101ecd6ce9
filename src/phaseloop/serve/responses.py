"""The JSON ``phaseloop serve`` answers with, in OpenAI's shapes: a completion or chat
completion, its server-sent-event chunks, and the log-probability objects (the legacy
completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``, which
lm-eval's ``local-completions`` reads; chat's ``content`` list). Log-probabilities are
of the model's own distribution (log-softmax of its logits, before temperature, top-k or
top-p)."""

from __future__ import annotations

import json
import time

from phaseloop.serve.schema import Request
from phaseloop.serve.sequence import Event, Sequence
from phaseloop.serve.speculative import totals


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: JSON`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def usage(req: Request, seqs: list[Sequence]) -> dict:
    prompt = sum(len(p) for p in req.prompts)
    done = sum(len(s.tokens) for s in seqs)
    out = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
    spec = totals(seqs)  # a speculative request: its rounds and acceptance (drafts kept / drafted)
    if spec is not None:
        out["phaseloop"] = {"speculative": spec}
    return out


def prompt_text(req: Request, i: int, decode) -> str:
    return req.texts[i] if req.texts[i] is not None else decode(req.prompts[i])


def _logprobs(ids: list[int], scores: list, decode, offset: int) -> dict:
    tokens = [decode([t]) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [s[0] if s else None for s in scores],
            "top_logprobs": [{decode([i]): lp for i, lp in s[1].items()} if s else None for s in scores],
            "text_offset": offsets}


def completion_logprobs(req: Request, s: Sequence, i: int, decode) -> dict | None:
    """The logprobs object of one choice: the prompt's tokens first with ``echo``."""
    if req.logprobs is None:
        return None
    if req.echo:
        return _logprobs(req.prompts[i] + s.tokens, (s.prompt_scores or [None] * len(req.prompts[i])) + s.logprobs,
                         decode, 0)
    return _logprobs(s.tokens, s.logprobs, decode, len(prompt_text(req, i, decode)))


def _chat_logprobs(ids: list[int], scores: list, decode, n: int) -> dict:
    def entry(token: int, lp: float) -> dict:
        text = decode([token])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**entry(t, sc[0]), "top_logprobs": [entry(i, lp) for i, lp in sorted(
        sc[1].items(), key=lambda kv: -kv[1])[:n]]} for t, sc in zip(ids, scores)]}


def body(req: Request, seqs: list[Sequence], rid: str, model: str, decode) -> dict:
    """The whole answer of a request that is not streamed."""
    choices = []
    for k, s in enumerate(seqs):
        i = k // req.n
        if req.chat:
            choices.append({"index": k, "message": {"role": "assistant", "content": s.text},
                            "logprobs": None if req.logprobs is None else _chat_logprobs(s.tokens, s.logprobs, decode,
                                                                                        req.logprobs),
                            "finish_reason": s.finish})
        else:
            text = (prompt_text(req, i, decode) if req.echo else "") + s.text
            choices.append({"index": k, "text": text, "logprobs": completion_logprobs(req, s, i, decode),
                            "finish_reason": s.finish})
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(req, seqs)}


def chunk(req: Request, rid: str, model: str, k: int, ev: Event, decode, first: bool = False) -> dict:
    """One streamed chunk for choice ``k``."""
    finish = ev.finish if ev.finish in ("stop", "length") else None
    if req.chat:
        delta = {"role": "assistant", "content": ev.text} if first else {"content": ev.text}
        lp = (None if req.logprobs is None or ev.logprob is None
              else _chat_logprobs([ev.token], [ev.logprob], decode, req.logprobs))
        choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": finish}
    else:
        lp = (None if req.logprobs is None or ev.logprob is None
              else _logprobs([ev.token], [ev.logprob], decode, 0))
        choice = {"index": k, "text": ev.text, "logprobs": lp, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def echo_chunk(req: Request, s: Sequence, rid: str, model: str, k: int, decode) -> dict:
    """A completion stream's first chunk of choice ``k`` with ``echo``: the prompt itself."""
    i = k // req.n
    lp = None
    if req.logprobs is not None:
        lp = _logprobs(req.prompts[i], s.prompt_scores or [None] * len(req.prompts[i]), decode, 0)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": k, "text": prompt_text(req, i, decode), "logprobs": lp, "finish_reason": None}]}
