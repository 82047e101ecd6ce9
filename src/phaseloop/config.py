"""Model configuration: one validated dataclass for every architecture, plus presets.

Architectures plug into the shared decoder skeleton (``model.py``) through
``arch``; options that belong to one paper live in their own block of fields below
and can be combined with any trunk where that makes sense (e.g. the 3PT phase
structure on a looped trunk).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError

ARCHS = ("rope", "three_phase")


def _fail(name: str, value: Any, why: str) -> None:
    raise ConfigError(f"invalid config: {name}={value!r}: {why}")


@dataclass
class ModelConfig:
    """Decoder-only LM configuration (Llama-style "RoPE-only" backbone by default)."""

    arch: str = "rope"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None -> n_heads (plain multi-head attention)
    d_ff: int | None = None  # None -> 8/3 * d_model rounded up to a multiple of 32
    max_seq_len: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0
    tie_embeddings: bool = False
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model)
    embed_init_std: float = 0.02  # the 3PT paper's baseline uses PyTorch's default N(0, 1)
    init_std: float = 0.02  # residual projections get init_std / sqrt(2 * n_layers)

    # --- Three-Phase Transformer (Abu Ayyash 2026), see three_phase.py -------------
    # None means "on for arch='three_phase', off otherwise"; any trunk may switch them on.
    n_phases: int | None = None  # N stripes of the residual stream (3 for three_phase)
    phase_rotation: bool | None = None  # PhaseRotation between attention and FFN (mod. 2)
    phase_norm: bool | None = None  # PhaseAwareRMSNorm at every norm site (mod. 3)
    phase_aligned_gqa: bool | None = None  # require N | n_heads and N | n_kv_heads (mod. 4)
    horn: bool | None = None  # Gabriel's horn DC injection on the embedding output (mod. 5)
    learnable_offsets: bool = False  # ablation: learn the 2*pi*i/N offsets
    residual_rotation: bool = False  # ablation: h + PR(h) instead of PR(h)
    learnable_horn: bool = False  # ablation (ours): learnable gain g in r(t) = g/(t+1)

    def __post_init__(self) -> None:
        tp = self.arch == "three_phase"
        if self.n_phases is None:
            self.n_phases = 3 if tp else 1
        for name in ("phase_rotation", "phase_norm", "phase_aligned_gqa", "horn"):
            if getattr(self, name) is None:
                setattr(self, name, tp)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:
            self.d_ff = 32 * math.ceil(8 * self.d_model / 3 / 32)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if self.arch not in ARCHS:
            _fail("arch", self.arch, f"unknown architecture; choose one of {', '.join(ARCHS)}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                     "max_seq_len", "n_phases"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(name, v, "must be a positive integer")
        if self.d_model % self.n_heads:
            _fail("n_heads", self.n_heads, f"must divide d_model={self.d_model}")
        if self.head_dim % 2:
            _fail("n_heads", self.n_heads,
                  f"head dim d_model/n_heads={self.head_dim} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            _fail("n_kv_heads", self.n_kv_heads, f"must divide n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            _fail("dropout", self.dropout, "must be in [0, 1)")
        for name in ("rope_base", "norm_eps", "embed_init_std", "init_std"):
            if not getattr(self, name) > 0:
                _fail(name, getattr(self, name), "must be > 0")
        self._validate_phases()

    def _validate_phases(self) -> None:
        N = self.n_phases
        if self.d_model % N:
            _fail("n_phases", N, f"must divide d_model={self.d_model}")
        if (self.d_model // N) % 2:
            _fail("n_phases", N, f"d_phase=d_model/N={self.d_model // N} must be even "
                  "(the rotation acts on channel pairs)")
        if self.phase_aligned_gqa and (self.n_heads % N or self.n_kv_heads % N):
            _fail("n_phases", N, f"phase-aligned GQA needs N to divide n_heads={self.n_heads} "
                  f"and n_kv_heads={self.n_kv_heads}; change n_phases or the head counts")
        if (self.learnable_offsets or self.residual_rotation) and not self.phase_rotation:
            _fail("phase_rotation", False,
                  "learnable_offsets/residual_rotation need phase_rotation=True")
        if self.learnable_horn and not self.horn:
            _fail("horn", False, "learnable_horn needs horn=True")

    # ------------------------------------------------------------------ helpers
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_phase(self) -> int:
        return self.d_model // self.n_phases

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"invalid config: unknown field(s) {', '.join(unknown)}; "
                              f"known fields: {', '.join(sorted(known))}")
        return cls(**d)

    def replace(self, **overrides) -> "ModelConfig":
        d = self.to_dict()
        d.update(overrides)
        return ModelConfig.from_dict(d)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
        d = dict(PRESETS[name])
        d.update(overrides)
        return cls.from_dict(d)


# The 3PT paper's baselines (its Table of configurations): the author's code multiplies a
# default-initialised N(0, 1) embedding by sqrt(d_model).
_PAPER_BASELINE = dict(arch="rope", tie_embeddings=False, embed_scale=True, embed_init_std=1.0)

PRESETS: dict[str, dict] = {
    "rope-123m": dict(_PAPER_BASELINE, d_model=768, n_layers=12, n_heads=12, n_kv_heads=3,
                      d_ff=2048, vocab_size=32000, max_seq_len=1024),
    "rope-5.5m": dict(_PAPER_BASELINE, d_model=192, n_layers=4, n_heads=6, n_kv_heads=3,
                      d_ff=512, vocab_size=10000, max_seq_len=128),
    # Small byte-level presets for CPU runs.
    "rope-tiny": dict(arch="rope", d_model=96, n_layers=2, n_heads=6, n_kv_heads=3, d_ff=256,
                      vocab_size=256, max_seq_len=64),
    "rope-small": dict(arch="rope", d_model=192, n_layers=4, n_heads=6, n_kv_heads=3,
                       d_ff=512, vocab_size=256, max_seq_len=128),
}


def register_presets(presets: dict[str, dict]) -> None:
    """Architecture modules add their presets here."""
    PRESETS.update(presets)
