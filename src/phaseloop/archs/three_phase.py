"""Three-Phase Transformer (Abu Ayyash, arXiv 2604.14430, 2026): what is new about it.

The residual stream of width D is split into N contiguous stripes ("phases") of width
d_phase = D / N. This file holds the three new modules and registers each as an option
of the shared block / embedding (``PhaseOptions.block_options``, ``layers.BlockOption``)
under its config switch, so any trunk (stack, looped, universal, mHC) can carry the phase structure:

* ``PhaseRotation``  — modification 2, between attention and FFN, not residual;
* ``PhaseRMSNorm``   — modification 3, replaces every norm;
* ``HornInjection``  — modification 5, DC channel set to r(t) = 1/(t+1) once on the
  embedding output.
Modification 1 (partition) is ``n_phases``; modification 4 (phase-aligned GQA) is a
config check; dropping the sqrt(d_model) embedding factor is ``embed_scale=False``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from phaseloop.config import ModelConfig, fail
from phaseloop.layers import BlockOption, compute_dtype
from phaseloop.model import Stack
from phaseloop.registry import ArchSpec, register_arch, register_options
from phaseloop.trunk import DerivedBuffers


@register_options
@dataclass
class PhaseOptions:
    """The phase structure (3PT §2), on any trunk built from the shared block; all off
    (N = 1) unless switched on, all on for arch='three_phase' (its ``ArchSpec.defaults``)."""

    # None (as configs of 0.1 may hold): the arch's value, i.e. on for three_phase
    n_phases: int | None = 1  # N stripes of the residual stream (mod. 1)
    phase_rotation: bool | None = False  # PhaseRotation between attention and FFN (mod. 2)
    phase_norm: bool | None = False  # PhaseRMSNorm at every norm site (mod. 3)
    phase_aligned_gqa: bool | None = False  # require N | n_heads and N | n_kv_heads (mod. 4)
    horn: bool | None = False  # Gabriel's horn DC injection on the embedding output (mod. 5)
    learnable_offsets: bool = False  # ablation: learn the 2*pi*i/N offsets

    @staticmethod
    def diagnostics(model: nn.Module, stats: dict) -> dict[str, float]:
        """Per rotation layer, the mean |theta - theta_init| (``angle_drift``; 3PT §4)."""
        return {f"three_phase/angle_drift/layer{r['layer']}": r["mean_abs_drift"] for r in angle_drift(model)}
    residual_rotation: bool = False  # ablation: h + PR(h) instead of PR(h)
    learnable_horn: bool = False  # ablation (ours): learnable gain g in r(t) = g/(t+1)

    @property
    def d_phase(self) -> int:
        return self._cfg.d_model // self.n_phases

    def validate(self, cfg: ModelConfig) -> None:
        N = self.n_phases
        if not isinstance(N, int) or N < 1:
            fail("n_phases", N, "must be a positive integer")
        if cfg.d_model % N:
            fail("n_phases", N, f"must divide d_model={cfg.d_model}")
        if (cfg.d_model // N) % 2:
            fail("n_phases", N, f"d_phase=d_model/N={cfg.d_model // N} must be even "
                 "(the rotation acts on channel pairs)")
        if self.phase_aligned_gqa and (cfg.n_heads % N or cfg.n_kv_heads % N):
            fail("n_phases", N, f"phase-aligned GQA needs N to divide n_heads={cfg.n_heads} "
                 f"and n_kv_heads={cfg.n_kv_heads}; change n_phases or the head counts")
        if (self.learnable_offsets or self.residual_rotation) and not self.phase_rotation:
            fail("phase_rotation", False, "learnable_offsets/residual_rotation need phase_rotation=True")
        if self.learnable_horn and not self.horn:
            fail("horn", False, "learnable_horn needs horn=True")
        if cfg.norm != "rms" and self.phase_norm:
            fail("norm", cfg.norm, "phase_norm=True replaces every norm with PhaseAwareRMSNorm; "
                 "set norm='rms' or phase_norm=False")


def phase_offsets(n_phases: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """[N]: the fixed offsets 2πi/N, computed in ``dtype``."""
    return 2 * math.pi * torch.arange(n_phases, dtype=dtype, device=device) / n_phases


class PhaseRotation(DerivedBuffers, nn.Module):
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
        if torch.compiler.is_compiling():  # inductor has no complex kernels: the same product
            x0_BTP, x1_BTP = x_BTD.to(dtype).unflatten(-1, (-1, 2)).unbind(-1)  # in reals, fused
            c_P, s_P = a_P.cos(), a_P.sin()
            y_BTD = torch.stack((x0_BTP * c_P - x1_BTP * s_P, x0_BTP * s_P + x1_BTP * c_P), -1)
            y_BTD = y_BTD.flatten(-2).to(x_BTD.dtype)
        else:
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

    def forward(self, x_BTD: torch.Tensor, start_pos: int = 0,
                positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        """``positions_BT``: each token's position in its document, else
        start_pos, start_pos + 1, ... for every row."""
        T = x_BTD.shape[1]
        # positions in float64 for a float64 model, else fp32 (cast to the input's dtype)
        if positions_BT is None:
            t = torch.arange(start_pos, start_pos + T, device=x_BTD.device,
                             dtype=compute_dtype(x_BTD.dtype))[None]
        else:
            t = positions_BT.to(compute_dtype(x_BTD.dtype))
        r_BT = 1.0 / (t + 1.0)
        if self.gain is not None:
            r_BT = r_BT * self.gain
        dc_BT1 = r_BT.to(x_BTD.dtype)[..., None] - x_BTD.mean(dim=-1, keepdim=True)
        return x_BTD + dc_BT1


def zero_sum_diagnostic(x_BTD: torch.Tensor, n_phases: int) -> float:
    """Σ_i mean(stripe i), averaged over batch and positions (the paper's plot). Right
    after injection this equals N·H_T/T (H_T the T-th harmonic number)."""
    return x_BTD.unflatten(-1, (n_phases, -1)).mean(-1).sum(-1).mean().item()


def horn_zero_sum(n_phases: int, T: int) -> float:
    """N·H_T/T: the zero-sum diagnostic right after the horn injection over T positions
    (the mean over all channels is then r(t) = 1/(t+1) at position t, so the N stripes'
    means sum to N·r(t); 0.0220 for N = 3,
    T = 1024). ``zero_sum_diagnostic`` of ``HornInjection``'s output equals it."""
    return n_phases * sum(1.0 / (t + 1) for t in range(T)) / T


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


def stripes(states: list, n_phases: int) -> list[dict]:
    """Per recorded site (``probe.Recording.states``): the mean of each of the N phase
    stripes and their sum (``zero_sum_diagnostic``), averaged over tokens (and streams), and
    the DC (mean over all channels) of every token, which the horn sets to 1/(t+1)."""
    rows = []
    for site, x in states:
        x_BTD = x if x.dim() == 3 else x.mean(2)  # n streams: their mean (the diagnostic is linear)
        means_N = x_BTD.float().unflatten(-1, (n_phases, -1)).mean(-1).mean((0, 1))
        rows.append({"site": site, "stripe_means": means_N.tolist(), "zero_sum": means_N.sum().item(),
                     "dc": x_BTD.float().mean(-1)[0].tolist()})
    return rows


def rotation_angles(model: nn.Module) -> dict | None:
    """The rotations: θ [layer, pair], θ at init, and ``angle_drift``'s rows; None for a
    model without phase rotation."""
    mods = sorted((m for m in model.modules() if isinstance(m, PhaseRotation)), key=lambda m: m.layer_idx)
    if not mods:
        return None
    return {"theta": [m.theta.detach().float().tolist() for m in mods],
            "init": [m.init_angle(m.layer_idx, m.n_layers) for m in mods],
            "drift": angle_drift(model)}


def _probe(model: nn.Module, rec) -> dict:
    """What explore's Inside page shows of the phase structure (``registry.probe_fns``):
    the stripes at every recorded site (N > 1) and the rotation angles."""
    out = {}
    if model.cfg.n_phases > 1:
        out["stripes"] = stripes(rec.states, model.cfg.n_phases)
    angles = rotation_angles(model)
    if angles is not None:
        out["angles"] = angles
    return out


PhaseOptions.probe = staticmethod(_probe)
PhaseOptions.block_options = {
    "phase_norm": BlockOption(norm=lambda cfg: PhaseRMSNorm(cfg.d_model, cfg.n_phases, cfg.norm_eps)),
    "phase_rotation": BlockOption(between=PhaseRotation),
    "horn": BlockOption(embedding=HornInjection),
}


_ON = dict(n_phases=3, phase_rotation=True, phase_norm=True, phase_aligned_gqa=True, horn=True)
# 3PT twins of the paper's RoPE-only baselines: same shapes, N = 3, no sqrt(d) factor.
_3PT = dict(embed_scale=False, tie_embeddings=False)
SPEC = register_arch(ArchSpec(
    name="three_phase",
    trunk=Stack,  # what is new is the stream's structure, carried by the shared block
    # all five modifications; a width and head count that N = 3 divides
    defaults={**_ON, "d_model": 120, "n_heads": 6},
    paper="Abu Ayyash, Three-Phase Transformer, arXiv 2604.14430 (2026)",
    aliases=("3pt",),
    preset_prefixes=("3pt", "three_phase"),
    modifiers={"3pt": _ON, "three_phase": _ON},  # the phase structure on any trunk
    commands="phaseloop.cli.three_phase_cmd:add_commands",  # `phaseloop angles`, `zero-sum`
    presets={
        "3pt-123m": dict(_3PT, n_phases=3, d_model=768, n_layers=12, n_heads=12, n_kv_heads=3,
                         d_ff=2048, vocab_size=32000, max_seq_len=1024, embed_init_std=1.0),
        "3pt-5.5m": dict(_3PT, n_phases=3, d_model=192, n_layers=4, n_heads=6, n_kv_heads=3,
                         d_ff=512, vocab_size=10000, max_seq_len=128, embed_init_std=1.0),
        "3pt-tiny": dict(_3PT, n_phases=3, d_model=96, n_layers=2, n_heads=6, n_kv_heads=3,
                         d_ff=256, vocab_size=256, max_seq_len=64),
        "3pt-small": dict(_3PT, n_phases=3, d_model=192, n_layers=4, n_heads=6, n_kv_heads=3,
                          d_ff=512, vocab_size=256, max_seq_len=128),
    },
))
