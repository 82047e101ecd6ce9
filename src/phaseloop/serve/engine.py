"""The decode loop behind ``phaseloop serve``: continuous batching over the KV cache.

One thread owns the model. Sequences wait in a bounded queue (``submit`` refuses past
``max_queue``: the server's 429); each turn of the loop

1. ends what was cancelled (its client went away) or ran past its deadline;
2. admits waiting sequences while the batch has room (``max_batch`` rows): a prefill of
   the prompt alone (the choices of one prompt share it), the first token, then the row
   joins the running group of its settings (``decoding.join_rows``: left-padded, each row
   at its own positions);
3. runs one forward per group for the last token of each row and picks each row's next
   token by its own rule (greedy rows by one argmax; sampled rows with their own seeded
   generator, as ``phaseloop generate``); a group whose forward fails ends its own rows
   with an error, the other groups go on;
4. retires the rows that finished (``decoding.keep_rows``).

A row's computation never reads another row (attention is masked to its own columns), so
a prompt's greedy output is the same alone and in any batch. Sequences with other
per-request settings (depth, exit, kv_share: ``options``) form their own group, one
forward per turn; a model whose cache cannot hold rows of different lengths
(``decoding.not_joinable``: UT+ACT, the pooled Hyperloop) runs every sequence as its own
group, and so does a speculative sequence (``speculative``: one draft/verify round per
turn, its cache rolled back after each). ``max_batch`` 1 is the one-at-a-time server
(each sequence decoded to its end before the next is admitted).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch

from phaseloop.decoding import join_rows, keep_rows, not_joinable, pick_next
from phaseloop.layers import KVCache
from phaseloop.serve.options import Settings, applied
from phaseloop.serve.sequence import Event, Sequence
from phaseloop.serve.speculative import Speculative

# settings whose cache was found joinable or not, kept (a request's exit threshold is any
# float, so the settings a server sees are unbounded; one found again is one prefill's check)
JOINABLE_KEPT = 256


class QueueFull(Exception):
    """More sequences than the queue holds: the request is refused (429)."""


@dataclass
class Group:
    """Rows decoding together: one KV cache, one settings."""

    settings: Settings
    rows: list[Sequence] = field(default_factory=list)
    cache: KVCache | None = None
    joinable: bool = True
    speculative: Speculative | None = None  # one speculative sequence: rounds instead of steps


def _top(logp_V: torch.Tensor, n: int, token: int) -> tuple:
    """(log p of ``token``, {id: log p} of the ``n`` most likely ids and ``token``)."""
    top = {}
    if n:
        values, ids = logp_V.topk(min(n, logp_V.shape[-1]))
        top = dict(zip(ids.tolist(), values.tolist()))
    lp = float(logp_V[token])
    top.setdefault(token, lp)
    return lp, top


class Engine:
    def __init__(self, model, *, max_batch: int = 16, max_queue: int = 256, metrics=None):
        self.model, self.max_batch, self.max_queue, self.metrics = model, max_batch, max_queue, metrics
        self.device = next(model.parameters()).device
        self.waiting: deque[Sequence] = deque()
        self.groups: list[Group] = []
        self.joinable: dict[Settings, bool] = {}
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.steps = 0  # forwards of the decode loop (batched decode steps), for the benchmarks

    # ------------------------------------------------------------------ the request side
    @property
    def running(self) -> int:
        return sum(len(g.rows) for g in self.groups)

    def submit(self, seqs: list[Sequence]) -> None:
        with self.cond:
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"the queue holds {len(self.waiting)} of {self.max_queue} waiting sequences; "
                                "retry later")
            self.waiting.extend(seqs)
            self._gauges()
            self.cond.notify()

    def cancel(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            s.cancelled = True
        with self.cond:
            self.cond.notify()

    def start(self) -> Engine:
        self.thread = threading.Thread(target=self._loop, name="phaseloop-serve-decode", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)
        for s in list(self.waiting) + [s for g in self.groups for s in g.rows]:
            s.end("cancelled")

    # ------------------------------------------------------------------ the decode thread
    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue.set(len(self.waiting))
            self.metrics.running.set(self.running)

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self.cond:
                    while not self.stopping and not self.waiting and not self.groups:
                        self.cond.wait(timeout=1.0)
                    if self.stopping:
                        return
                try:
                    self._turn()
                except Exception:  # a bug: the rows in flight fail, the server keeps serving
                    traceback.print_exc(file=sys.stderr)
                    for s in [s for g in self.groups for s in g.rows]:
                        s.end("error")
                    self.groups = []
                self._gauges()

    def _turn(self) -> None:
        now = time.monotonic()
        with self.cond:
            for s in [s for s in self.waiting if s.cancelled or now > s.deadline]:
                self.waiting.remove(s)
                s.end("cancelled" if s.cancelled else "timeout")
        for g in self.groups:
            for s in g.rows:
                if s.cancelled or now > s.deadline:
                    s.end("cancelled" if s.cancelled else "timeout")
        self._retire()
        while self.running < self.max_batch:
            with self.cond:
                if not self.waiting:
                    break
                first = self.waiting.popleft()
                same = [first]  # the other choices of its prompt: one prefill for all
                while (self.waiting and len(same) < self.max_batch - self.running
                       and self.waiting[0].prompt is first.prompt and self.waiting[0].settings == first.settings):
                    same.append(self.waiting.popleft())
            try:
                self._admit(same)
            except Exception:  # its prefill or first token failed: these end, in no group or queue
                traceback.print_exc(file=sys.stderr)
                with self.cond:
                    queued = {id(w) for w in self.waiting}
                for s in same:
                    if id(s) not in queued:
                        s.end("error")
        for g in list(self.groups):
            try:
                self._step(g)
            except Exception:  # this group's forward failed: its rows end, the other groups go on
                traceback.print_exc(file=sys.stderr)
                for s in g.rows:
                    s.end("error")
                self.groups = [x for x in self.groups if x is not g]  # by identity (Group compares by value)
        self._retire()

    def _retire(self) -> None:
        for g in self.groups:
            keep = [i for i, s in enumerate(g.rows) if s.finish is None]
            if len(keep) < len(g.rows):
                if keep:
                    keep_rows(g.cache, keep)
                g.rows = [g.rows[i] for i in keep]
        self.groups = [g for g in self.groups if g.rows]

    def _admit(self, seqs: list[Sequence]) -> None:
        first = seqs[0]
        for s in seqs:
            s.seed_on(self.device)
        if first.max_new == 0 and first.prompt_logprobs is None:
            for s in seqs:
                s.end("length")
            return
        if first.settings.speculative is not None:
            for s in seqs:
                self._admit_speculative(s)
            return
        if not self.joinable.get(first.settings, True) and len(seqs) > 1:  # each its own cache
            for s in seqs:
                self._admit([s])
            return
        cache = KVCache(capacity=len(first.prompt) + first.max_new)
        with applied(self.model, first.settings):
            out = self.model(torch.tensor([first.prompt], device=self.device), cache=cache)
        self.steps += 1
        if first.settings not in self.joinable:
            if len(self.joinable) >= JOINABLE_KEPT:  # settings come from requests: the oldest goes
                del self.joinable[next(iter(self.joinable))]
            self.joinable[first.settings] = not_joinable(cache) is None
        joinable = self.joinable[first.settings]
        if not joinable and len(seqs) > 1:
            seqs, rest = seqs[:1], seqs[1:]
            with self.cond:
                self.waiting.extendleft(reversed(rest))
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(first.prompt))
        logits_TV = out.logits[0].float()
        self._score_prompt(seqs, logits_TV)
        if first.max_new == 0:
            for s in seqs:
                s.end("length")
            return
        self._pick(seqs, logits_TV[-1:].expand(len(seqs), -1))
        live = [s for s in seqs if s.finish is None]
        if not live:
            return
        if not joinable:
            self.groups.append(Group(first.settings, live, cache, joinable=False))
            return
        g = next((g for g in self.groups if g.joinable and g.settings == first.settings), None)
        parts = ([g.cache] if g is not None else []) + [cache] * len(live)
        room = max(s.max_new - len(s.tokens) for s in live + (g.rows if g else []))
        joined = cache if g is None and len(live) == 1 else join_rows(parts, max(c.pos for c in parts) + room)
        if g is None:
            self.groups.append(Group(first.settings, live, joined))
        else:
            g.rows += live
            g.cache = joined

    def _score_prompt(self, seqs: list[Sequence], logits_TV: torch.Tensor) -> None:
        first = seqs[0]
        if first.prompt_logprobs is not None:
            logp = logits_TV[:-1].log_softmax(-1)
            scores = [None] + [_top(logp[i], first.prompt_logprobs, t) for i, t in enumerate(first.prompt[1:])]
            for s in seqs:
                s.prompt_scores = scores

    def _admit_speculative(self, s: Sequence) -> None:
        """A prefill of its own, the first token, then a group of its own (``speculative``)."""
        spec = Speculative(self.model, s, self.device)
        logits_TV = spec.prefill()
        self.steps += 1
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(s.prompt))
        self._score_prompt([s], logits_TV.float())
        if s.max_new == 0:
            return s.end("length")
        self._push(s, spec.first(logits_TV[-1]), logits_TV[-1])
        if s.finish is None:
            self.groups.append(Group(s.settings, [s], spec.cache, joinable=False, speculative=spec))

    def _push(self, s: Sequence, token: int, logits_V: torch.Tensor) -> None:
        """One token of a speculative sequence, chosen from the full depth's ``logits_V``."""
        n = s.sampling.logprobs
        s.push(token, None if n is None else _top(logits_V.float().log_softmax(-1), n, token))
        if self.metrics is not None:
            self.metrics.generated_tokens.inc()

    def _step(self, g: Group) -> None:
        if g.speculative is not None:
            spec, before = g.speculative, g.speculative.forwards
            kept = spec.round()
            self.steps += spec.forwards - before
            for i, (token, logits_V) in enumerate(kept):
                if g.rows[0].finish is None:
                    # drafts in the output (the last token is the full depth's own; a stop or
                    # eos may end the row before the rest of the round), counted before the
                    # push that may finish the row and answer the request
                    g.rows[0].speculation["accepted"] += i < len(kept) - 1
                    self._push(g.rows[0], token, logits_V)
            return
        x_B1 = torch.tensor([[s.last] for s in g.rows], device=self.device)
        with applied(self.model, g.settings):
            out = self.model(x_B1, cache=g.cache)
        self.steps += 1
        if self.metrics is not None:
            self.metrics.batch_rows.observe(len(g.rows))
        self._pick(g.rows, out.logits[:, -1].float())

    def _pick(self, rows: list[Sequence], logits_BV: torch.Tensor) -> None:
        """Each row's next token by its own rule, pushed to it (which may finish it)."""
        greedy = logits_BV.argmax(-1).tolist()
        want = [s.sampling.logprobs is not None for s in rows]
        logp_BV = logits_BV.log_softmax(-1) if any(want) else None
        for i, s in enumerate(rows):
            sp = s.sampling
            tok = greedy[i] if sp.temperature <= 0 else int(
                pick_next(logits_BV[i:i + 1], sp.temperature, sp.top_k, s.generator, sp.top_p)[0, 0])
            s.push(tok, _top(logp_BV[i], sp.logprobs, tok) if want[i] else None)
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(len(rows))


_ids = itertools.count()


def request_id(prefix: str) -> str:
    return f"{prefix}-{int(time.time() * 1000):x}{next(_ids):04x}"


__all__ = ["Engine", "Event", "Group", "QueueFull", "Sequence", "request_id"]
