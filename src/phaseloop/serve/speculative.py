"""A request's self-speculative decoding (``phaseloop.speculative`` D) as rounds of the
decode loop: ``decoding.speculative_decode`` for one sequence, cut at its rounds, so that
the loop ends a cancelled or late sequence between two rounds and its other groups keep
decoding meanwhile. Each round drafts ``draft_tokens`` tokens at D passes, rolls the KV
cache back (``KVCache.truncate``) and verifies them in one forward at the request's depth
(``decoding.verify``): greedy output is the full depth's greedy output token for token,
sampled tokens are distributed as the full depth's. The same calls in the same order as
``speculative_decode``, with the sequence's generator, so choice 0 of a seeded request is
``phaseloop generate --speculative D --seed SEED``. A truncated cache cannot hold other
rows (a continuous batch is left-padded), so such a sequence is a group of its own."""

from __future__ import annotations

import torch

from phaseloop.decoding import sampling_probs, verify
from phaseloop.depth import set_model_depth
from phaseloop.kvcache import KVCache
from phaseloop.serve.options import applied, speculative_options
from phaseloop.serve.sequence import Sequence


class Speculative:
    """The decoding state of one speculative sequence: its cache, the token the next round
    starts from, and what its rounds drafted and kept (``stats``)."""

    def __init__(self, model, seq: Sequence, device):
        self.model, self.seq, self.device = model, seq, device
        self.draft_passes = seq.settings.speculative
        self.draft_tokens = speculative_options(seq.settings).draft_tokens
        self.cache = KVCache(capacity=len(seq.prompt) + seq.max_new + min(self.draft_tokens, seq.max_new) + 1)
        self.next: torch.Tensor | None = None  # [1]: the last token kept, not fed yet
        self.forwards = 0  # of its rounds: drafts + verifications
        seq.speculation = {"draft_passes": self.draft_passes, "draft_tokens": self.draft_tokens,
                           "rounds": 0, "drafted": 0, "accepted": 0}

    def _probs(self, logits_BV: torch.Tensor) -> torch.Tensor | None:
        sp = self.seq.sampling
        return None if sp.temperature <= 0 else sampling_probs(logits_BV.float(), sp.temperature, sp.top_k, sp.top_p)

    def _pick(self, logits_BV: torch.Tensor, probs_BV: torch.Tensor | None) -> torch.Tensor:
        if probs_BV is None:
            return logits_BV.argmax(-1)
        return torch.multinomial(probs_BV, 1, generator=self.seq.generator)[:, 0]

    def prefill(self) -> torch.Tensor:
        """The prompt through the model at the request's depth: its logits [T, V]."""
        with applied(self.model, self.seq.settings):
            out = self.model(torch.tensor([self.seq.prompt], device=self.device), cache=self.cache)
        return out.logits[0]

    def first(self, logits_V: torch.Tensor) -> int:
        """The first new token, from the prefill's last logits."""
        logits_BV = logits_V[None]
        self.next = self._pick(logits_BV, self._probs(logits_BV))
        return int(self.next[0])

    def round(self) -> list[tuple[int, torch.Tensor]]:
        """One draft/verify round: the tokens kept (the accepted drafts, then the full
        depth's own token) with the full depth's logits [V] each was chosen from."""
        s, model = self.seq, self.model
        K, n = min(self.draft_tokens, s.max_new - len(s.tokens)), self.cache.pos
        greedy = s.sampling.temperature <= 0
        with applied(model, s.settings):
            trunk = model.trunk
            full = trunk.passes
            try:
                set_model_depth(model, self.draft_passes, "last")
                drafts, q, inp = [], [], self.next[:, None]
                for _ in range(K):
                    lg = model(inp, cache=self.cache).logits[:, -1]
                    q.append(self._probs(lg))
                    drafts.append(self._pick(lg, q[-1]))
                    inp = drafts[-1][:, None]
                self.cache.truncate(n)
                set_model_depth(model, full, "last")
                d_BK = torch.stack(drafts, 1)
                logits_BKV = model(torch.cat([self.next[:, None], d_BK], 1), cache=self.cache).logits.float()
            finally:
                if s.settings.depth is None:  # applied() resets a depth it set itself
                    trunk.reset_depth()
        p_BKV = logits_BKV if greedy else self._probs(logits_BKV.flatten(0, 1)).view_as(logits_BKV)
        j_B, after_B = verify(p_BKV, None if greedy else torch.stack(q, 1), d_BK, s.generator)
        m = int(j_B[0])
        self.next = after_B
        self.cache.truncate(n + 1 + m)
        self.forwards += K + 1
        st = s.speculation
        st["rounds"], st["drafted"] = st["rounds"] + 1, st["drafted"] + K  # "accepted": the engine, as it pushes
        return list(zip(d_BK[0, :m].tolist() + [int(after_B[0])], logits_BKV[0, :m + 1]))


def totals(seqs: list[Sequence]) -> dict | None:
    """What a request's speculative sequences drafted and kept (None: it had none):
    ``acceptance`` = drafts kept / drafted, as ``generate --json`` reports it."""
    stats = [s.speculation for s in seqs if s.speculation is not None]
    if not stats:
        return None
    drafted, accepted = sum(st["drafted"] for st in stats), sum(st["accepted"] for st in stats)
    return {"draft_passes": stats[0]["draft_passes"], "draft_tokens": stats[0]["draft_tokens"],
            "rounds": sum(st["rounds"] for st in stats), "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None}
