"""Three-Phase Transformer (Abu Ayyash, arXiv 2604.14430, 2026): what is new about it.

The residual stream of width D is split into N contiguous stripes ("phases") of width
d_phase = D / N. This file holds the three new modules and registers each as an option
of the shared block / embedding (``layers.register_block_option``) under its config
switch, so any trunk (stack, looped, universal, mHC) can carry the phase structure:

* ``PhaseRotation``  — modification 2, between attention and FFN, not residual;
* ``PhaseRMSNorm``   — modification 3, replaces every norm;
* ``HornInjection``  — modification 5, DC channel set to r(t) = 1/(t+1) once on the
  embedding output.
Modification 1 (partition) is ``n_phases``; modification 4 (phase-aligned GQA) is a
config check; dropping the sqrt(d_model) embedding factor is ``embed_scale=False``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, register_presets
from .layers import compute_dtype, register_block_option


def phase_offsets(n_phases: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """[N]: the fixed offsets 2πi/N, computed in ``dtype``."""
    return 2 * math.pi * torch.arange(n_phases, dtype=dtype, device=device) / n_phases


class PhaseRotation(nn.Module):
    """Givens rotation of channel pairs (2k, 2k+1) of phase i by θ_k + 2πi/N (3PT §2.2).

    θ ∈ R^{d_phase/2} is learnable and shared by all phases; the offsets are fixed
    (learnable as an ablation). Init θ_k = (ℓ+1)π/(2L) for layer ℓ of L. One vectorised
    op over all phases (a complex product over [..., N·d_phase/2] channel pairs).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int, n_layers: int):
        super().__init__()
        self.n_phases, self.d_phase = cfg.n_phases, cfg.d_phase
        self.residual = cfg.residual_rotation
        self.layer_idx, self.n_layers = layer_idx, n_layers
        self.theta = nn.Parameter(torch.full((cfg.d_phase // 2,), self.init_angle(layer_idx, n_layers)))
        if cfg.learnable_offsets:  # default dtype: a model built in bf16 holds them in bf16
            self.offsets = nn.Parameter(phase_offsets(cfg.n_phases, torch.get_default_dtype()))
        else:  # the fp32 values, for inspection; forward rebuilds them in its compute dtype
            self.register_buffer("offsets", phase_offsets(cfg.n_phases, torch.float32), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the derived buffer (a model loaded onto the meta device first)."""
        if not isinstance(self.offsets, nn.Parameter):
            self.offsets.copy_(phase_offsets(self.n_phases, torch.float32))

    @staticmethod
    def init_angle(layer_idx: int, n_layers: int) -> float:
        return (layer_idx + 1) * math.pi / (2 * n_layers)

    def angles(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[N, d_phase/2]: θ_k + 2πi/N, in ``dtype`` (default: θ's compute dtype).

        Fixed offsets are built here in ``dtype`` (exact in float64, not float32 values
        widened; not rounded to bf16 when the weights are); learnable ones are cast."""
        dtype = dtype or compute_dtype(self.theta.dtype)
        if isinstance(self.offsets, nn.Parameter):
            offsets = self.offsets.to(dtype)
        else:
            offsets = phase_offsets(self.n_phases, dtype, self.theta.device)
        return self.theta.to(dtype)[None, :] + offsets[:, None]

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        # Pair (x0, x1) as the complex number x0 + i·x1: the Givens rotation R(a) is then a
        # product with e^{ia}, one fused kernel over all phases (2.5x cheaper than stacking).
        # float64 end to end for a float64 model; fp32 otherwise (polar and complex
        # products have no bf16/half kernels), cast back to the input's dtype.
        dtype = compute_dtype(torch.promote_types(x_BTD.dtype, self.theta.dtype))
        a_P = self.angles(dtype).flatten()  # [N * d_phase/2], phase-major like the channels
        rot_P = torch.polar(torch.ones_like(a_P), a_P)
        z_BTP = torch.view_as_complex(x_BTD.to(dtype).unflatten(-1, (-1, 2)).contiguous())
        y_BTD = torch.view_as_real(z_BTP * rot_P).flatten(-2).to(x_BTD.dtype)
        return x_BTD + y_BTD if self.residual else y_BTD


class PhaseRMSNorm(nn.Module):
    """N independent RMSNorms, one per stripe (3PT §2.3); D gains, init 1."""

    def __init__(self, dim: int, n_phases: int, eps: float = 1e-6):
        super().__init__()
        self.n_phases, self.eps = n_phases, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_NP = x.unflatten(-1, (self.n_phases, -1))
        y_NP = F.rms_norm(x_NP, (x_NP.shape[-1],), None, self.eps)
        return y_NP.flatten(-2) * self.weight


class HornInjection(nn.Module):
    """Gabriel's horn DC injection (3PT §2.5): x(t, j) += r(t) − mean_j x(t, :), with
    r(t) = 1/(t+1) at the token's true absolute position t (also under KV caching).

    Only the component along the all-ones direction changes. ``learnable_horn`` (ours)
    adds a learnable gain g: r(t) = g/(t+1), g init 1.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1)) if cfg.learnable_horn else None  # 1-D: FSDP2 shards no scalars

    def forward(self, x_BTD: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        T = x_BTD.shape[1]
        # positions in float64 for a float64 model, else fp32 (cast to the input's dtype)
        t = torch.arange(start_pos, start_pos + T, device=x_BTD.device,
                         dtype=compute_dtype(x_BTD.dtype))
        r_T = 1.0 / (t + 1.0)
        if self.gain is not None:
            r_T = r_T * self.gain
        dc_BT1 = r_T.to(x_BTD.dtype)[None, :, None] - x_BTD.mean(dim=-1, keepdim=True)
        return x_BTD + dc_BT1


def zero_sum_diagnostic(x_BTD: torch.Tensor, n_phases: int) -> float:
    """Σ_i mean(stripe i), averaged over batch and positions (the paper's plot). Right
    after injection this equals N·H_T/T (H_T the T-th harmonic number)."""
    return x_BTD.unflatten(-1, (n_phases, -1)).mean(-1).sum(-1).mean().item()


def angle_drift(model: nn.Module) -> list[dict]:
    """Per rotation layer: |θ_final − θ_init| (mean and max over pairs), the quantity whose
    U-shaped profile over depth the paper reports (largest in the first and last blocks)."""
    rows = []
    for name, mod in model.named_modules():
        if isinstance(mod, PhaseRotation):
            d = (mod.theta.detach().float() - mod.init_angle(mod.layer_idx, mod.n_layers)).abs()
            rows.append({"module": name, "layer": mod.layer_idx, "init": mod.init_angle(mod.layer_idx, mod.n_layers),
                         "mean_abs_drift": d.mean().item(), "max_abs_drift": d.max().item()})
    return rows


@torch.no_grad()
def zero_sum_profile(model: nn.Module, idx_BT: torch.Tensor) -> list[dict]:
    """The zero-sum diagnostic at the embedding output and after every trunk layer."""
    n = model.cfg.n_phases
    out: list[dict] = []
    hooks = [model.embed.register_forward_hook(
        lambda m, i, o: out.append({"site": "embedding", "zero_sum": zero_sum_diagnostic(o, n)}))]
    layers = getattr(model.trunk, "layers", [])
    for j, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(
            lambda m, i, o, j=j: out.append({"site": f"layer {j}", "zero_sum": zero_sum_diagnostic(o, n)})))
    try:
        model.eval()(idx_BT)
    finally:
        for h in hooks:
            h.remove()
    return out


register_block_option("phase_norm", norm=lambda cfg: PhaseRMSNorm(cfg.d_model, cfg.n_phases, cfg.norm_eps))
register_block_option("phase_rotation", between=PhaseRotation)
register_block_option("horn", embedding=HornInjection)

# 3PT twins of the paper's RoPE-only baselines: same shapes, N = 3, no sqrt(d) factor.
_3PT = dict(arch="three_phase", n_phases=3, embed_scale=False, tie_embeddings=False)
register_presets({
    "3pt-123m": dict(_3PT, d_model=768, n_layers=12, n_heads=12, n_kv_heads=3, d_ff=2048,
                     vocab_size=32000, max_seq_len=1024, embed_init_std=1.0),
    "3pt-5.5m": dict(_3PT, d_model=192, n_layers=4, n_heads=6, n_kv_heads=3, d_ff=512,
                     vocab_size=10000, max_seq_len=128, embed_init_std=1.0),
    "3pt-tiny": dict(_3PT, d_model=96, n_layers=2, n_heads=6, n_kv_heads=3, d_ff=256,
                     vocab_size=256, max_seq_len=64),
    "3pt-small": dict(_3PT, d_model=192, n_layers=4, n_heads=6, n_kv_heads=3, d_ff=512,
                      vocab_size=256, max_seq_len=128),
})
