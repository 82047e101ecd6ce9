"""lm-eval's model interface (``TemplateLM``) on a phaseloop ``DecoderLM`` itself: lm-eval
builds the requests (prompts, choices, few-shot contexts) and computes the metrics; this
class only scores log-likelihoods, with the run's own tokenizer and model (no
transformers wrapper, so ``--depth`` applies to the model directly).

Scoring, as lm-eval's ``HFLM._loglikelihood_tokens`` does: context and continuation are
encoded as ``TemplateLM`` does (whole minus context), the model sees the last
``window + 1`` tokens of context + continuation but the last (a longer context is
left-truncated), and the continuation's log-probabilities are summed; greedy = every
continuation token is the argmax. ``window`` is the model's ``max_seq_len``.

One case HFLM refuses (an assertion) is scored here: a continuation longer than the
window (HellaSwag's endings reach 428 bytes; a byte model sees 128). It is scored in
chunks of at most ``window`` tokens from its end: the last chunk exactly as above, each
earlier chunk's tokens conditioned on the ``window`` tokens before that chunk's last
token (so every token is scored, with at least as much context as the last chunk's
first token). ``counts`` says how many requests were truncated or chunked, per task.

One departure from HFLM: a continuation holding the tokenizer's unknown token (a word-level
vocabulary's [UNK] for a word outside it) is never greedy, even where the model's argmax is
that token: it could not have spelled the word (LAMBADA's accuracy; counted as
``unknown``). Its log-likelihood is kept as the tokenizer gives it.
"""

from __future__ import annotations

from collections import Counter

import torch
from lm_eval.api.model import TemplateLM

from phaseloop.errors import PhaseloopError
from phaseloop.hf.tokenizer import hf_tokenizer, prefix_token_id


class PhaseloopLM(TemplateLM):
    def __init__(self, model, tok, batch_size: int = 32):
        super().__init__()
        self.model, self.tok, self.batch_size = model, tok, batch_size
        self.window = model.cfg.max_seq_len
        self._prefix = prefix_token_id(tok, hf_tokenizer(tok))
        self._device = next(model.parameters()).device
        self.unk = getattr(tok, "unk_id", None)
        self.counts: dict[str, Counter] = {}  # task -> requests, truncated, chunked, unknown

    @property
    def eot_token_id(self) -> int:
        return self._prefix

    @property
    def prefix_token_id(self) -> int:  # lm_eval_run's choice (hf.tokenizer.prefix_token_id)
        return self._prefix

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode(string).tolist()

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._tasks = [r.task_name for r in requests]  # _loglikelihood_tokens keeps their order
        try:
            return super().loglikelihood(requests, disable_tqdm=True)
        finally:
            self._tasks = None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pieces = []  # (request index, input tokens, tokens it predicts at its end)
        tasks = getattr(self, "_tasks", None) or ["?"] * len(requests)  # "?": called directly
        logp, greedy = [0.0] * len(requests), [True] * len(requests)
        for i, ((_, ctx, cont), task) in enumerate(zip(requests, tasks)):
            whole, first, end = ctx + cont, len(ctx), len(ctx) + len(cont)
            c = self.counts.setdefault(task, Counter())
            c["requests"] += 1
            c["truncated"] += end > self.window + 1
            c["chunked"] += len(cont) > self.window
            greedy[i] = self.unk is None or self.unk not in cont  # an unknown word is never predicted
            c["unknown"] += not greedy[i]
            while end > first:
                start = max(first, end - self.window)
                pieces.append((i, whole[max(0, end - 1 - self.window):end - 1], whole[start:end]))
                end = start
        order = sorted(range(len(pieces)), key=lambda k: -len(pieces[k][1]))
        with torch.inference_mode():
            for b in range(0, len(order), self.batch_size):
                batch = [pieces[k] for k in order[b:b + self.batch_size]]
                width = max(len(inp) for _, inp, _ in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                for row, (_, inp, _) in enumerate(batch):  # right padding: causal, so inert
                    ids[row, :len(inp)] = torch.tensor(inp)
                logits = self.model(ids.to(self._device)).logits
                for row, (i, inp, target) in enumerate(batch):
                    scored = logits[row, len(inp) - len(target):len(inp)].double().log_softmax(-1)
                    t = torch.tensor(target, device=scored.device)
                    logp[i] += float(scored.gather(-1, t[:, None]).sum())
                    greedy[i] = greedy[i] and bool((scored.argmax(-1) == t).all())
        return list(zip(logp, greedy))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise PhaseloopError("the downstream tasks score choices by log-likelihood; for rolling "
                             "perplexity tasks use `phaseloop lm-eval`")

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise PhaseloopError("the downstream tasks score choices by log-likelihood; for generation "
                             "tasks use `phaseloop lm-eval`")
