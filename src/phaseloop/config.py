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
from .validation import check_ints, check_types, strict_from_dict

ARCHS = ("rope", "three_phase", "looped", "hyperloop", "mhc", "universal")
# Fields whose None default means "derived from the other fields" (see __post_init__).
_DERIVED = ("n_kv_heads", "d_ff", "n_phases", "phase_rotation", "phase_norm", "phase_aligned_gqa",
            "horn")


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
    d_ff: int | None = None  # None -> 8/3 * d_model rounded up to 32 (SwiGLU); 4 * d_model (relu)
    max_seq_len: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    dropout: float = 0.0
    tie_embeddings: bool = False
    embed_scale: bool = False  # multiply token embeddings by sqrt(d_model)
    embed_init_std: float = 0.02  # the 3PT paper's baseline uses PyTorch's default N(0, 1)
    init_std: float = 0.02  # residual projections get init_std / sqrt(2 * n_layers)
    init: str = "normal"  # linear layers: normal (N(0, init_std)) | torch (nn.Linear's default)

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

    # --- Looped / Hyperloop (Zeitoun et al. 2026) and mHC (Xie et al. 2025), see hyperloop.py
    # For looped archs n_layers counts *unique* layers: begin + middle + end.
    n_begin: int | None = None  # looped archs: layers before the loop (None -> n_layers // 4)
    n_end: int | None = None  # layers after the loop (None -> n_layers // 4); middle = the rest
    n_loops: int = 3  # L, applications of the shared middle block
    n_streams: int = 4  # residual streams of the hyper-connections (hyperloop, mhc)
    hc_res: str | None = None  # H_res: diagonal | sinkhorn | identity (None -> arch default)
    hc_per_layer: bool = False  # hyperloop ablation: connections after every middle layer
    hc_transition: str = "hc"  # hyperloop: hc (paper) | pooled_mlp (the review's variant)
    hc_alpha_init: float = 0.01  # init of the alpha scales of the dynamic coefficients
    hc_dynamic: bool = True  # False: ablation "static T", coefficients from the biases only
    sinkhorn_iters: int = 20  # Sinkhorn-Knopp iterations for hc_res=sinkhorn

    # --- Universal Transformer (Dehghani et al. 2019), see universal.py --------------
    # arch="universal": one shared Block applied n_steps times (n_layers must be 1).
    n_steps: int = 6  # T, applications of the shared block (overridable at inference)
    step_signal: str = "sinusoid"  # step part of the coordinate signal: sinusoid | learned
    act: bool = False  # adaptive computation time per position (UT §2.2)
    act_type: str = "basic"  # basic (interpolating) | accumulated (Graves) | t2t_literal (see act.py)
    act_epsilon: float = 0.01  # a position halts once its summed halting prob. > 1 - eps
    act_max_steps: int | None = None  # None -> 2 * n_steps (see act_steps)
    act_loss_weight: float = 0.01  # ponder loss weight (added to the loss, logged apart)
    act_halting_bias_init: float = 1.0  # bias of the halting unit (tensor2tensor: 1.0)
    act_early_exit: bool = True  # uncached forward stops once no position runs (same output)
    use_rope: bool = True  # any arch: False drops RoPE (paper-faithful UT: sinusoids only)
    # Shared block, any arch (layers.py); the published UT / Transformer switch all three on
    # and use_rope off (presets universal-paper-*, accounting.EncDecSpec.config).
    ffn: str = "swiglu"  # transition: swiglu (Shazeer 2020) | relu (max(0, xW1+b1)W2+b2, Vaswani)
    norm: str = "rms"  # every norm site: rms (RMSNorm, gain) | layer (LayerNorm, gain + bias)
    bias: bool = False  # biases on the attention (q, kv, o) and FFN projections

    def __post_init__(self) -> None:
        check_types(self, "config")
        # Fields left None are derived from others; remember which, so that replace()
        # derives them again from the new values (a plain attribute: not a field).
        derived = tuple(f.name for f in fields(self) if f.name in _DERIVED and getattr(self, f.name) is None)
        object.__setattr__(self, "_derived", derived)
        tp = self.arch == "three_phase"
        if self.n_phases is None:
            self.n_phases = 3 if tp else 1
        for name in ("phase_rotation", "phase_norm", "phase_aligned_gqa", "horn"):
            if getattr(self, name) is None:
                setattr(self, name, tp)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:  # 4d for the ReLU FFN (Vaswani), 8/3 d for SwiGLU (same params)
            self.d_ff = 4 * self.d_model if self.ffn == "relu" else 32 * math.ceil(8 * self.d_model / 3 / 32)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if self.arch not in ARCHS:
            _fail("arch", self.arch, f"unknown architecture; choose one of {', '.join(ARCHS)}")
        check_ints(self, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                          "max_seq_len", "n_phases"), "config")
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
        if self.init not in ("normal", "torch"):
            _fail("init", self.init, "choose normal (N(0, init_std), residual projections scaled) "
                  "or torch (PyTorch's nn.Linear default, U(±1/sqrt(fan_in)))")
        self._validate_phases()
        self._validate_loops()
        self._validate_universal()

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

    def _validate_loops(self) -> None:
        looped, hc = self.arch in ("looped", "hyperloop"), self.arch in ("hyperloop", "mhc")
        check_ints(self, ("n_begin", "n_end"), "config", minimum=0, optional=True)
        check_ints(self, ("n_loops", "n_streams", "sinkhorn_iters"), "config")
        if looped and self.loop_split[1] < 1:
            b, _, e = self.loop_split
            _fail("n_layers", self.n_layers, f"leaves no middle layer after n_begin={b} and "
                  f"n_end={e}; raise n_layers or lower n_begin/n_end")
        if self.hc_res not in (None, "diagonal", "sinkhorn", "identity"):
            _fail("hc_res", self.hc_res, "choose diagonal, sinkhorn or identity")
        if self.hc_transition not in ("hc", "pooled_mlp"):
            _fail("hc_transition", self.hc_transition, "choose hc or pooled_mlp")
        if not self.hc_alpha_init >= 0:
            _fail("hc_alpha_init", self.hc_alpha_init, "must be >= 0")
        why = f"has no effect with arch={self.arch!r}; drop it or pick an arch that uses it"
        if not looped:
            self._refuse_set(("n_begin", "n_end", "n_loops"), why + " (looped, hyperloop)")
        if not hc:
            self._refuse_set(("n_streams", "hc_res", "hc_alpha_init", "hc_dynamic",
                              "sinkhorn_iters"), why + " (hyperloop, mhc)")
        if not self.hc_dynamic:
            self._refuse_set(("hc_alpha_init",), "static coefficients (hc_dynamic=False) have "
                             "no alpha; drop hc_alpha_init or set hc_dynamic=True")
            if self.hc_transition == "pooled_mlp":
                _fail("hc_dynamic", False, "the pooled-MLP variant has no hyper-connection "
                      "coefficients to make static; drop hc_dynamic or use hc_transition='hc'")
        if self.arch != "hyperloop":
            self._refuse_set(("hc_per_layer", "hc_transition"), why + " (hyperloop)")
        if hc and self.n_streams < 2:
            _fail("n_streams", self.n_streams, "hyper-connections need >= 2 streams; "
                  "use arch='looped' (or 'rope') for a single residual stream")
        if self.hc_transition == "pooled_mlp" and (self.hc_per_layer or self.hc_res is not None):
            _fail("hc_transition", self.hc_transition,
                  "the pooled-MLP variant has no H_res and runs once per loop; drop hc_res "
                  "and hc_per_layer")

    def _validate_universal(self) -> None:
        ut = self.arch == "universal"
        if ut and self.n_layers != 1:
            _fail("n_layers", self.n_layers, "arch='universal' applies ONE shared block; set "
                  "n_layers=1 and the number of applications with n_steps")
        check_ints(self, ("n_steps",), "config")
        check_ints(self, ("act_max_steps",), "config", optional=True)
        if self.step_signal not in ("sinusoid", "learned"):
            _fail("step_signal", self.step_signal, "choose sinusoid or learned")
        if self.act_type not in ("basic", "accumulated", "t2t_literal"):
            _fail("act_type", self.act_type, "choose basic (tensor2tensor, documented), accumulated "
                  "(Graves) or t2t_literal (tensor2tensor's code as written)")
        if not 0 < self.act_epsilon < 1:
            _fail("act_epsilon", self.act_epsilon, "must be in (0, 1); the threshold is 1 - eps")
        if not self.act_loss_weight >= 0:
            _fail("act_loss_weight", self.act_loss_weight, "must be >= 0")
        # the shared block's options (generic; validated here beside use_rope)
        if self.ffn not in ("swiglu", "relu"):
            _fail("ffn", self.ffn, "choose swiglu or relu")
        if self.norm not in ("rms", "layer"):
            _fail("norm", self.norm, "choose rms or layer")
        if self.norm != "rms" and self.phase_norm:
            _fail("norm", self.norm, "phase_norm=True replaces every norm with PhaseAwareRMSNorm; "
                  "set norm='rms' or phase_norm=False")
        act_fields = ("act_type", "act_epsilon", "act_max_steps", "act_loss_weight",
                      "act_halting_bias_init", "act_early_exit")
        if not ut:
            self._refuse_set(("n_steps", "step_signal", "act") + act_fields,
                             f"has no effect with arch={self.arch!r}; drop it or use arch='universal'")
        elif not self.act:
            self._refuse_set(act_fields, "is an ACT option; set act=true or drop it")

    def _refuse_set(self, names, why: str) -> None:
        """Options of one trunk set on another would be silently ignored: refuse them."""
        defaults = {f.name: f.default for f in fields(self)}
        for name in names:
            if getattr(self, name) != defaults[name]:
                _fail(name, getattr(self, name), why)

    # ------------------------------------------------------------------ helpers
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_phase(self) -> int:
        return self.d_model // self.n_phases

    @property
    def loop_split(self) -> tuple[int, int, int]:
        """(begin, middle, end) unique layers of a looped trunk (default ~25/50/25 %)."""
        b = self.n_layers // 4 if self.n_begin is None else self.n_begin
        e = self.n_layers // 4 if self.n_end is None else self.n_end
        return b, self.n_layers - b - e, e

    @property
    def hc_res_form(self) -> str:
        """H_res form: the field, else diagonal (hyperloop paper) / sinkhorn (mHC)."""
        return self.hc_res or ("sinkhorn" if self.arch == "mhc" else "diagonal")

    @property
    def act_steps(self) -> int:
        """ACT max steps: the field, else 2 x the nominal step count (UT §2.2)."""
        return self.act_max_steps or 2 * self.n_steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return strict_from_dict(cls, d, "config")

    def replace(self, **overrides) -> "ModelConfig":
        """The config built from this one's explicit fields plus ``overrides``: values that
        were derived (d_ff, n_kv_heads, the 3PT switches) are derived again."""
        d = self.to_dict()
        d.update({name: None for name in self._derived})
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
