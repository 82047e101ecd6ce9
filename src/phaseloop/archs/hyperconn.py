"""Hyper-connections: n residual streams mixed per token (Zhu et al., "Hyper-Connections",
ICLR 2025 §2.2; Xie et al., "mHC", arXiv 2512.24880 §3; Zeitoun et al., "Hyperloop
Transformers", arXiv 2604.21254 §3). Shared by the ``Hyperloop`` and ``MHC`` trunks
(hyperloop.py).

Everything here is plain torch ops, on every device, under bf16 autocast and under
``torch.compile`` (``fullgraph=True``). Hand-written kernels for this maths were measured
against compiling it and removed (docs/hyperloop.md: they beat compile by at most 7 % at
d 512). Streams are [B, T, n, D] tensors and stay in the residual's dtype
under autocast: the read and a diagonal H_res are elementwise products, and the full
n x n mix of a Sinkhorn H_res runs with autocast off.

Initialisation (ours; the papers give none), set so that each model starts next to its
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

Static coefficients (``hc_dynamic=False``, the Hyperloop paper's ablation "w/o dynamic
transition (static T)"): no W and no alpha, H_pre / H_post / H_res are functions of each
connection's (each loop's) own b only. b then starts at the biases above plus N(0, init_std)
noise (ours): identical streams under stream-symmetric coefficients get identical gradients
and would stay identical for ever, so the dynamic model's W is what breaks the symmetry,
and without W the noise on b has to.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from phaseloop.config import ModelConfig
from phaseloop.errors import ConfigError
from phaseloop.layers import ForwardContext, compute_dtype
from phaseloop.trunk import DerivedBuffers

HYPERLOOP_RES_INIT = 0.01  # diagonal H_res at init when F keeps its own residual
MHC_RES_INIT = 0.99  # diagonal H_res at init when F is a residual branch
SINKHORN_DIAG_INIT = 1.0  # b_res = I before Sinkhorn: 0.48 on the diagonal; a sharper
# start (4 I: 0.95) leaves 20 iterations short of convergence (row sums off by 1e-4)


def sinkhorn(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """Project [..., n, n] onto (nearly) doubly stochastic matrices: exp(.) then alternate
    row and column normalisation (Sinkhorn-Knopp; mHC §3 uses 20 iterations). The last
    step normalises columns, so columns sum to 1 exactly and rows to within the residual.
    Differentiated through the unrolled iterations; bf16 logits are promoted to fp32."""
    L = logits if logits.dtype == torch.float64 else logits.float()
    P = torch.exp(L - L.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        P = P / P.sum(dim=-1, keepdim=True)  # rows
        P = P / P.sum(dim=-2, keepdim=True)  # columns
    return P


def stream_product(A: torch.Tensor, Z: torch.Tensor) -> torch.Tensor:
    """A @ Z per token ([..., r, c] x [..., c, D]) in Z's dtype: with autocast off, so the
    streams stay fp32 under bf16 autocast, as the residual stream they replace. (The meta
    device, where params.count_params traces, has no autocast to switch off.)"""
    if not torch.amp.is_autocast_available(Z.device.type):
        return A.to(Z.dtype) @ Z
    with torch.autocast(Z.device.type, enabled=False):
        return A.to(Z.dtype) @ Z


def copy_streams(x_BTD: torch.Tensor, n: int) -> torch.Tensor:
    """X in R^{T x C} -> Y^(0) in R^{T x n x C}: n copies (Hyperloop §3)."""
    return x_BTD.unsqueeze(2).expand(-1, -1, n, -1)


def merge_streams(streams_BTnD: torch.Tensor) -> torch.Tensor:
    """Average of the streams, fed to the end block (Hyperloop §3)."""
    return streams_BTnD.mean(dim=2)


class HyperConnection(DerivedBuffers, nn.Module):
    """One dynamic hyper-connection, per token:

        z      = RMSNorm(flatten(y))                         (n*D, no gain)
        H_pre  = sigmoid(a_pre * W_pre z + b_pre)            [n]
        H_post = 2 sigmoid(a_post * W_post z + b_post)       [n]
        H_res  = diag(sigmoid(a_res * W_res z + b_res))      [n x n]  (hc_res=diagonal)
               | Sinkhorn(a_res * W_res z + b_res)                    (hc_res=sinkhorn)
               | I                                                    (hc_res=identity)
        y     <- H_res y + H_post (x) (F(H_pre . y) + e)  =  [H_res | H_post] @ [y; F + e]

    W_pre, W_post, W_res are rows of one matrix ``W`` (one matmul); ``e`` is the loop
    embedding e_l (hyperloop only). ``residual_f``: F keeps its own residual (hyperloop),
    which sets the diagonal H_res init (see the module docstring). ``cfg.hc_dynamic=False``
    drops the ``a * W z`` terms (and W, alpha): the coefficients are sigmoid(b) etc.
    """

    def __init__(self, cfg: ModelConfig, loop_embedding: bool, residual_f: bool):
        super().__init__()
        n, D = cfg.n_streams, cfg.d_model
        self.n, self.form, self.iters = n, cfg.hc_res_form, cfg.sinkhorn_iters
        self.eps = cfg.norm_eps
        n_res = {"diagonal": n, "sinkhorn": n * n, "identity": 0}[self.form]
        self.dynamic = cfg.hc_dynamic
        # rows of W and entries of b: [pre (n) | post (n) | res (n, n*n or 0)]
        if self.dynamic:
            self.W = nn.Parameter(torch.randn(2 * n + n_res, n * D) * cfg.init_std)
            self.alpha = nn.Parameter(torch.full((3,), float(cfg.hc_alpha_init)))  # pre, post, res
        else:
            self.register_parameter("W", None)
            self.register_parameter("alpha", None)
        b_pre = torch.full((n,), -math.log(n - 1))  # sigmoid -> 1/n: the read is the mean
        b_post = torch.zeros(n)  # 2 sigmoid -> 1
        if self.form == "diagonal":
            keep = HYPERLOOP_RES_INIT if residual_f else MHC_RES_INIT
            b_res = torch.full((n,), math.log(keep / (1 - keep)))
        else:  # sinkhorn: b_res = I (leans to the diagonal); identity: nothing
            b_res = (SINKHORN_DIAG_INIT * torch.eye(n)).flatten()[:n_res]
        b = torch.cat([b_pre, b_post, b_res])
        if not self.dynamic:  # break the symmetry between the streams (module docstring)
            b = b + torch.randn(b.shape) * cfg.init_std
        self.b = nn.Parameter(b)
        self.register_buffer("alpha_idx", torch.tensor([0] * n + [1] * n + [2] * n_res),
                             persistent=False)
        self.e = nn.Parameter(torch.zeros(D)) if loop_embedding else None

    def reset_buffers(self) -> None:
        """Recompute the derived buffer (a model loaded onto the meta device first)."""
        n, n_res = self.n, len(self.alpha_idx) - 2 * self.n
        self.alpha_idx.copy_(torch.tensor([0] * n + [1] * n + [2] * n_res))

    def coefficients(self, y_BTnD: torch.Tensor):
        """-> H_pre [B,T,n], H_post [B,T,n], H_res: its diagonal [B,T,n] (hc_res=diagonal),
        the matrix [B,T,n,n] (sinkhorn) or None (identity)."""
        n, D = self.n, y_BTnD.shape[-1]
        if self.dynamic:
            z_BTm = F.rms_norm(y_BTnD.flatten(-2), (n * D,), eps=self.eps)
            logits_BTk = self.b + self.alpha[self.alpha_idx] * (z_BTm @ self.W.t())
        else:  # static T: the same coefficients at every token
            logits_BTk = self.b.expand(*y_BTnD.shape[:-2], -1)
        return self.from_logits(logits_BTk)

    def from_logits(self, logits_BTk: torch.Tensor):
        """The coefficients of logits [..., 2n + n_res] (``coefficients``' last part)."""
        n = self.n
        pre_BTn = torch.sigmoid(logits_BTk[..., :n])
        post_BTn = 2 * torch.sigmoid(logits_BTk[..., n:2 * n])
        res = None
        if self.form == "diagonal":
            res = torch.sigmoid(logits_BTk[..., 2 * n:])
        elif self.form == "sinkhorn":
            res = sinkhorn(logits_BTk[..., 2 * n:].unflatten(-1, (n, n)), self.iters)
        return pre_BTn, post_BTn, res

    def forward(self, y_BTnD: torch.Tensor, fn, ctx=None, slot=None) -> torch.Tensor:
        """y <- [H_res | H_post] @ [y; fn(H_pre . y) + e]; ``fn`` is the wrapped block or branch."""
        pre_BTn, post_BTn, res = self.coefficients(y_BTnD)
        x_BTD = (pre_BTn.unsqueeze(-1) * y_BTnD).sum(-2)  # H_pre . y
        f_BTD = fn(x_BTD)
        if self.e is not None:
            f_BTD = f_BTD + self.e
        if res is None:  # identity
            kept_BTnD = y_BTnD
        elif res.dim() == 3:  # diagonal
            kept_BTnD = res.unsqueeze(-1) * y_BTnD
        else:  # Sinkhorn: a full n x n mix per token
            kept_BTnD = stream_product(res, y_BTnD)
        return kept_BTnD + post_BTn.unsqueeze(-1) * f_BTD.unsqueeze(-2)


class RunningSums:
    """``PooledMLPTransition``'s KV-cache entry: the running sum of the streams [B, P, n*D]
    at each cached position start .. start + P - 1. Every position's sum is kept, not only
    the last, so that the entry rolls back with the cache (``truncate``: speculative
    decoding drops rejected drafts); a decode step appends its own chunk."""

    def __init__(self, start: int, sums_BPm: torch.Tensor):
        # count: positions summed so far (the running mean's denominator before the next one)
        self.start, self.chunks, self.count = start, [sums_BPm], sums_BPm.shape[1]

    @property
    def last_B1m(self) -> torch.Tensor:
        return self.chunks[-1][:, -1:]

    def append(self, sums_BTm: torch.Tensor) -> None:
        self.chunks.append(sums_BTm)
        self.count += sums_BTm.shape[1]

    def truncate(self, n: int) -> RunningSums | None:
        """Only the positions < n (None: none left)."""
        keep = n - self.start
        return None if keep <= 0 else RunningSums(self.start, torch.cat(self.chunks, 1)[:, :keep])

    def select_rows(self, idx_R: torch.Tensor) -> RunningSums:
        return RunningSums(self.start, torch.cat(self.chunks, 1).index_select(0, idx_R))

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


class PooledMLPTransition(nn.Module):
    """The review's description of Hyperloop (not the paper's method), kept as a variant:

        X <- T(X) * X + F(mean_n X),   T = MLP(RMSNorm(pool(X))) reshaped to n x D,

    where pool is a *causal* running mean over positions <= t (a global average pool
    would let every token see the future). The review leaves open how F reads n streams;
    we read their mean, as the hyperloop does at init. Under a KV cache the running sums
    are kept in ``cache.entries[slot]`` (``RunningSums``, one per cached position, so the
    cache rolls back for speculative decoding).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, D = cfg.n_streams, cfg.d_model
        self.n, self.eps = n, cfg.norm_eps
        hidden = max(16, D // 16)
        self.mlp = nn.Sequential(nn.Linear(n * D, hidden), nn.GELU(), nn.Linear(hidden, n * D))

    def check_training(self, tc) -> None:
        """What training this module cannot do, refused before a run folder is written
        (``Trainer.setup`` asks every module of the model that has this method)."""
        if tc.doc_mask:
            raise ConfigError(self.ACROSS_DOCUMENTS)

    ACROSS_DOCUMENTS = ("hc_transition='pooled_mlp' pools over every earlier position of the window, across "
                        "documents; drop --doc-mask or use the paper's hyper-connections (hc_transition='hc')")

    def forward(self, streams_BTnD: torch.Tensor, fn, ctx: ForwardContext | None = None,
                slot=None) -> torch.Tensor:
        B, T, n, D = streams_BTnD.shape
        if ctx is not None and ctx.doc_ids is not None:
            raise ConfigError(self.ACROSS_DOCUMENTS)
        # running sum in fp32 at least (float64 for a float64 model, so that cached = full)
        sum_BTm = streams_BTnD.flatten(-2).to(compute_dtype(streams_BTnD.dtype)).cumsum(dim=1)
        past = 0
        cache = ctx.cache if ctx is not None else None
        if cache is not None and cache.static:
            raise ConfigError("hc_transition='pooled_mlp' keeps running sums per loop in its cache, which a "
                              "static cache (export) has no buffer for; export the paper's hc_transition='hc'")
        if cache is not None:
            sums = cache.entries.get(slot)
            if sums is None:
                cache.entries[slot] = RunningSums(ctx.start_pos, sum_BTm.detach())
            else:
                sum_BTm, past = sum_BTm + sums.last_B1m, sums.count
                sums.append(sum_BTm.detach())
        count_T1 = torch.arange(past + 1, past + T + 1, device=sum_BTm.device,
                                dtype=sum_BTm.dtype)[:, None]
        pooled_BTm = (sum_BTm / count_T1).to(streams_BTnD.dtype)
        gate_BTnD = self.mlp(F.rms_norm(pooled_BTm, (n * D,), eps=self.eps)).unflatten(-1, (n, D))
        f_BTD = fn(merge_streams(streams_BTnD))
        return gate_BTnD * streams_BTnD + f_BTD.unsqueeze(2)
