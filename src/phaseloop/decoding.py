"""Token-by-token decoding: the one loop behind ``DecoderLM.generate``, the
encoder-decoders' ``generate`` and the task runner's greedy answers; the sampling rule
(temperature, top-k, top-p); the rows of a continuous batch in one KV cache
(``join_rows`` / ``keep_rows``: sequences of any length join and leave a running batch,
left-padded, each row at its own positions; ``phaseloop serve``); and self-speculative
decoding of a weight-tied trunk (``speculative_decode``: drafts at fewer passes, verified
at the full depth in one forward; Leviathan et al. 2023, Chen et al. 2023; drafting with
the model's own shallower computation as LayerSkip, Elhoushi et al. 2024, and Huginn,
Geiping et al. 2025 §6.4, do)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import numpy as np
import torch

from phaseloop.depth import set_model_depth
from phaseloop.errors import ConfigError
from phaseloop.kvcache import KVCache
from phaseloop.validation import MAX_SEQ_LEN

MAX_DRAFT_TOKENS = 64  # tokens a speculative round drafts at most (--draft-tokens, a request's draft_tokens)


def sampling_probs(logits_BV: torch.Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """[B, V]: the distribution ``pick_next`` samples from at ``temperature`` > 0,
    softmax(logits / T) restricted to the ``top_k`` largest logits (ties at the k-th kept),
    then to the nucleus (Holtzman et al. 2020, §3.1): the most probable tokens whose
    probabilities, largest first, sum to ``top_p`` (the one that crosses it included),
    renormalised. ``top_p`` None or 1: no nucleus cut."""
    scaled_BV = logits_BV / temperature
    # a row where T is below float precision (logits / T overflowed, or T rounded to 0) takes
    # the T -> 0 limit of softmax(logits / T), its argmax (ties share it); chosen per row on
    # the device, without reading a flag back to the host at every token
    broken_B1 = ((torch.isposinf(scaled_BV) | torch.isnan(scaled_BV)).any(-1, keepdim=True)
                 | ~torch.isfinite(scaled_BV).any(-1, keepdim=True))
    limit_BV = torch.zeros_like(logits_BV).masked_fill(logits_BV < logits_BV.amax(-1, keepdim=True), float("-inf"))
    logits_BV = torch.where(broken_B1, limit_BV, scaled_BV)
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    probs_BV = logits_BV.softmax(-1)
    if top_p is None or top_p >= 1:
        return probs_BV
    sorted_BV, order_BV = probs_BV.sort(-1, descending=True)
    before_BV = sorted_BV.cumsum(-1) - sorted_BV  # mass of the more probable tokens
    # the most probable token is always kept (a top_p below float precision compares as 0)
    cut_BV = torch.zeros_like(probs_BV, dtype=torch.bool).scatter(-1, order_BV, (before_BV >= top_p) & (before_BV > 0))
    probs_BV = probs_BV.masked_fill(cut_BV, 0.0)
    return probs_BV / probs_BV.sum(-1, keepdim=True)


def pick_next(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
              generator: torch.Generator | None = None, top_p: float | None = None) -> torch.Tensor:
    """[B, 1] next tokens: argmax for temperature 0, else a sample of
    ``sampling_probs(logits, temperature, top_k, top_p)``."""
    if temperature <= 0:
        return logits_BV.argmax(-1, keepdim=True)
    return torch.multinomial(sampling_probs(logits_BV, temperature, top_k, top_p), 1, generator=generator)


def check_request(prompt_BT: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
                  vocab_size: int | None = None) -> None:
    """Refuse, in one line (``ConfigError``), a decoding request no model runs: a prompt
    that is not integer ids [batch, tokens] (each below ``vocab_size`` where given), a
    negative or fractional token count, a temperature that is negative or not finite, a
    top-k below 1. What the CLI and the server refuse before they get here, the library's
    own ``generate`` calls refuse too."""
    def whole(v) -> bool:  # numpy's integers too (numbers.Integral), not a bool
        return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))

    if not isinstance(prompt_BT, torch.Tensor) or prompt_BT.dim() != 2 or prompt_BT.shape[1] < 1 \
            or prompt_BT.dtype.is_floating_point or prompt_BT.dtype.is_complex or prompt_BT.dtype == torch.bool:
        shape = list(prompt_BT.shape) if isinstance(prompt_BT, torch.Tensor) else type(prompt_BT).__name__
        raise ConfigError(f"the prompt must be integer token ids [batch, tokens] with at least one token, "
                          f"not {shape}")
    if not whole(max_new_tokens) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 0")
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, numbers.Real) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature={temperature!r}: must be a finite number >= 0 (0 = greedy)")
    if prompt_BT.shape[1] + max_new_tokens > MAX_SEQ_LEN:
        raise ConfigError(f"prompt + max_new_tokens = {prompt_BT.shape[1] + max_new_tokens:,} positions: at most "
                          f"{MAX_SEQ_LEN:,} (2^24, validation.MAX_SEQ_LEN); ask for fewer new tokens")
    if top_k is not None and (not whole(top_k) or top_k < 1):
        raise ConfigError(f"top_k={top_k!r}: must be an integer >= 1 (None: no cut)")
    if vocab_size is not None and prompt_BT.numel():
        lo, hi = int(prompt_BT.min()), int(prompt_BT.max())
        if lo < 0 or hi >= vocab_size:
            raise ConfigError(f"the prompt holds token id {lo if lo < 0 else hi}, outside the model's "
                              f"vocabulary 0 .. {vocab_size - 1}; encode it with the run's tokenizer")


@torch.no_grad()
def decode(step: Callable, prompt_BT: torch.Tensor, max_new_tokens: int, *,
           temperature: float = 0.0, top_k: int | None = None,
           generator: torch.Generator | None = None, eos_id: int | None = None,
           use_cache: bool = True, on_output: Callable | None = None) -> torch.Tensor:
    """Extend ``prompt_BT`` by up to ``max_new_tokens`` tokens; returns prompt + new [B, T+n].

    ``step(inputs_BT, cache)`` runs the model: with the KV cache it gets the new tokens
    only (the prompt first), without it the whole sequence so far. ``on_output(out)``
    sees every model output (e.g. ACT ponder times). With ``eos_id`` decoding stops once
    every row has produced it (later tokens of a finished row are left as generated).
    The last token is never fed back: the model runs at most ``max_new_tokens`` times."""
    check_request(prompt_BT, max_new_tokens, temperature, top_k)
    # keys/values of prompt + new tokens preallocated, written in place
    cache = KVCache(capacity=prompt_BT.shape[1] + max_new_tokens) if use_cache else None
    out_BT, inp_BT = prompt_BT, prompt_BT
    done_B = torch.zeros(prompt_BT.shape[0], dtype=torch.bool, device=prompt_BT.device)
    for _ in range(max_new_tokens):
        out = step(inp_BT if use_cache else out_BT, cache)
        if on_output is not None:
            on_output(out)
        nxt_B1 = pick_next(out.logits[:, -1].float(), temperature, top_k, generator)
        out_BT = torch.cat([out_BT, nxt_B1], dim=1)
        inp_BT = nxt_B1
        if eos_id is not None:
            done_B |= nxt_B1[:, 0] == eos_id
            if bool(done_B.all()):
                break
    return out_BT


def until_eos(rows: list[list[int]], eos_id: int) -> list[list[int]]:
    """Each row cut before its first ``eos_id``."""
    return [row[: row.index(eos_id)] if eos_id in row else row for row in rows]


# ---------------------------------------------------------------------------- rows of a batch
def padded_rows(cache: KVCache, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For T new tokens of the left-padded rows of ``cache`` (``KVCache.pad``): each row's
    positions [B, T] (column - pad; 0 on padding) and the attention mask [B, 1, T, S],
    S = cache.pos + T: a query attends to its row's real columns up to its own, and a
    padding column to itself only (no row of the softmax is empty, so none is NaN)."""
    start = cache.pos
    cols_S = torch.arange(start + T, device=device)
    q_T1 = cols_S[start:, None]
    pad_B = cache.pad.to(device)
    mask_BTS = (cols_S <= q_T1) & ((cols_S >= pad_B[:, None, None]) | (cols_S == q_T1))
    return (q_T1[:, 0] - pad_B[:, None]).clamp_min(0), mask_BTS[:, None]


