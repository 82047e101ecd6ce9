"""The JSON ``phaseloop serve`` answers with, in OpenAI's shapes: a completion or chat
completion, its server-sent-event chunks, and the log-probability objects (the legacy
completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``, which
lm-eval's ``local-completions`` reads; chat's ``content`` list). Log-probabilities are
of the model's own distribution (log-softmax of its logits, before temperature, top-k or
top-p)."""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable

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


class Vocab:
    """The served tokenizer as the answers need it: ``vocab(ids)`` the text, ``string(id)``
    a token's own text, or OpenAI's ``bytes:\\xNN`` where its bytes are not UTF-8 alone
    (a byte of a character: distinct ids never share a string), ``token_bytes(id)`` its
    bytes, ``tracker(base)`` the character each next token's text starts at."""

    def __init__(self, decode: Callable[[list[int]], str], token_bytes: Callable[[int], bytes], byte_level: bool):
        self.decode, self.token_bytes, self.byte_level = decode, token_bytes, byte_level

    def __call__(self, ids: list[int]) -> str:
        return self.decode(ids)

    def string(self, t: int) -> str:
        raw = self.token_bytes(t)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def running(self) -> Callable[[int], str] | None:
        """For a byte-level vocabulary, a running decode: fed the tokens in order, each call
        returns the text of all of them so far (``vocab(ids)``: a character not complete yet
        is one U+FFFD), at the cost of the new token's bytes where ``vocab(ids)`` decodes
        every token again; None for another vocabulary (its text of a token may depend on
        the tokens around it)."""
        if not self.byte_level:
            return None
        dec, done = codecs.getincrementaldecoder("utf-8")(errors="replace"), [""]

        def feed(t: int) -> str:
            done[0] += dec.decode(self.token_bytes(t))
            return done[0] + "\ufffd" if dec.getstate()[0] else done[0]
        return feed

    def tracker(self, base: int = 0) -> Callable[[int], int]:
        """token -> the offset in the text where it starts (a byte completing a character:
        where that character starts), fed the tokens in order; a byte-level vocabulary
        decodes incrementally, another one decodes each prefix."""
        if self.byte_level:
            dec, at = codecs.getincrementaldecoder("utf-8")(errors="replace"), [base]

            def nxt(t: int) -> int:
                start = at[0]
                at[0] += len(dec.decode(self.token_bytes(t)))
                return start
            return nxt
        seen: list[int] = []

        def prefix(t: int) -> int:
            start = base + (len(self.decode(seen)) if seen else 0)
            seen.append(t)
            return start
        return prefix


def _logprobs(ids: list[int], scores: list, vocab: Vocab, offset: int, track=None) -> dict:
    track = track or vocab.tracker(offset)
    return {"tokens": [vocab.string(t) for t in ids], "token_logprobs": [s[0] if s else None for s in scores],
            "top_logprobs": [{vocab.string(i): lp for i, lp in s[1].items()} if s else None for s in scores],
            "text_offset": [track(t) for t in ids]}


def completion_logprobs(req: Request, s: Sequence, i: int, decode) -> dict | None:
    """The logprobs object of one choice: the prompt's tokens first with ``echo``."""
    if req.logprobs is None:
        return None
    if req.echo:
        return _logprobs(req.prompts[i] + s.tokens, (s.prompt_scores or [None] * len(req.prompts[i])) + s.logprobs,
                         decode, 0)
    return _logprobs(s.tokens, s.logprobs, decode, len(prompt_text(req, i, decode)))


def _chat_logprobs(ids: list[int], scores: list, vocab: Vocab, n: int) -> dict:
    def entry(token: int, lp: float) -> dict:
        return {"token": vocab.string(token), "logprob": lp, "bytes": list(vocab.token_bytes(token))}

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


def chunk(req: Request, rid: str, model: str, k: int, ev: Event, decode, first: bool = False,
          track=None) -> dict:
    """One streamed chunk for choice ``k`` (``track``: the choice's ``Vocab.tracker``, fed
    every token of it in order: the offsets the whole answer would give)."""
    finish = ev.finish if ev.finish in ("stop", "length") else None
    if req.chat:
        delta = {"role": "assistant", "content": ev.text} if first else {"content": ev.text}
        lp = (None if req.logprobs is None or ev.logprob is None
              else _chat_logprobs([ev.token], [ev.logprob], decode, req.logprobs))
        choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": finish}
    else:
        lp = (None if req.logprobs is None or ev.logprob is None
              else _logprobs([ev.token], [ev.logprob], decode, 0, track))
        choice = {"index": k, "text": ev.text, "logprobs": lp, "finish_reason": finish}
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def tracker(req: Request, s: Sequence, k: int, vocab: Vocab) -> Callable[[int], int]:
    """The offsets of choice ``k``'s generated tokens in what its stream sends: after the
    prompt's tokens with ``echo``, after the prompt's text without."""
    if req.echo:
        track = vocab.tracker(0)
        for t in req.prompts[k // req.n]:
            track(t)
        return track
    return vocab.tracker(len(prompt_text(req, k // req.n, vocab)))


def echo_chunk(req: Request, s: Sequence, rid: str, model: str, k: int, decode) -> dict:
    """A completion stream's first chunk of choice ``k`` with ``echo``: the prompt itself."""
    i = k // req.n
    lp = None
    if req.logprobs is not None:
        lp = _logprobs(req.prompts[i], s.prompt_scores or [None] * len(req.prompts[i]), decode, 0)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": k, "text": prompt_text(req, i, decode), "logprobs": lp, "finish_reason": None}]}
