"""Looking inside a trained model: per-token loss, the residual stream after every layer
application, attention maps, ACT ponder times, the mixing of n residual streams
(hyper-connections), what each architecture adds (``ArchSpec.probe``: 3PT's angles and
stripes), the next-token distribution, loss against depth. Pure torch; ``phaseloop
explore`` only calls these functions.

Capture is by forward hooks registered for one forward pass (``recording``), never in the
trunks' code: a model runs exactly as it does without them (tests/test_probe.py checks
that outputs are bitwise unchanged). The sites are the trunk's own ``stream_sites()``
(``trunk.Trunk``): a looped or UT block is seen once per pass, a hyper-connection with its
n streams; attention probabilities are recomputed from each attention module's input.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from phaseloop import registry
from phaseloop.decoding import sampling_probs
from phaseloop.depth import set_model_depth
from phaseloop.errors import PhaseloopError
from phaseloop.layers import Attention

MAX_PROMPT_CHARS = 100_000  # refused before tokenizing


@dataclass
class Recording:
    """What one forward pass left: (site, tensor) pairs in the order they happened.

    ``states``: the residual stream after each layer application ([B, T, D], or
    [B, T, n, D] for n streams), the first being the embedding output; ``attention``:
    probabilities [B, H, T, S] of each self-attention application; ``connections``:
    (H_pre [B, T, n], H_post [B, T, n], H_res) of each hyper-connection application."""

    states: list = field(default_factory=list)
    attention: list = field(default_factory=list)
    connections: list = field(default_factory=list)


def attention_probs(attn: Attention, x_BTD: torch.Tensor, ctx) -> torch.Tensor:
    """[B, H, T, T] softmax(q k^T / sqrt(E)) of a self-attention module on its input,
    without a cache: the weights its SDPA call applies (head h reads kv head h // (H/K)),
    causal within each document where the window holds several (``ctx.doc_ids``, as
    ``layers.Attention`` masks them: ``--doc-mask``)."""
    B, T, _ = x_BTD.shape
    q_BHTE = attn.q_proj(x_BTD).view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
    k_BKTE, _ = attn.project_kv(x_BTD)
    if attn.use_rope:
        q_BHTE, k_BKTE = attn.rotate(q_BHTE, k_BKTE, ctx.cos, ctx.sin)
    k_BHTE = k_BKTE.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)
    s_BHTS = q_BHTE.float() @ k_BHTE.float().transpose(-1, -2) / math.sqrt(attn.head_dim)
    if ctx.causal:
        allowed = torch.ones(T, T, dtype=torch.bool, device=s_BHTS.device).tril()
        if ctx.doc_ids is not None:  # [B, 1, T, T]: the same document, causally
            allowed = allowed & (ctx.doc_ids[:, :, None] == ctx.doc_ids[:, None, :])[:, None]
        s_BHTS = s_BHTS.masked_fill(~allowed, float("-inf"))
    elif ctx.key_mask is not None:
        s_BHTS = s_BHTS.masked_fill(~ctx.key_mask, float("-inf"))
    return s_BHTS.softmax(-1)


@contextmanager
def recording(model: nn.Module, attention: bool = False):
    """Record the stream after every layer application (and attention maps when asked)
    during the forward passes inside the ``with``; hooks are removed on exit. Sites are
    named by module path, with "pass k" where a module applies more than once."""
    if not (hasattr(model, "embed") and isinstance(getattr(model, "trunk", None), nn.Module)
            and hasattr(model.trunk, "stream_sites")):
        raise PhaseloopError(f"{type(model).__name__} is not a decoder-only phaseloop model (embedding, "
                             "trunk, head): probe reads those only")
    rec = Recording()
    names = {id(m): n.removeprefix("trunk.") for n, m in model.named_modules()}
    seen: Counter = Counter()
    raw = {"states": [], "attention": [], "connections": []}

    def site(m, kind="states"):
        seen[kind, id(m)] += 1
        return (m, seen[kind, id(m)])

    def on_state(m, args, out):
        raw["states"].append((site(m), out.detach()))

    def on_attention(m, args, out):
        x_BTD, ctx = args[0], args[1]
        if m.cross or getattr(ctx, "cache", None) is not None:
            return  # cross-attention and cached decoding are not drawn
        raw["attention"].append((site(m, "attention"), attention_probs(m, x_BTD.detach(), ctx)))

    def on_connection(m, args, out):
        raw["connections"].append((site(m, "connections"), tuple(
            None if c is None else c.detach() for c in m.coefficients(args[0].detach()))))

    hooks = [model.embed.register_forward_hook(
        lambda m, a, o: raw["states"].append(((m, 1), o.detach())))]
    for m in model.trunk.stream_sites():
        hooks.append(m.register_forward_hook(on_state))
    for m in model.modules():
        if attention and isinstance(m, Attention):
            hooks.append(m.register_forward_hook(on_attention))
    for m in model.trunk.mixing_sites():
        hooks.append(m.register_forward_hook(on_connection))
    try:
        yield rec
    finally:
        for h in hooks:
            h.remove()
        for key, items in raw.items():
            getattr(rec, key).extend(
                ("embedding" if m is model.embed else
                 names.get(id(m), type(m).__name__) + (f" pass {k}" if seen[key, id(m)] > 1 else ""), t)
                for (m, k), t in items)


# ---------------------------------------------------------------------------- prompts
def encode_prompt(tokenizer, text: str, max_len: int) -> torch.Tensor:
    """[T] token ids of ``text``; 2 <= T <= ``max_len`` (the model's max_seq_len), else a
    one-line error saying how to fix it."""
    if not isinstance(text, str) or not text:
        raise PhaseloopError("the prompt is empty; type some text (at least 2 tokens)")
    if len(text) > MAX_PROMPT_CHARS:
        raise PhaseloopError(f"the prompt has {len(text):,} characters; at most {MAX_PROMPT_CHARS:,} are read")
    ids = torch.as_tensor(tokenizer.encode(text), dtype=torch.long)
    if len(ids) > max_len:
        raise PhaseloopError(f"the prompt is {len(ids)} tokens, longer than this model's max_seq_len "
                             f"{max_len}; shorten it")
    if len(ids) < 2:
        raise PhaseloopError("the prompt must be at least 2 tokens (a loss needs a next token)")
    return ids


# ---------------------------------------------------------------------------- analysis
def token_losses(logits_TV: torch.Tensor, ids_T: torch.Tensor) -> torch.Tensor:
    """[T-1]: -log p(token t+1 | tokens <= t), nats (the loss the model trains on)."""
    return F.cross_entropy(logits_TV[:-1].float(), ids_T[1:], reduction="none")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.float(), b.float(), dim=-1)


def stream_mixing(rec: Recording) -> list[dict]:
    """Per hyper-connection application (a Hyperloop loop, an mHC sub-layer): H_pre, H_post
    and H_res per token (batch row 0; H_res its diagonal or its n x n matrix), the n x n
    cosine similarity of the streams it wrote (mean over tokens), and each stream's cosine
    similarity to the same stream at the previous application."""
    states = {s: x for s, x in rec.states if x.dim() == 4}
    rows, prev = [], None
    for site, (pre, post, res) in rec.connections:
        y_BTnD = states.get(site)
        row = {"site": site, "pre": pre[0].tolist(), "post": post[0].tolist(),
               "res": None if res is None else res[0].tolist()}
        if y_BTnD is not None:
            row["similarity"] = _cosine(y_BTnD.unsqueeze(3), y_BTnD.unsqueeze(2)).mean((0, 1)).tolist()
            row["vs_previous"] = None if prev is None else _cosine(y_BTnD, prev).mean((0, 1)).tolist()
            prev = y_BTnD
        rows.append(row)
    return rows


@dataclass
class Analysis:
    ids: list
    logits: torch.Tensor  # [T, V] float
    loss: list  # [T-1]
    ponder: list | None = None  # [T] ACT ponder time (N + R)
    halting: list | None = None  # [steps, T] halting probability per step
    halted: list | None = None  # [steps, T] True where the position had halted: its weight is 0
    mixing: list | None = None
    attention: list = field(default_factory=list)  # (site, [H, T, T])
    extras: dict = field(default_factory=dict)  # the architecture's own (registry.probe_fns)

    def summary(self) -> dict:
        return {"n_tokens": len(self.ids), "mean_loss": float(sum(self.loss) / len(self.loss)),
                "loss": self.loss, "ponder": self.ponder, "halting": self.halting, "halted": self.halted,
                "mixing": self.mixing,
                "attention_sites": [s for s, _ in self.attention],
                "heads": self.attention[0][1].shape[0] if self.attention else 0, **self.extras}


def _batch(docs: dict | None) -> dict:
    """A sequence's document inputs (``doc_ids_BT`` / ``positions_BT``, [T] each, as
    ``data.corpus.Documents.inputs`` gives a window of a run trained with ``--doc-mask`` /
    ``--doc-positions``) as the model's keyword arguments for a batch of one."""
    return {k: v[None] for k, v in (docs or {}).items()}


@torch.no_grad()
def analyze(model: nn.Module, ids_T: torch.Tensor, attention: bool = True, docs: dict | None = None) -> Analysis:
    """Everything the inside page shows for one sequence, from one forward pass;
    ``docs``: its document inputs, where the run trained with them (``_batch``)."""
    was = model.training
    model.eval()
    try:
        with recording(model, attention=attention) as rec:
            out = model(ids_T[None], **_batch(docs))
    finally:
        model.train(was)
    logits_TV = out.logits[0].float()
    a = Analysis(ids=ids_T.tolist(), logits=logits_TV, loss=token_losses(logits_TV, ids_T).tolist(),
                 attention=[(s, p[0]) for s, p in rec.attention])
    if "ponder_time" in out.stats:
        a.ponder = out.stats["ponder_time"][0].tolist()
        a.halting = out.stats["halting_probs"][:, 0].tolist()
        # step t has update weight 0 once a position has used its n_updates steps (act.ACTState.step)
        used_T = out.stats["exit_passes"][0]
        a.halted = [(used_T <= t).tolist() for t in range(len(a.halting))]
    a.mixing = stream_mixing(rec) or None
    for fn in registry.probe_fns(model):
        a.extras.update(fn(model, rec))
    return a


def next_token(logits_V: torch.Tensor, temperature: float, top_k: int | None, n: int = 10) -> list[dict]:
    """The ``n`` most likely next tokens under ``decoding.sampling_probs`` (what generation
    samples from at that temperature and top-k): id, probability, raw logit."""
    p_V = sampling_probs(logits_V[None].float(), temperature, top_k)[0]
    p, i = torch.topk(p_V, min(n, p_V.numel()))
    return [{"id": int(k), "p": float(q), "logit": float(logits_V[k])} for q, k in zip(p, i)]


@torch.no_grad()
def loss_vs_depth(model: nn.Module, ids_T: torch.Tensor, depths: list[int], docs: dict | None = None) -> list[dict]:
    """Mean loss of the sequence with the trunk run at each depth (``depth.set_model_depth``
    on a copy, beyond the trained passes reusing the last one's parameters: extend='last');
    ``docs``: its document inputs (``analyze``)."""

    probe = copy.deepcopy(model).eval()
    rows = []
    for d in depths:
        set_model_depth(probe, d, extend="last")
        logits_TV = probe(ids_T[None], **_batch(docs)).logits[0]
        rows.append({"depth": d, "loss": token_losses(logits_TV, ids_T).mean().item()})
    return rows
