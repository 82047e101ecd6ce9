"""Looped, Hyperloop and mHC trunks: what is new about them.

* ``Looped`` — begin block -> middle block applied L times with shared weights -> end
  block (Zeitoun, Torroba-Hennigen, Kim, "Hyperloop Transformers", arXiv 2604.21254, §2).
* ``Hyperloop`` — looped + n residual streams mixed by hyper-connections once after each
  loop (ibid. §3); options: H_res diagonal / Sinkhorn / identity, connections after every
  middle layer, and the review's pooled-MLP transition (``PooledMLPTransition``).
* ``MHC`` — a plain stack with manifold-constrained hyper-connections on every sub-layer
  (Xie et al., "mHC", arXiv 2512.24880; Zhu et al., "Hyper-Connections", ICLR 2025).

Every trunk is built from ``layers.Block``; the stream maths lives in ``HyperConnection``
and is vectorised over streams ([B, T, n, D] tensors). Its stream-sized products have
hand-written backwards (``_ProjSq``, ``_Mix``, ``_OneCopy``, ``_Sinkhorn``; gradchecked in
the tests) that make fewer passes over [B, T, n, D] than autograd's graph of broadcasts.
On CPU the read, the mix and Sinkhorn run in fused kernels instead (``kernels``: one pass
per token, the three readers of y sharing one gradient buffer); both paths are tested
equal.

Initialisation (ours; the paper gives none), set so that each model starts next to its
stream-free twin: alpha = ``hc_alpha_init`` (0.01), W ~ N(0, init_std) (breaks the
symmetry between streams), e_l = 0, H_pre = 1/n (b_pre = -ln(n-1): the read is the mean
of the streams), H_post = 1 (b_post = 0). Diagonal H_res = 0.01 in a hyperloop (its F is
the whole middle block *with* its residuals, so keeping the old stream would double it)
and 0.99 in mHC (F is a residual branch); Sinkhorn H_res starts from b_res = I.
With the dynamic part off (alpha = 0) the streams stay identical and
  hyperloop, diagonal:          y <- 0.01 y + F(y)        (b_res = -inf gives looped exactly)
  hyperloop, sinkhorn/identity: y <- y + F(y)             (rows of H_res sum to 1)
  mHC, sinkhorn/identity:       y <- y + F(y)             (exactly the pre-norm Transformer)
(tests/test_hyperloop.py checks each relation).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .config import ModelConfig, register_presets
from .layers import Block, Context

HYPERLOOP_RES_INIT = 0.01  # diagonal H_res at init when F keeps its own residual
MHC_RES_INIT = 0.99  # diagonal H_res at init when F is a residual branch
SINKHORN_DIAG_INIT = 1.0  # b_res = I before Sinkhorn: 0.48 on the diagonal; a sharper
# start (4 I: 0.95) leaves 20 iterations short of convergence (row sums off by 1e-4)


# ---------------------------------------------------------------------------- Sinkhorn
def sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """Project [..., n, n] onto (nearly) doubly stochastic matrices: exp(.) then alternate
    row and column normalisation (Sinkhorn-Knopp; mHC §3 uses 20 iterations). The last
    step normalises columns, so columns sum to 1 exactly and rows to within the residual.
    Differentiated through the unrolled iterations (``_Sinkhorn`` writes the backward;
    the fused kernel, ``kernels.Sinkhorn``, recomputes them per token)."""
    L = logits if logits.dtype == torch.float64 else logits.float()  # bf16 -> fp32
    if kernels.enabled(L):
        n, m = L.shape[-2:]
        return kernels.Sinkhorn.apply(L.reshape(-1, n, m), iters).view(L.shape).to(logits.dtype)
    return _Sinkhorn.apply(L, iters).to(logits.dtype)


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn with a hand-written backward of the unrolled iterations: for each step
    P' = P / s, s = sum(P) along a dim, dL/dP = (g - sum(g * P')) / s. Fewer ops than
    autograd's graph of 2 x iters divisions; same gradient (gradcheck in the tests).
    Works on the token-last layout [n, n, N]: the row and column sums then reduce over
    outer dims (vectorised over tokens) instead of over an inner dim of size n."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int) -> torch.Tensor:
        lead, (n, m) = logits.shape[:-2], logits.shape[-2:]
        L_nmN = logits.reshape(-1, n, m).permute(1, 2, 0).contiguous()
        P = torch.exp(L_nmN - L_nmN.amax(dim=(0, 1), keepdim=True))
        saved = [P]  # P_0, then (sum, P) per half step
        for _ in range(iters):
            for dim in (1, 0):  # rows, then columns
                s = P.sum(dim=dim, keepdim=True)
                P = P / s
                saved += [s, P]
        ctx.save_for_backward(*saved)
        return P.permute(2, 0, 1).reshape(*lead, n, m)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        saved = ctx.saved_tensors
        lead, (n, m) = g.shape[:-2], g.shape[-2:]
        g = g.reshape(-1, n, m).permute(1, 2, 0).contiguous()
        for k in range(len(saved) - 2, 0, -2):
            s, out = saved[k], saved[k + 1]
            dim = 1 if s.shape[1] == 1 else 0
            g = (g - (g * out).sum(dim=dim, keepdim=True)) / s
        g = g * saved[0]  # d exp(x - max)/dx; the max shift has zero net effect
        return g.permute(2, 0, 1).reshape(*lead, n, m), None


# ---------------------------------------------------------------------------- streams
def copy_streams(x_BTD: torch.Tensor, n: int) -> torch.Tensor:
    """X in R^{T x C} -> Y^(0) in R^{T x n x C}: n copies (Hyperloop §3)."""
    return x_BTD.unsqueeze(2).expand(-1, -1, n, -1)


def _copies(streams_BTnD: torch.Tensor) -> bool:
    """True for the stride-0 view ``copy_streams`` returns: n copies of one tensor."""
    return streams_BTnD.stride(2) == 0


def merge_streams(streams_BTnD: torch.Tensor) -> torch.Tensor:
    """Average of the streams, fed to the end block (Hyperloop §3)."""
    return streams_BTnD.mean(dim=2)


class _ProjSq(torch.autograd.Function):
    """(y W^T, sum(y^2)) over the last dim of y [..., m], W [k, m], with one fused input
    gradient dy = g_p W + 2 g_s y (a scaled copy and one in-place matmul, instead of the
    norm's backward, the matmul's and their sum). With ``buf`` (``kernels.StreamGrad``)
    the other readers' gradient of y already in ``buf.dy`` is added to in place."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, W: torch.Tensor, buf=None):
        ctx.save_for_backward(y, W)
        ctx.buf = buf
        ss = torch.linalg.vector_norm(y, dim=-1, keepdim=True).square()
        return y @ W.t(), ss

    @staticmethod
    def backward(ctx, g_p: torch.Tensor, g_s: torch.Tensor):
        y, W = ctx.saved_tensors
        dt = torch.promote_types(y.dtype, W.dtype)  # under autocast g_p may be bf16
        y, W, g_p, g_s = y.to(dt), W.to(dt), g_p.to(dt), g_s.to(dt)
        y_Nm, g_Nk = y.reshape(-1, y.shape[-1]), g_p.reshape(-1, W.shape[0])
        two_gs = (2 * g_s).reshape(-1, 1)
        acc = None if ctx.buf is None else ctx.buf.dy
        if acc is None:
            dy = y_Nm * two_gs
        else:
            ctx.buf.dy = None
            dy = acc.view(y_Nm.shape).addcmul_(y_Nm, two_gs)
        dy.addmm_(g_Nk, W)
        return dy.view(y.shape), g_Nk.t() @ y_Nm, None


