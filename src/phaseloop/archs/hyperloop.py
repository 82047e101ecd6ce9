"""Looped, Hyperloop and mHC trunks: what is new about them.

* ``Looped`` — begin block -> middle block applied L times with shared weights -> end
  block (Zeitoun, Torroba-Hennigen, Kim, "Hyperloop Transformers", arXiv 2604.21254, §2).
* ``Hyperloop`` — looped + n residual streams mixed by hyper-connections once after each
  loop (ibid. §3); options: H_res diagonal / Sinkhorn / identity, connections after every
  middle layer, static coefficients (``hc_dynamic=False``, the paper's "static T"
  ablation) and the review's pooled-MLP transition (``PooledMLPTransition``).
* ``MHC`` — a plain stack with manifold-constrained hyper-connections on every sub-layer
  (Xie et al., "mHC", arXiv 2512.24880; Zhu et al., "Hyper-Connections", ICLR 2025).

Every trunk is built from ``layers.Block``; the stream maths (``HyperConnection``,
Sinkhorn, the initialisation that starts each model next to its stream-free twin) lives
in ``hyperconn.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from phaseloop.archs import paper_scales
from phaseloop.archs.hyperconn import HyperConnection, PooledMLPTransition, copy_streams, merge_streams
from phaseloop.config import MAX_DEPTH, ModelConfig, fail, register_presets
from phaseloop.early_exit import END_READ, PASS_RULES, monitor
from phaseloop.errors import ConfigError
from phaseloop.layers import Block, ForwardContext
from phaseloop.registry import ArchSpec, register_arch
from phaseloop.trunk import Trunk
from phaseloop.validation import check_ints


# ---------------------------------------------------------------------------- options
@dataclass
class LoopOptions:
    """Looped trunks (Hyperloop §2): n_unique_layers (ModelConfig.n_layers) counts *unique*
    layers, begin + middle + end."""

    n_begin: int | None = None  # layers before the loop (None -> n_unique_layers // 4)
    n_end: int | None = None  # layers after the loop (None -> n_unique_layers // 4); middle = the rest
    n_loops: int = 3  # L, applications of the shared middle block

    @property
    def loop_split(self) -> tuple[int, int, int]:
        """(begin, middle, end) unique layers (default ~25/50/25 %)."""
        n = self._cfg.n_layers
        b = n // 4 if self.n_begin is None else self.n_begin
        e = n // 4 if self.n_end is None else self.n_end
        return b, n - b - e, e

    def validate(self, cfg: ModelConfig) -> None:
        check_ints(self, ("n_begin", "n_end"), "config", minimum=0, optional=True)
        check_ints(self, ("n_loops",), "config")
        if self.n_loops > MAX_DEPTH:  # each loop builds its own modules: refuse before building them
            fail("n_loops", self.n_loops, f"at most {MAX_DEPTH} loops (layer applications a token, "
                 "config.MAX_DEPTH); use fewer")
        b, m, e = self.loop_split
        if m < 1:
            fail("n_unique_layers", cfg.n_layers, f"leaves no middle layer after n_begin={b} and "
                 f"n_end={e}; raise n_unique_layers or lower n_begin/n_end")


@dataclass
class HCOptions:
    """Hyper-connections (Hyperloop §3, mHC §3): n residual streams and their mixing."""

    same_function: ClassVar[tuple[str, ...]] = ("hc_alpha_init",)  # the weights replace it
    n_streams: int = 4  # residual streams
    hc_res: str | None = None  # H_res: diagonal | sinkhorn | identity (None -> diagonal)
    hc_alpha_init: float = 0.01  # init of the alpha scales of the dynamic coefficients
    hc_dynamic: bool = True  # False: ablation "static T", coefficients from the biases only
    sinkhorn_iters: int = 20  # Sinkhorn-Knopp iterations for hc_res=sinkhorn

    @property
    def hc_res_form(self) -> str:
        return self.hc_res or "diagonal"

    def validate(self, cfg: ModelConfig) -> None:
        check_ints(self, ("n_streams", "sinkhorn_iters"), "config")
        if self.hc_res not in (None, "diagonal", "sinkhorn", "identity"):
            fail("hc_res", self.hc_res, "choose diagonal, sinkhorn or identity")
        if not self.hc_alpha_init >= 0:
            fail("hc_alpha_init", self.hc_alpha_init, "must be >= 0")
        if not self.hc_dynamic and self.hc_alpha_init != ModelConfig.default_of("hc_alpha_init"):
            fail("hc_alpha_init", self.hc_alpha_init, "static coefficients (hc_dynamic=False) have "
                 "no alpha; drop hc_alpha_init or set hc_dynamic=True")
        if self.n_streams < 2:
            fail("n_streams", self.n_streams, "hyper-connections need >= 2 streams; "
                 "use arch='looped' (or the baseline) for a single residual stream")


@dataclass
class HyperloopOptions:
    """Hyperloop's own ablations."""

    hc_per_layer: bool = False  # connections after every middle layer instead of once per loop
    hc_transition: str = "hc"  # hc (paper) | pooled_mlp (the review's variant)

    def validate(self, cfg: ModelConfig) -> None:
        if self.hc_transition not in ("hc", "pooled_mlp"):
            fail("hc_transition", self.hc_transition, "choose hc or pooled_mlp")
        if self.hc_transition == "pooled_mlp" and not cfg.hc_dynamic:
            fail("hc_dynamic", False, "the pooled-MLP variant has no hyper-connection "
                 "coefficients to make static; drop hc_dynamic or use hc_transition='hc'")
        if self.hc_transition == "pooled_mlp" and (self.hc_per_layer or cfg.hc_res is not None):
            fail("hc_transition", self.hc_transition,
                 "the pooled-MLP variant has no H_res and runs once per loop; drop hc_res "
                 "and hc_per_layer")


