"""Parameter and FLOP accounting without allocating weights (the model is built on the
meta device)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from phaseloop.config import ModelConfig
from phaseloop.depth import set_model_depth
from phaseloop.errors import PhaseloopError, first_line
from phaseloop.model import build_model


def count_params(cfg: ModelConfig, seq_len: int | None = None, depth: int | None = None,
                 extend: str | None = None) -> dict:
    """Integer fields: total, embedding (input), unembedding (output head; 0 when tied),
    non_embedding (everything else), without_input_embedding (total − embedding: the
    Hyperloop paper's count) and flops_per_token: forward-pass FLOPs per token at
    ``seq_len`` (default the config's max_seq_len), 2 per multiply-add, counted by
    torch's FlopCounterMode on meta tensors — every matmul including the head and the
    attention score/value products (full T x T, the Kaplan et al. 2020 convention).
    ``depth`` (``extend``): with the trunk run at that depth (``depth.set_model_depth``)."""
    model = build_model(cfg, device="meta")
    if depth is not None:
        set_model_depth(model, depth, extend)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.embed.tok.weight.numel()
    unembedding = 0 if cfg.tie_embeddings else model.head.weight.numel()
    T = seq_len or cfg.max_seq_len
    idx = torch.zeros(1, T, dtype=torch.long, device="meta")
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(idx)
    return {"arch": cfg.arch, "total": int(total), "embedding": int(embedding),
            "unembedding": int(unembedding), "non_embedding": int(total - embedding - unembedding),
            "without_input_embedding": int(total - embedding),
            "flops_per_token": int(fc.get_total_flops() // T), "seq_len": T,
            "depth": int(model.trunk.depth)}


def breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters per part of the model built on the meta device: the embedding, each
    child of the trunk (a looped trunk's begin / middle / end / hc; a stack's layers)
    and the rest (final norm, untied head); the parts sum to ``count_params``' total."""
    model = build_model(cfg, device="meta")
    out: dict[str, int] = {}
    seen: set[int] = set()

    def add(name: str, module) -> None:
        n = sum(p.numel() for p in module.parameters() if id(p) not in seen)
        seen.update(id(p) for p in module.parameters())
        if n:
            out[name] = out.get(name, 0) + int(n)

    add("embedding", model.embed)
    for name, child in model.trunk.named_children():
        add(f"trunk.{name}", child)
    add("other (final norm, head)", model)
    return out


def measure(cfg, seq_len: int, depth: int | None = None, extend: str | None = None) -> dict:
    """count_params on the meta device; FLOPs None when an arch cannot trace on meta."""
    try:
        return count_params(cfg, seq_len, depth, extend)
    except PhaseloopError:
        raise
    except Exception as e:  # e.g. data-dependent halting loops on meta tensors
        model = build_model(cfg, device="meta")
        total = sum(p.numel() for p in model.parameters())
        return {"arch": cfg.arch, "total": int(total), "flops_per_token": None, "seq_len": seq_len,
                "depth": int(model.trunk.depth),
                "flops_error": f"{e.__class__.__name__}: {first_line(e, 120)}"}


def format_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def flops_per_token(cfg: ModelConfig, seq_len: int, depth: int | None = None,
                    extend: str | None = None) -> int | None:
    """Forward FLOPs per token at ``seq_len`` with the trunk at ``depth``
    (``params.measure``: counted on the meta device, where ACT runs every step, an upper
    bound at that step limit); None where the trunk cannot trace on meta."""
    return measure(cfg, seq_len, depth, extend)["flops_per_token"]