class _OneCopy(torch.autograd.Function):
    """x from the stride-0 view ``copy_streams(x, n)`` ([..., n, D] -> [..., D]). Its
    backward hands each copy 1/n of the gradient, a stride-0 view again, which the
    expand's backward sums back to exactly the gradient of x; ``streams[..., 0, :]``
    would give the same sum through an n-times larger zero-filled gradient."""

    @staticmethod
    def forward(ctx, streams: torch.Tensor) -> torch.Tensor:
        ctx.n = streams.shape[-2]
        return streams.select(-2, 0).clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return (g / ctx.n).unsqueeze(-2).expand(*g.shape[:-1], ctx.n, g.shape[-1])


class _Mix(torch.autograd.Function):
    """out = A @ [y; f] per token, A = [H_res | H_post] ([..., n, m+1]), y [..., m, D]
    (m = n, or m = 1 for one copy), f [..., D]: one batched product forward and two
    backward (dA = g [y; f]^T, d[y; f] = A^T g, with A^T made contiguous: the
    transposed operand is ~2x slower)."""

    @staticmethod
    def forward(ctx, A: torch.Tensor, y: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        Z = torch.cat([y, f.unsqueeze(-2)], dim=-2)
        ctx.save_for_backward(A, Z)
        dt = torch.promote_types(A.dtype, Z.dtype)
        dev = A.device.type
        if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
            with torch.autocast(dev, enabled=False):  # the streams stay in dt
                return A.to(dt) @ Z.to(dt)
        return A.to(dt) @ Z.to(dt)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        A, Z = ctx.saved_tensors
        dt = torch.promote_types(A.dtype, Z.dtype)  # under autocast g may be bf16
        A, Z, g = A.to(dt), Z.to(dt), g.to(dt)
        m = Z.shape[-2] - 1
        dA = g @ Z.transpose(-2, -1)
        dZ = A.transpose(-2, -1).contiguous() @ g
        return dA, dZ[..., :m, :], dZ[..., m, :]


def mix(A: torch.Tensor, y: torch.Tensor, f: torch.Tensor | None = None) -> torch.Tensor:
    """A @ [y; f] per token: A [..., r, c], y [..., m, D], f [..., D] (c = m + 1) or None
    (c = m) -> [..., r, D]. The fused kernel (``kernels.Rows``) where it runs, else torch
    ops (``_Mix``, or a batched product for the read H_pre . y)."""
    if kernels.enabled(*(t for t in (A, y, f) if t is not None)):
        (r, c), (m, D) = A.shape[-2:], y.shape[-2:]
        out = kernels.Rows.apply(A.reshape(-1, r, c), y.reshape(-1, m, D),
                                 None if f is None else f.reshape(-1, D))
        return out.view(*A.shape[:-2], r, D)
    if f is None:
        return A @ y
    return _Mix.apply(A, y, f)


class HyperConnection(nn.Module):
    """One dynamic hyper-connection (Zhu et al. 2025 §2.2; mHC §3; Hyperloop §3), per token:

        z      = RMSNorm(flatten(y))                         (n*D, no gain)
        H_pre  = sigmoid(a_pre * W_pre z + b_pre)            [n]
        H_post = 2 sigmoid(a_post * W_post z + b_post)       [n]
        H_res  = diag(sigmoid(a_res * W_res z + b_res))      [n x n]  (hc_res=diagonal)
               | Sinkhorn(a_res * W_res z + b_res)                    (hc_res=sinkhorn)
               | I                                                    (hc_res=identity)
        y     <- H_res y + H_post (x) (F(H_pre . y) + e)

    W_pre, W_post, W_res are rows of one matrix ``W`` (one matmul); ``e`` is the loop
    embedding e_l (hyperloop only). ``residual_f``: F keeps its own residual (hyperloop),
    which sets the diagonal H_res init (see the module docstring).
    """

    def __init__(self, cfg: ModelConfig, loop_embedding: bool, residual_f: bool):
        super().__init__()
        n, D = cfg.n_streams, cfg.d_model
        self.n, self.form, self.iters = n, cfg.hc_res_form, cfg.sinkhorn_iters
        self.eps = cfg.norm_eps
        n_res = {"diagonal": n, "sinkhorn": n * n, "identity": 0}[self.form]
        # rows of W and entries of b: [pre (n) | post (n) | res (n, n*n or 0)]
        self.W = nn.Parameter(torch.randn(2 * n + n_res, n * D) * cfg.init_std)
        self.alpha = nn.Parameter(torch.full((3,), float(cfg.hc_alpha_init)))  # pre, post, res
        b_pre = torch.full((n,), -math.log(n - 1))  # sigmoid -> 1/n: the read is the mean
        b_post = torch.zeros(n)  # 2 sigmoid -> 1
        if self.form == "diagonal":
            keep = HYPERLOOP_RES_INIT if residual_f else MHC_RES_INIT
            b_res = torch.full((n,), math.log(keep / (1 - keep)))
        else:  # sinkhorn: b_res = I (leans to the diagonal); identity: nothing
            b_res = (SINKHORN_DIAG_INIT * torch.eye(n)).flatten()[:n_res]
        self.b = nn.Parameter(torch.cat([b_pre, b_post, b_res]))
        self.register_buffer("alpha_idx", torch.tensor([0] * n + [1] * n + [2] * n_res),
                             persistent=False)
        self.e = nn.Parameter(torch.zeros(D)) if loop_embedding else None

    def coefficients(self, streams_BTnD: torch.Tensor, x_BTD: torch.Tensor | None = None,
                     buf: "kernels.StreamGrad | None" = None):
        """-> H_pre [B,T,n], H_post [B,T,n], H_res ([B,T,n] diagonal, [B,T,n,n] or None).
        alpha * W RMSNorm(y) + b is computed as b + (W y) * alpha / rms(y): one matmul,
        one norm reduction and one fused multiply-add over all coefficients.
        ``x_BTD``: the one copy when ``streams_BTnD`` is n copies of it (see forward);
        ``buf``: the fused path's shared gradient buffer for y (``kernels.StreamGrad``)."""
        n, D = self.n, streams_BTnD.shape[-1]
        if _copies(streams_BTnD):  # y = (x, ..., x): rms(y) = rms(x), W y = (sum_k W_k) x
            x_BTD = _OneCopy.apply(streams_BTnD) if x_BTD is None else x_BTD
            proj_BTk, ss_BT1 = _ProjSq.apply(x_BTD, self.W.unflatten(-1, (n, D)).sum(1))
            ms_BT1 = ss_BT1 / D
        else:
            y_Nm = streams_BTnD.reshape(-1, n * D)
            proj, ss = _ProjSq.apply(y_Nm, self.W, buf)
            lead = streams_BTnD.shape[:-2]
            proj_BTk, ss_BT1 = proj.view(*lead, -1), ss.view(*lead, 1)
            ms_BT1 = ss_BT1 / (n * D)
        scale_BTk = self.alpha[self.alpha_idx] * torch.rsqrt(ms_BT1 + self.eps)
        logits_BTk = torch.addcmul(self.b, proj_BTk, scale_BTk)
        if self.form == "sinkhorn":
            gates_BTk = torch.sigmoid(logits_BTk[..., :2 * n])
            res = sinkhorn(logits_BTk[..., 2 * n:].unflatten(-1, (n, n)), self.iters)
        else:
            gates_BTk = torch.sigmoid(logits_BTk)
            res = gates_BTk[..., 2 * n:] if self.form == "diagonal" else None
        return gates_BTk[..., :n], 2 * gates_BTk[..., n:2 * n], res

    def forward(self, streams_BTnD: torch.Tensor, fn, ctx: Context | None = None,
                slot=None) -> torch.Tensor:
        dt = streams_BTnD.dtype
        copies = _copies(streams_BTnD)
        x0_BTD = _OneCopy.apply(streams_BTnD) if copies else None
        # fused path: kernels for the read and the mix, one gradient buffer for y
        buf = kernels.StreamGrad() if not copies and kernels.enabled(streams_BTnD) else None
        pre_BTn, post_BTn, res = self.coefficients(streams_BTnD, x0_BTD, buf)
        pre_BTn, post_BTn = pre_BTn.to(dt), post_BTn.to(dt)
        B_T, (n, D) = streams_BTnD.shape[:-2], streams_BTnD.shape[-2:]
        if copies:  # every stream is x: work on one copy (same values, n x less traffic)
            x_BTD = pre_BTn.sum(-1, keepdim=True) * x0_BTD
        elif buf is not None:
            x_BTD = kernels.Rows.apply(pre_BTn.reshape(-1, 1, n), streams_BTnD.reshape(-1, n, D),
                                       None, buf).view(*B_T, D)
        else:
            x_BTD = mix(pre_BTn.unsqueeze(-2), streams_BTnD).squeeze(-2)  # H_pre . y
        f_BTD = fn(x_BTD)
        if self.e is not None:
            f_BTD = f_BTD + self.e
        # y <- [H_res | H_post] @ [y; f]: one batched [n, n+1] x [n+1, D] product per
        # token (and two in the backward) instead of n + 1 broadcast passes over [B,T,n,D]
        if copies:  # H_res (x, ..., x) = (row sums of H_res) (x) x: [keep | H_post] @ [x; f]
            keep_BTn = (torch.ones_like(post_BTn) if res is None
                        else res.to(dt) if res.dim() == 3 else res.to(dt).sum(-1))
            A_BTnm = torch.stack([keep_BTn, post_BTn], dim=-1)
            return mix(A_BTnm, x0_BTD.unsqueeze(-2), f_BTD)
        if res is None:
            res = torch.eye(self.n, dtype=dt, device=post_BTn.device).expand(
                *post_BTn.shape, self.n)
        elif res.dim() == 3:
            res = torch.diag_embed(res.to(dt))
        A_BTnm = torch.cat([res.to(dt), post_BTn.unsqueeze(-1)], dim=-1)
        if buf is not None and f_BTD.dtype == dt:
            return kernels.Rows.apply(A_BTnm.reshape(-1, n, n + 1), streams_BTnD.reshape(-1, n, D),
                                      f_BTD.reshape(-1, D), buf).view(*B_T, n, D)
        return mix(A_BTnm, streams_BTnD, f_BTD)


class PooledMLPTransition(nn.Module):
    """The review's description of Hyperloop (not the paper's method), kept as a variant:

        X <- T(X) * X + F(mean_n X),   T = MLP(RMSNorm(pool(X))) reshaped to n x D,

    where pool is a *causal* running mean over positions <= t (a global average pool
    would let every token see the future). The review leaves open how F reads n streams;
    we read their mean, as the hyperloop does at init. Under a KV cache the running sum
    and count are kept in ``cache.entries[slot]``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, D = cfg.n_streams, cfg.d_model
        self.n, self.eps = n, cfg.norm_eps
        hidden = max(16, D // 16)
        self.mlp = nn.Sequential(nn.Linear(n * D, hidden), nn.GELU(), nn.Linear(hidden, n * D))

    def forward(self, streams_BTnD: torch.Tensor, fn, ctx: Context | None = None,
                slot=None) -> torch.Tensor:
        B, T, n, D = streams_BTnD.shape
        sum_BTm = streams_BTnD.flatten(-2).float().cumsum(dim=1)
        past = 0
        cache = ctx.cache if ctx is not None else None
        if cache is not None:
            if slot in cache.entries:
                prev_B1m, past = cache.entries[slot]
                sum_BTm = sum_BTm + prev_B1m
            cache.entries[slot] = (sum_BTm[:, -1:].detach(), past + T)
        count_T1 = torch.arange(past + 1, past + T + 1, device=sum_BTm.device,
                                dtype=sum_BTm.dtype)[:, None]
        pooled_BTm = (sum_BTm / count_T1).to(streams_BTnD.dtype)
        gate_BTnD = self.mlp(F.rms_norm(pooled_BTm, (n * D,), eps=self.eps)).unflatten(-1, (n, D))
        f_BTD = fn(merge_streams(streams_BTnD))
        return gate_BTnD * streams_BTnD + f_BTD.unsqueeze(2)


# ---------------------------------------------------------------------------- trunks
class Looped(nn.Module):
    """begin (b layers) -> middle (m layers, applied L times, one set of weights) -> end
    (e layers) (Hyperloop §2). ``cfg.n_layers`` = b + m + e unique layers; the depth is
    b + m L + e. Pass l of middle layer i uses KV-cache slot ("mid", i, l)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        b, m, e = cfg.loop_split
        n = cfg.n_layers
        self.begin = nn.ModuleList(Block(cfg, i, n) for i in range(b))
        self.middle = nn.ModuleList(Block(cfg, b + i, n) for i in range(m))
        self.end = nn.ModuleList(Block(cfg, b + m + i, n) for i in range(e))
        self.n_loops = cfg.n_loops
        self.unique_layers = n
        self.depth = b + m * cfg.n_loops + e

    @staticmethod
    def run(layers: nn.ModuleList, x_BTD: torch.Tensor, ctx: Context, name: str,
            loop: int | None = None) -> torch.Tensor:
        for i, layer in enumerate(layers):
            x_BTD = layer(x_BTD, ctx, slot=(name, i) if loop is None else (name, i, loop))
        return x_BTD

    def forward(self, x_BTD: torch.Tensor, ctx: Context) -> torch.Tensor:
        x_BTD = self.run(self.begin, x_BTD, ctx, "begin")
        for loop in range(self.n_loops):
            x_BTD = self.run(self.middle, x_BTD, ctx, "mid", loop)
        return self.run(self.end, x_BTD, ctx, "end")


class Hyperloop(Looped):
    """Looped + n streams: copy after the begin block, one hyper-connection per loop
    (``hc[l]``, its own W, b, alpha, e_l) around the whole middle block, average before
    the end block (Hyperloop §3). ``hc_per_layer``: one per (loop, middle layer) instead,
    index l * m + i. ``hc_transition='pooled_mlp'``: the review's variant per loop."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.n_streams, self.per_layer = cfg.n_streams, cfg.hc_per_layer
        if cfg.hc_transition == "pooled_mlp":
            self.hc = nn.ModuleList(PooledMLPTransition(cfg) for _ in range(self.n_loops))
        else:
            n_hc = self.n_loops * (len(self.middle) if self.per_layer else 1)
            self.hc = nn.ModuleList(HyperConnection(cfg, loop_embedding=True, residual_f=True)
                                    for _ in range(n_hc))

    def forward(self, x_BTD: torch.Tensor, ctx: Context) -> torch.Tensor:
        x_BTD = self.run(self.begin, x_BTD, ctx, "begin")
        streams_BTnD = copy_streams(x_BTD, self.n_streams)
        m = len(self.middle)
        for loop in range(self.n_loops):
            if self.per_layer:
                for i, layer in enumerate(self.middle):
                    streams_BTnD = self.hc[loop * m + i](
                        streams_BTnD, lambda h: layer(h, ctx, slot=("mid", i, loop)))
            else:
                streams_BTnD = self.hc[loop](
                    streams_BTnD, lambda h: self.run(self.middle, h, ctx, "mid", loop),
                    ctx, ("pool", loop))
        return self.run(self.end, merge_streams(streams_BTnD), ctx, "end")


class MHC(nn.Module):
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
        self.depth = self.unique_layers = cfg.n_layers

    def forward(self, x_BTD: torch.Tensor, ctx: Context) -> torch.Tensor:
        streams_BTnD = copy_streams(x_BTD, self.n_streams)
        for i, blk in enumerate(self.layers):
            streams_BTnD = self.hc[2 * i](
                streams_BTnD, lambda h: blk.drop(blk.attn(blk.attn_norm(h), ctx, i)))
            streams_BTnD = blk.mid(streams_BTnD)
            streams_BTnD = self.hc[2 * i + 1](
                streams_BTnD, lambda h: blk.drop(blk.ffn(blk.ffn_norm(h))))
        return merge_streams(streams_BTnD)


# ---------------------------------------------------------------------------- presets
# The paper's first scale (Hyperloop §4): d 1024, depth 16, SwiGLU d_ff = 2.75 d, 16-head
# MHA, RoPE base 10000, vocab 32000, untied output, no sqrt(d) embedding scale, std 0.02.
_PAPER = dict(d_model=1024, n_heads=16, n_kv_heads=16, d_ff=2816, vocab_size=32000,
              max_seq_len=2048, rope_base=10000.0, tie_embeddings=False, embed_scale=False,
              embed_init_std=0.02, init_std=0.02)
# Byte-level CPU twins at matched depth 8 (looped: 1 -> 2 x 3 -> 1) and tiny test models.
_SMALL = dict(d_model=128, n_heads=4, n_kv_heads=4, d_ff=352, vocab_size=256, max_seq_len=128,
              embed_scale=False, tie_embeddings=False)
_TINY = dict(_SMALL, d_model=64, d_ff=176, max_seq_len=64)
register_presets({
    "transformer-240m": dict(_PAPER, arch="rope", n_layers=16),
    "mhc-240m": dict(_PAPER, arch="mhc", n_layers=16),
    "looped-240m": dict(_PAPER, arch="looped", n_layers=8, n_begin=2, n_end=2, n_loops=3),
    "hyperloop-240m": dict(_PAPER, arch="hyperloop", n_layers=8, n_begin=2, n_end=2, n_loops=3),
    "transformer-small": dict(_SMALL, arch="rope", n_layers=8),
    "mhc-small": dict(_SMALL, arch="mhc", n_layers=8),
    "looped-small": dict(_SMALL, arch="looped", n_layers=4, n_begin=1, n_end=1, n_loops=3),
    "hyperloop-small": dict(_SMALL, arch="hyperloop", n_layers=4, n_begin=1, n_end=1, n_loops=3),
    "transformer-tiny": dict(_TINY, arch="rope", n_layers=4),
    "mhc-tiny": dict(_TINY, arch="mhc", n_layers=2),
    "looped-tiny": dict(_TINY, arch="looped", n_layers=4, n_begin=1, n_end=1, n_loops=2),
    "hyperloop-tiny": dict(_TINY, arch="hyperloop", n_layers=4, n_begin=1, n_end=1, n_loops=2),
})