# ---------------------------------------------------------------------------- trunks
class Looped(Trunk):
    """begin (b layers) -> middle (m layers, applied L times, one set of weights) -> end
    (e layers) (Hyperloop §2). ``cfg.n_layers`` = b + m + e unique layers; the depth is
    b + m L + e. Pass l of middle layer i uses KV-cache slot ("middle", i, l)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        b, m, e = cfg.loop_split
        n = cfg.n_layers
        self.begin = nn.ModuleList(Block(cfg, i, n) for i in range(b))
        self.middle = nn.ModuleList(Block(cfg, b + i, n) for i in range(m))
        self.end = nn.ModuleList(Block(cfg, b + m + i, n) for i in range(e))
        self.n_loops = cfg.n_loops  # trained passes of the middle block
        self.loops = cfg.n_loops  # passes run now (set_depth)
        self.depth = b + m * cfg.n_loops + e  # nominal (trained) depth: init scaling, FLOPs
        self.pass_blocks, self.readout_blocks = m, e

    dynamic_depth = True
    exit_rules = PASS_RULES  # early exit per position after each pass (early_exit.py)
    shares_kv = True  # pass l of middle layer i uses slot ("middle", i, kv_slot(l))

    @property
    def passes(self) -> int:
        return self.loops

    def set_depth(self, n: int, extend: str | None = None) -> None:
        """Run ``n`` passes of the shared middle block from now on (depth extrapolation
        of a weight-tied loop, Hyperloop §2); ``extend`` matters only to ``Hyperloop``."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"invalid depth {n!r}: the number of loop passes must be a positive integer")
        if n > MAX_DEPTH:
            raise ConfigError(f"invalid depth {n}: at most {MAX_DEPTH} loop passes (config.MAX_DEPTH)")
        if extend not in (None, "last"):
            raise ConfigError(f"invalid extend={extend!r}: choose 'last' (or leave it unset)")
        self.loops = n

    def reset_depth(self) -> None:
        self.loops = self.n_loops

    @staticmethod
    def run(layers: nn.ModuleList, x_BTD: torch.Tensor, ctx: ForwardContext, name: str,
            loop: int | None = None, mon=None) -> torch.Tensor:
        """``mon`` (early exit): exited positions keep their input through every layer."""
        x_in = x_BTD
        for i, layer in enumerate(layers):
            x_BTD = layer(x_BTD, ctx, slot=(name, i) if loop is None else (name, i, loop))
            x_BTD = x_BTD if mon is None else mon.hold(x_in, x_BTD)
        return x_BTD

    def cache_slots(self) -> list:
        loops = list(dict.fromkeys(self.kv_slot(loop) for loop in range(self.loops)))
        reads = []  # the kl / entropy readouts through the end block after every pass but the last
        if self.exits is not None and self.exits.rule.kind in END_READ:
            reads = [("read", i, s) for s in dict.fromkeys(self.kv_slot(t) for t in range(self.loops - 1))
                     for i in range(len(self.end))]
        return ([("begin", i) for i in range(len(self.begin))]
                + [("middle", i, loop) for loop in loops for i in range(len(self.middle))]
                + [("end", i) for i in range(len(self.end))] + reads)

    def exit_readout(self, h_BTD: torch.Tensor, ctx: ForwardContext, t: int) -> torch.Tensor:
        """The end block after pass t, over the positions still running (Huginn §6.1 reads
        its exit distributions through the coda); slots ("read", i, kv_slot(t))."""
        return self.run(self.end, h_BTD, ctx, "read", self.kv_slot(t))

    def forward(self, x_BTD: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x_BTD = self.run(self.begin, x_BTD, ctx, "begin")
        mon = monitor(self, x_BTD, ctx, self.loops)  # early exit per position (early_exit.py)
        for loop in range(self.loops):
            if mon is not None and mon.finished:
                break
            if mon is not None and mon.idle:  # the pass only fills its keys/values
                x_BTD = mon.idle_pass(x_BTD, self.middle_slots(loop))
                continue
            y_BTD = self.run(self.middle, x_BTD, ctx if mon is None else mon.ctx, "middle", self.kv_slot(loop), mon)
            x_BTD = y_BTD if mon is None else mon.step(x_BTD, y_BTD)
        return self.run(self.end, x_BTD, ctx, "end")

    def middle_slots(self, loop: int) -> list:
        """(layer, KV slot) of each middle layer at pass ``loop``."""
        return [(layer, ("middle", i, self.kv_slot(loop))) for i, layer in enumerate(self.middle)]


class Hyperloop(Looped):
    """Looped + n streams: copy after the begin block, one hyper-connection per loop
    (``hc[l]``, its own W, b, alpha, e_l) around the whole middle block, average before
    the end block (Hyperloop §3). ``hc_per_layer``: one per (loop, middle layer) instead,
    index l * m + i. ``hc_transition='pooled_mlp'``: the review's variant per loop.

    Depth at inference (``set_depth(n)``): pass l uses loop l's parameters (hc[l], its loop
    embedding e_l), so n <= n_loops runs the first n loops' parameters; n > n_loops has no
    trained parameters for the extra passes and is refused unless ``extend="last"``, which
    reuses the last trained loop's parameters for every pass beyond it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.n_streams, self.per_layer = cfg.n_streams, cfg.hc_per_layer
        if cfg.hc_transition == "pooled_mlp":
            self.hc = nn.ModuleList(PooledMLPTransition(cfg) for _ in range(self.n_loops))
        else:
            n_hc = self.n_loops * (len(self.middle) if self.per_layer else 1)
            self.hc = nn.ModuleList(HyperConnection(cfg, loop_embedding=True, residual_f=True)
                                    for _ in range(n_hc))
        self.pooled = cfg.hc_transition == "pooled_mlp"

    def set_depth(self, n: int, extend: str | None = None) -> None:
        prev = self.loops
        super().set_depth(n, extend)  # checks n and extend first
        if n > self.n_loops and extend is None:
            self.loops = prev
            raise ConfigError(f"depth {n} exceeds the {self.n_loops} trained loops of this Hyperloop, "
                              "whose loops have their own parameters; use extend='last' "
                              "(--extend-loops last) to reuse the last loop's for the extra passes")

    def _param_loop(self, loop: int) -> int:
        """The trained loop whose parameters pass ``loop`` uses (extend='last' beyond them)."""
        return min(loop, self.n_loops - 1)

    def compile_targets(self) -> list:  # the blocks, and each loop's coefficient maths
        return super().compile_targets() + [(hc, "coefficients") for hc in self.hc
                                             if isinstance(hc, HyperConnection)]

    def stream_sites(self) -> list[nn.Module]:
        """The begin blocks, each loop's hyper-connection (its output: the n streams) and
        the end blocks; a middle block's own output is F of the mixed read, not the stream."""
        return [*self.begin, *self.hc, *self.end]

    def mixing_sites(self) -> list[nn.Module]:
        return [hc for hc in self.hc if isinstance(hc, HyperConnection)]

    def cache_slots(self) -> list:  # the pooled-MLP variant caches its running sums per loop
        return super().cache_slots() + ([("pool", loop) for loop in range(self.loops)] if self.pooled else [])

    def forward(self, x_BTD: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x_BTD = self.run(self.begin, x_BTD, ctx, "begin")
        streams_BTnD = copy_streams(x_BTD, self.n_streams)
        mon = monitor(self, streams_BTnD, ctx, self.loops, merge_streams)  # early exit (early_exit.py)
        m = len(self.middle)
        for loop in range(self.loops):
            if mon is not None and mon.finished:
                break
            p, s, c = self._param_loop(loop), self.kv_slot(loop), ctx if mon is None else mon.ctx
            before = streams_BTnD
            if mon is not None and mon.idle and not self.pooled:  # the layers only copy keys/values
                # (the pooled variant's running sums still take the frozen streams)
                streams_BTnD = mon.idle_pass(before, self.middle_slots(loop))
                continue
            if self.per_layer:  # an exited position's streams stay frozen through the pass
                for i, layer in enumerate(self.middle):
                    streams_BTnD = self.hc[p * m + i](
                        streams_BTnD, lambda h, layer=layer, i=i, s=s, c=c: layer(h, c, slot=("middle", i, s)))
                    streams_BTnD = streams_BTnD if mon is None else mon.hold(before, streams_BTnD)
            else:
                streams_BTnD = self.hc[p](
                    streams_BTnD, lambda h, s=s, c=c: self.run(self.middle, h, c, "middle", s, mon),
                    c, ("pool", loop))
            streams_BTnD = streams_BTnD if mon is None else mon.step(before, streams_BTnD)
        return self.run(self.end, merge_streams(streams_BTnD), ctx, "end")


class MHC(Trunk):
    """Plain stack with a manifold-constrained hyper-connection on every sub-layer (mHC
    §3): x <- H_res x + H_post^T F(H_pre x) with F = attention or FFN *branch* (the
    block's own residual replaced by H_res). ``hc[2i]`` wraps attention of layer i,
    ``hc[2i+1]`` its FFN; a 3PT rotation between them acts on every stream."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg, i, cfg.n_layers) for i in range(cfg.n_layers))
        self.hc = nn.ModuleList(HyperConnection(cfg, loop_embedding=False, residual_f=False)
                                for _ in range(2 * cfg.n_layers))
        self.n_streams = cfg.n_streams
        self.depth = cfg.n_layers

    def cache_slots(self) -> list:
        return list(range(len(self.layers)))

    def compile_targets(self) -> list:  # mHC calls the blocks' branches, not their forward
        out = [(b, f) for b in self.layers for f in ("attn_branch", "ffn_branch")]
        out += [(b.between, "forward") for b in self.layers if not isinstance(b.between, nn.Identity)]
        return out + [(hc, "coefficients") for hc in self.hc]

    def stream_sites(self) -> list[nn.Module]:
        """The hyper-connection of each sub-layer (its output: the n streams); the blocks'
        own forward never runs here."""
        return list(self.hc)

    def mixing_sites(self) -> list[nn.Module]:
        return list(self.hc)

    def forward(self, x_BTD: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        streams_BTnD = copy_streams(x_BTD, self.n_streams)
        for i, blk in enumerate(self.layers):
            streams_BTnD = self.hc[2 * i](streams_BTnD, lambda h, blk=blk, i=i: blk.attn_branch(h, ctx, i))
            streams_BTnD = blk.between(streams_BTnD)
            streams_BTnD = self.hc[2 * i + 1](streams_BTnD, blk.ffn_branch)
        return merge_streams(streams_BTnD)


# ---------------------------------------------------------------------------- presets
# The paper's three scales (Hyperloop §4, its table of results): Llama-style layers, SwiGLU
# d_ff = 2.75 d, 16-head MHA, RoPE base 10000, untied output layer, L = 3 loops, n = 4
# streams. Ours (the paper does not say): vocab 32000 (the value its parameter counts pin
# down, docs/hyperloop.md), context 2048, no sqrt(d) embedding scale, init std 0.02.
# Names: the paper's parameter count of each model (it leaves out the input embedding) in
# whole millions, truncated, so that a looped model and its hyperloop twin share a name.
def _paper_scale(d: int, split: tuple[int, int, int], names: tuple[str, str, str]) -> dict:
    b, m, e = split
    loops = dict(paper_scales.base(d), n_layers=b + m + e, n_begin=b, n_end=e, n_loops=paper_scales.LOOPS)
    _, mhc, looped = names
    return {f"mhc-{mhc}": dict(paper_scales.base(d), arch="mhc", n_layers=paper_scales.stack_depth(split)),
            f"looped-{looped}": dict(loops, arch="looped"),
            f"hyperloop-{looped}": dict(loops, arch="hyperloop")}


_PAPER_PRESETS = {k: v for d, split, names in paper_scales.SCALES for k, v in _paper_scale(d, split, names).items()}
_SMALL, _TINY = paper_scales.SMALL, paper_scales.TINY
_PRESETS = {  # the Transformer's are rope.py's
    **_PAPER_PRESETS,
    **{f"{a}-240m": _PAPER_PRESETS[f"{a}-{paper_scales.ALIAS_240M[a]}"] for a in ("mhc", "looped", "hyperloop")},
    "mhc-small": dict(_SMALL, arch="mhc", n_layers=8),
    "looped-small": dict(_SMALL, arch="looped", n_layers=4, n_begin=1, n_end=1, n_loops=3),
    "hyperloop-small": dict(_SMALL, arch="hyperloop", n_layers=4, n_begin=1, n_end=1, n_loops=3),
    "mhc-tiny": dict(_TINY, arch="mhc", n_layers=2),
    "looped-tiny": dict(_TINY, arch="looped", n_layers=4, n_begin=1, n_end=1, n_loops=2),
    "hyperloop-tiny": dict(_TINY, arch="hyperloop", n_layers=4, n_begin=1, n_end=1, n_loops=2),
}
_PAPER = "Zeitoun, Torroba-Hennigen, Kim, Hyperloop Transformers, arXiv 2604.21254 (2026)"
_LOOPED_LAYERS = ("unique layers n_begin + middle + n_end (the depth is n_begin + middle x n_loops "
                  "+ n_end; n_begin, n_end default to n_unique_layers // 4)")


@torch.no_grad()
def _diagnostics(model: nn.Module, stats: dict) -> dict[str, float]:
    """Per loop l (and middle layer i with hc_per_layer), the mean of each coefficient of
    hc[l] at a zero stream, i.e. of its token-independent part, logits b (H_pre, H_post,
    the diagonal of H_res), and its alphas (pre, post, res) when dynamic (Hyperloop §3)."""
    trunk = getattr(model, "trunk", None)
    if not isinstance(trunk, Hyperloop) or trunk.pooled:
        return {}
    out, m = {}, len(trunk.middle)
    for j, hc in enumerate(trunk.hc):
        pre, post, res = hc.from_logits(hc.b.detach().float())
        name = f"hyperloop/loop{j // m}/layer{j % m}" if trunk.per_layer else f"hyperloop/loop{j}"
        out[f"{name}/pre_mean"], out[f"{name}/post_mean"] = pre.mean().item(), post.mean().item()
        if res is not None:
            out[f"{name}/res_diag_mean"] = (res if res.dim() == 1 else res.diagonal()).mean().item()
        if hc.alpha is not None:
            out.update({f"{name}/alpha_{k}": a for k, a in zip(("pre", "post", "res"), hc.alpha.tolist())})
    return out


def _shrink_looped(cfg: ModelConfig) -> dict:
    return dict(n_layers=3, n_begin=1, n_end=1, n_loops=min(cfg.n_loops, 2))


register_arch(ArchSpec(name="looped", trunk=Looped, options=(LoopOptions,), layers=_LOOPED_LAYERS,
                       layers_name="n_unique_layers",
                       paper=_PAPER + " (its baseline)", shrink=_shrink_looped))
register_arch(ArchSpec(name="hyperloop", trunk=Hyperloop,
                       options=(LoopOptions, HCOptions, HyperloopOptions), layers=_LOOPED_LAYERS,
                       layers_name="n_unique_layers",
                       paper=_PAPER, shrink=_shrink_looped, diagnostics=_diagnostics))
register_arch(ArchSpec(name="mhc", trunk=MHC, options=(HCOptions,), defaults={"hc_res": "sinkhorn"},
                       paper="Xie et al., mHC, arXiv 2512.24880; Zhu et al., Hyper-Connections, ICLR 2025"))
register_presets(_PRESETS)  # one table (each names its arch): the paper's four models per scale
