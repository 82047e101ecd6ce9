"""Token-by-token decoding: the one loop behind ``DecoderLM.generate``, the
encoder-decoders' ``generate`` and the task runner's greedy answers."""

from __future__ import annotations

from collections.abc import Callable

import torch

from phaseloop.layers import KVCache


def sampling_probs(logits_BV: torch.Tensor, temperature: float, top_k: int | None = None) -> torch.Tensor:
    """[B, V]: the distribution ``pick_next`` samples from at ``temperature`` > 0,
    softmax(logits / T) restricted to the ``top_k`` largest logits (ties at the k-th kept)."""
    logits_BV = logits_BV / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    return logits_BV.softmax(-1)


def pick_next(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, 1] next tokens: argmax for temperature 0, else a sample of
    ``sampling_probs(logits, temperature, top_k)``."""
    if temperature <= 0:
        return logits_BV.argmax(-1, keepdim=True)
    return torch.multinomial(sampling_probs(logits_BV, temperature, top_k), 1, generator=generator)


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
