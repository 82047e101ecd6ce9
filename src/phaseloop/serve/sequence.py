"""One sequence the decode loop generates (a prompt x one of its ``n`` choices): its
sampling rule, its tokens and log-probabilities, its text with the stop sequences cut, and
the events it sends the request waiting on it (``notify``: called from the decode thread).

Text is that of all tokens so far (decoded token by token where the vocabulary is byte-level,
``Vocab.running``; else every token again); a streamed delta holds back a trailing U+FFFD (a
multi-byte character not complete yet) and any tail that could start a stop sequence, so
the deltas of a stream add up to the text of the same request unstreamed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from phaseloop.serve.options import Settings


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0: greedy; else softmax(logits / T) cut to ``top_k`` and ``top_p``
    (``decoding.sampling_probs``), drawn with the sequence's own generator seeded ``seed``."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: int | None = None  # top-n log-probabilities per generated token; None: none


@dataclass
class Event:
    """What the request hears: new text (streamed), the token behind it, or the end."""

    text: str = ""
    token: int | None = None
    logprob: tuple | None = None  # (log p of the token, {id: log p} of the top-n)
    finish: str | None = None  # stop | length | cancelled | timeout | error


@dataclass
class Sequence:
    prompt: list[int]
    max_new: int
    sampling: Sampling
    settings: Settings
    decode: Callable[[list[int]], str]  # ids -> text; a ``Vocab`` decodes a byte-level stream token by token
    notify: Callable[[Event], None]
    stop: list[str] = field(default_factory=list)
    eos_id: int | None = None
    stream: bool = False
    prompt_logprobs: int | None = None  # echo + logprobs: top-n for every prompt token
    deadline: float = float("inf")
    index: int = 0  # choice index in the request
    # filled by the decode loop
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple] = field(default_factory=list)
    prompt_scores: list[tuple | None] | None = None
    finish: str | None = None
    text: str = ""
    cancelled: bool = False
    generator: torch.Generator | None = None
    speculation: dict | None = None  # a speculative sequence's rounds, drafts and accepted drafts
    started: float = field(default_factory=time.monotonic)
    _sent: int = 0
    _running: Callable[[int], str] | None = None  # ``Vocab.running``: the text so far, token by token

    def __post_init__(self):
        running = getattr(self.decode, "running", None)  # needed where a stream or a stop string reads the text
        self._running = running() if running is not None and (self.stop or self.stream) else None

    def seed_on(self, device) -> None:
        """The sequence's generator on ``device``: seeded ``seed + index`` (choice 0 draws as
        ``phaseloop generate --seed SEED``), or from the OS when no seed is given."""
        if self.sampling.temperature > 0:
            self.generator = torch.Generator(device=device)
            if self.sampling.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.sampling.seed + self.index)

    @property
    def last(self) -> int:
        return self.tokens[-1] if self.tokens else self.prompt[-1]

    def push(self, token: int, logprob: tuple | None) -> None:
        """Append a generated token; finish on EOS, a stop sequence or ``max_new`` tokens."""
        self.tokens.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token == self.eos_id:
            return self.end("stop", token, logprob)
        if self.stop or self.stream:
            text = self._running(token) if self._running is not None else self.decode(self.tokens)
            settled = text.rstrip("\ufffd")  # a trailing U+FFFD may still become a character: no stop on it yet
            cut = self._cut(settled)
            if len(cut) < len(settled):
                self.text = cut
                return self.end("stop", token, logprob)
            self.text = text
        if len(self.tokens) >= self.max_new:
            return self.end("length", token, logprob)
        if self.stream:
            self.notify(Event(self._delta(held=True), token, logprob))

    def end(self, reason: str, token: int | None = None, logprob: tuple | None = None) -> None:
        """Finish (once): the final text, then the last event."""
        if self.finish is not None:
            return
        if reason in ("stop", "length"):
            visible = self.tokens[:-1] if self.tokens and self.tokens[-1] == self.eos_id else self.tokens
            self.text = self._cut(self.decode(visible))
        self.finish = reason
        self.notify(Event(self._delta(held=False) if self.stream else "", token, logprob, finish=reason))

    def _cut(self, text: str) -> str:
        """``text`` before its first stop sequence."""
        return text[:min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=len(text))]

    def _delta(self, held: bool) -> str:
        """The text not sent yet; ``held``: keeping back what may still change."""
        safe = self.text
        if held:
            safe = safe.rstrip("\ufffd")
            for s in self.stop:  # a tail that may grow into a stop sequence waits
                k = next((k for k in range(min(len(s) - 1, len(safe)), 0, -1) if safe.endswith(s[:k])), 0)
                safe = safe[:len(safe) - k]
        if len(safe) <= self._sent:
            return ""
        out, self._sent = safe[self._sent:], len(safe)
        return out
