"""Token-by-token decoding: the one loop behind ``DecoderLM.generate``, the
encoder-decoders' ``generate`` and the task runner's greedy answers; the sampling rule
(temperature, top-k, top-p); and the rows of a continuous batch in one KV cache
(``join_rows`` / ``keep_rows``: sequences of any length join and leave a running batch,
left-padded, each row at its own positions; ``phaseloop serve``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from phaseloop.layers import KVCache


def sampling_probs(logits_BV: torch.Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """[B, V]: the distribution ``pick_next`` samples from at ``temperature`` > 0,
    softmax(logits / T) restricted to the ``top_k`` largest logits (ties at the k-th kept),
    then to the nucleus (Holtzman et al. 2020, §3.1): the most probable tokens whose
    probabilities, largest first, sum to ``top_p`` (the one that crosses it included),
    renormalised. ``top_p`` None or 1: no nucleus cut."""
    logits_BV = logits_BV / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    probs_BV = logits_BV.softmax(-1)
    if top_p is None or top_p >= 1:
        return probs_BV
    sorted_BV, order_BV = probs_BV.sort(-1, descending=True)
    before_BV = sorted_BV.cumsum(-1) - sorted_BV  # mass of the more probable tokens
    cut_BV = torch.zeros_like(probs_BV, dtype=torch.bool).scatter(-1, order_BV, before_BV >= top_p)
    probs_BV = probs_BV.masked_fill(cut_BV, 0.0)
    return probs_BV / probs_BV.sum(-1, keepdim=True)


def pick_next(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
              generator: torch.Generator | None = None, top_p: float | None = None) -> torch.Tensor:
    """[B, 1] next tokens: argmax for temperature 0, else a sample of
    ``sampling_probs(logits, temperature, top_k, top_p)``."""
    if temperature <= 0:
        return logits_BV.argmax(-1, keepdim=True)
    return torch.multinomial(sampling_probs(logits_BV, temperature, top_k, top_p), 1, generator=generator)


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
        why = not_joinable(c) or (None if list(c.entries) == slots and slots else "it holds other slots")
        if why:
            raise ValueError(f"rows cannot join a batch: {why}")
    pads = []
    for c in caches:
        B, device = _rows(c)
        pads.append((c.pad if c.pad is not None else torch.zeros(B, dtype=torch.long, device=device)) + S - c.pos)
    out = KVCache(pos=S, capacity=capacity or None, pad=torch.cat(pads))
    for slot in slots:
        k0 = caches[0].entries[slot][0]
        buf = tuple(k0.new_zeros(len(out.pad), k0.shape[1], max(S, capacity), k0.shape[3]) for _ in range(2))
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
    if cache.pad is not None and (not len(keep) or int(cache.pad.max()) == 0):
        cache.pad = None