def not_joinable(cache: KVCache) -> str | None:
    """Why ``cache``'s rows cannot share a batch with others (None: they can). Rows join
    when every slot holds keys and values of every column: a slot holding anything else
    (UT+ACT's pending step inputs, a running pool) or fewer columns (ACT's lazily
    extended steps) is a summary of its row that padding would change."""
    for slot, entry in cache.entries.items():
        if not (isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(t, torch.Tensor) for t in entry)):
            return f"its cache slot {slot!r} is not keys and values"
        if entry[0].dim() != 4 or entry[0].shape[2] != cache.pos:
            return f"its cache slot {slot!r} holds {entry[0].shape[2]} of {cache.pos} positions"
    return None


def _rows(cache: KVCache) -> tuple[int, torch.device]:
    k = next(iter(cache.entries.values()))[0]
    return k.shape[0], k.device


def join_rows(caches: list[KVCache], capacity: int = 0) -> KVCache:
    """One cache holding the rows of ``caches`` (in order), each left-padded to the longest
    (``KVCache.pad``; padding columns hold zeros), its slots preallocated for ``capacity``
    columns. Each cache must be joinable (``not_joinable``) and hold the same slots."""
    S, slots = max(c.pos for c in caches), list(caches[0].entries)
    for c in caches:
        why = not_joinable(c) or (None if set(c.entries) == set(slots) and slots else "it holds other slots")
        if why:
            raise ValueError(f"rows cannot join a batch: {why}")
    pads = []
    for c in caches:
        B, device = _rows(c)
        pads.append((c.pad if c.pad is not None else torch.zeros(B, dtype=torch.long, device=device)) + S - c.pos)
    out = KVCache(pos=S, capacity=max(S, capacity), pad=torch.cat(pads))  # its buffers, preallocated
    for slot in slots:
        k0 = caches[0].entries[slot][0]
        buf = tuple(k0.new_zeros(len(out.pad), k0.shape[1], max(S, out.capacity), k0.shape[3]) for _ in range(2))
        row = 0
        for c in caches:
            k, v = c.entries[slot]
            buf[0][row:row + k.shape[0], :, S - c.pos:S] = k
            buf[1][row:row + k.shape[0], :, S - c.pos:S] = v
            row += k.shape[0]
        out.buffers[slot] = buf
        out.entries[slot] = (buf[0][:, :, :S], buf[1][:, :, :S])
    return out


def keep_rows(cache: KVCache, keep: list[int]) -> None:
    """Keep rows ``keep`` of a cache (the others finished), then drop the leading columns
    that are padding in every row kept; with no padding left ``pad`` is None (the path of
    a single unpadded sequence)."""
    cache.select_rows(torch.tensor(keep, dtype=torch.long, device=_rows(cache)[1]))
    m = int(cache.pad.min()) if cache.pad is not None and len(keep) else 0
    if m:
        for slot, (k, v) in list(cache.entries.items()):
            cache.buffers[slot] = tuple(t[:, :, m:].clone() for t in cache.buffers.get(slot, (k, v)))
            cache.entries[slot] = tuple(t[:, :, :k.shape[2] - m] for t in cache.buffers[slot])
        cache.pos -= m
        cache.pad = cache.pad - m
        cache.written.clear()  # the columns moved: no slot was written at the new pos
    if cache.pad is not None and (not len(keep) or int(cache.pad.max()) == 0):
        cache.pad = None


# ---------------------------------------------------------------------------- speculative
def accept_probs(p_V: torch.Tensor, q_V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's arithmetic for one position (Leviathan et al. 2023 §2.3):
    a draft token d ~ q is kept with probability min(1, p(d) / q(d)) [..., V], a rejected
    one is replaced by a sample of norm(max(0, p - q)) [..., V]; the token that comes out
    is then distributed as p exactly."""
    keep_V = torch.where(q_V > 0, (p_V / q_V.clamp_min(torch.finfo(q_V.dtype).tiny)).clamp(max=1), 1.0)
    res_V = (p_V - q_V).clamp_min(0)
    total = res_V.sum(-1, keepdim=True)
    return keep_V, torch.where(total > 0, res_V / total.clamp_min(torch.finfo(p_V.dtype).tiny), p_V)


def verify(p_BKV: torch.Tensor, q_BKV: torch.Tensor | None, d_BK: torch.Tensor, generator=None):
    """Accepted draft counts j [B] of K drafts d and the token after them [B] (the
    replacement at the first rejection, or a sample of p_K, the bonus, when all K were
    kept). ``p_BKV`` [B, K + 1, V]: the full depth's distributions after each draft prefix;
    ``q_BKV`` the draft's (None: greedy, keep while the full depth's argmax agrees)."""
    B, K = d_BK.shape
    if q_BKV is None:
        ok_BK = p_BKV[:, :K].argmax(-1) == d_BK
    else:
        keep_BKV, _ = accept_probs(p_BKV[:, :K], q_BKV)
        u_BK = torch.rand(B, K, generator=generator, device=d_BK.device, dtype=p_BKV.dtype)
        ok_BK = u_BK < keep_BKV.gather(-1, d_BK[..., None])[..., 0]
    j_B = ok_BK.long().cumprod(1).sum(1)
    p_j = p_BKV[torch.arange(B, device=d_BK.device), j_B]  # [B, V]
    if q_BKV is None:
        return j_B, p_j.argmax(-1)
    q_j = torch.cat([q_BKV, torch.zeros_like(q_BKV[:, :1])], 1)[torch.arange(B, device=d_BK.device), j_B]
    _, res_BV = accept_probs(p_j, q_j)  # q = 0 after the last draft: the residual is p_K itself
    return j_B, torch.multinomial(res_BV, 1, generator=generator)[:, 0]


@torch.no_grad()
def speculative_decode(model, prompt_BT: torch.Tensor, max_new_tokens: int, draft_passes: int,
                       draft_tokens: int = 4, temperature: float = 0.0, top_k: int | None = None,
                       generator: torch.Generator | None = None, eos_id: int | None = None):
    """Extend ``prompt_BT`` by ``max_new_tokens`` with drafts of ``draft_tokens`` tokens at
    ``draft_passes`` passes, each round verified in one forward at the trunk's depth.
    Greedy output is the full depth's greedy output; sampled, each token is distributed as
    the full depth's (``verify``). The draft's keys/values are rolled back before the
    verification writes its own (``KVCache.truncate``), so one cache serves both. Rows of a
    batch keep the accepted prefix all of them reached (the same length each round; a
    row's tokens are still the full depth's distribution). Returns (ids, info)."""
    full = model.trunk.passes
    greedy = temperature <= 0

    def dist(logits_BV):
        return None if greedy else sampling_probs(logits_BV.float(), temperature, top_k)

    def pick(logits_BV, probs_BV):
        return logits_BV.argmax(-1) if greedy else torch.multinomial(probs_BV, 1, generator=generator)[:, 0]

    cache = KVCache(capacity=prompt_BT.shape[1] + max_new_tokens + min(draft_tokens, max_new_tokens) + 1)
    if max_new_tokens <= 0:  # as ``decode``: the model never runs
        return prompt_BT, {"cache": cache, "acceptance": None, "rounds": 0, "passes": 0}
    ran = []  # passes behind each forward's positions, per row: read once at the end (no host read a forward)

    def forward(x_BT, passes: int, last: bool = False):
        o = model(x_BT, cache=cache)
        s = o.stats.get("exit_passes")  # what ran (ACT halts, a rule exits), else the depth set
        ran.append(passes * (1 if last else x_BT.shape[1]) if s is None else (s[:, -1:] if last else s).sum(1))
        return o.logits

    logits = forward(prompt_BT, full, last=True)[:, -1]
    nxt_B = pick(logits, dist(logits))
    out, new, drafted, placed, rounds = [nxt_B[:, None]], 1, 0, [], 0
    try:
        while new < max_new_tokens and not (eos_id is not None and bool((torch.cat(out, 1) == eos_id).any(1).all())):
            K, n = min(draft_tokens, max_new_tokens - new), cache.pos
            set_model_depth(model, draft_passes, "last")
            d, q, inp = [], [], nxt_B[:, None]
            for _ in range(K):
                lg = forward(inp, draft_passes)[:, -1]
                q.append(dist(lg))
                d.append(pick(lg, q[-1]))
                inp = d[-1][:, None]
            cache.truncate(n)
            set_model_depth(model, full, "last")
            d_BK = torch.stack(d, 1)
            logits_BKV = forward(torch.cat([nxt_B[:, None], d_BK], 1), full).float()
            p_BKV = logits_BKV if greedy else sampling_probs(
                logits_BKV.flatten(0, 1), temperature, top_k).view_as(logits_BKV)
            j_B, after_B = verify(p_BKV, None if greedy else torch.stack(q, 1), d_BK, generator)
            m = int(j_B.min())  # every row keeps m drafts, then its own next token
            nxt_B = torch.where(j_B == m, after_B, d_BK[:, min(m, K - 1)])
            out.append(torch.cat([d_BK[:, :m], nxt_B[:, None]], 1))
            cache.truncate(n + 1 + m)
            # drafts in the output: m a row from position ``new``, and d[m] where a row accepted it
            # (its next token); counted once the output's length is known (an eos may cut it)
            placed.append((new, m, int((j_B > m).sum())))
            drafted, rounds = drafted + K * len(j_B), rounds + 1
            new += m + 1
    finally:
        set_model_depth(model, full, "last")
    new_BN = torch.cat(out, 1)[:, :max_new_tokens]
    if eos_id is not None:  # as ``decode``: stop at the token by which every row has produced eos
        hit_BN = new_BN == eos_id
        if bool(hit_BN.any(1).all()):
            new_BN = new_BN[:, :int(hit_BN.int().argmax(1).max()) + 1]
    ids, L, B = torch.cat([prompt_BT, new_BN], 1), new_BN.shape[1], new_BN.shape[0]
    kept = sum(B * max(0, min(m, L - at)) + (extra if at + m < L else 0) for at, m, extra in placed)
    passes = sum(float(r) if not isinstance(r, torch.Tensor) else float(r.float().mean()) for r in ran)
    return ids, {"cache": cache, "acceptance": kept / drafted if drafted else None, "rounds": rounds,
                 "passes": passes}
