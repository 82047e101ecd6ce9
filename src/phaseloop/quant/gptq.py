"""GPTQ (Frantar et al. 2022, arXiv 2210.17323, Alg. 1)
----------------------------------------------------
:func:`gptq_quantize` follows the reference implementation: dead columns
(``H_ii == 0``) get ``H_ii = 1`` and a zero weight; damping ``damp * mean(diag H)``; the
upper Cholesky factor of ``H^-1``; column-by-column quantisation with error feedback
inside blocks of ``block_size`` columns and lazy updates of the later columns after each
block; group parameters computed from the (already error-updated) weights when a group
starts.  ``block_size`` is rounded up to a multiple of ``group_size`` so every group lies
inside one block and its parameters see all the feedback so far.  No act-order.

Hessians of looped layers
-------------------------
:func:`collect_hessians` registers forward hooks that see every call of a module, so
a Linear applied L times per forward pools ``H = 2/n sum x x^T`` over all L passes,
with ``n`` = the number of input rows (tokens) over all batches *and* all calls.
Distinct modules that share one weight tensor also pool into one Hessian.  By default
all Hessians come from one calibration pass of the full-precision model
(``sequential=False``); ``sequential=True`` re-collects each layer's Hessian after the
layers that run before it have been quantised (one calibration pass per layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn as nn

from phaseloop.engine.optim import tf32
from phaseloop.errors import ConfigError
from phaseloop.quant.core import check_bits, check_weight, qparams, quant_codes, resolve_group_size
from phaseloop.quant.targets import default_skip, select_linears

# --------------------------------------------------------------------------- GPTQ

@tf32(False)  # full fp32 on CUDA, as the reference sets allow_tf32 = False
def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, bits: int, group_size: int | None = 128,
                  damp: float = 0.01, block_size: int = 128, *, sym: bool = False,
                  scale_dtype: torch.dtype = torch.float16):
    """GPTQ (Frantar et al. 2022, Alg. 1) of ``weight`` [out, in] given the input Hessian ``H`` [in, in].

    ``H`` is ``2/n sum x x^T`` over the layer's calibration inputs (its overall scale does
    not matter: damping is relative).  Returns ``(q_int, scale, zero)`` in the same format as
    :func:`quantize_rtn`.  Columns with ``H_ii == 0`` (never-active inputs) are set to zero.
    """
    check_bits(bits)
    check_weight(weight)
    out_f, in_f = weight.shape
    g = resolve_group_size(group_size, in_f)
    if H.shape != (in_f, in_f):
        raise ConfigError(f"H must be [{in_f}, {in_f}] for a weight of shape {tuple(weight.shape)}, "
                          f"got {tuple(H.shape)}")
    if not (damp >= 0):
        raise ConfigError(f"damp must be >= 0, got {damp!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    block_size = math.ceil(block_size / g) * g if g < in_f else in_f   # groups never straddle blocks
    qmax = 2 ** bits - 1

    W = weight.detach().float().clone()
    H = H.detach().to(device=W.device, dtype=torch.float32).clone()
    if not bool(torch.isfinite(H).all()):
        raise ConfigError("gptq_quantize: H contains NaN or inf")
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    Hinv = None
    diag_mean = torch.diagonal(H).mean()
    d = damp if damp > 0 else 1e-6
    for _ in range(6):   # raise damping if the factorisation fails numerically
        Hd = H + d * diag_mean * torch.eye(in_f, device=W.device)
        L, info = torch.linalg.cholesky_ex(Hd)
        if int(info) == 0:
            Hi = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hi, upper=True)
            if int(info) == 0:
                Hinv = U
                break
        d *= 10.0
    if Hinv is None:
        raise ConfigError("gptq_quantize: Hessian is not positive definite even with heavy damping")

    Q = torch.zeros_like(W)
    scales = torch.zeros(out_f, in_f // g, device=W.device)
    zeros = torch.zeros_like(scales)
    scale = zero = None
    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:   # a group starts: its parameters from the error-updated weights
                scale, zero = qparams(W1[:, i:i + g], bits, sym, scale_dtype)
                scales[:, col // g] = scale
                zeros[:, col // g] = zero
            w = W1[:, i]
            q = quant_codes(w, scale, zero, qmax)
            Q[:, col] = q
            err = (w - (q - zero) * scale) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        if i2 < in_f:
            W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q.to(torch.uint8), scales.to(scale_dtype), zeros.to(scale_dtype)


def _forward_batch(model, batch, forward_fn):
    if forward_fn is not None:
        return forward_fn(model, batch)
    dev = next((p.device for p in model.parameters()), None)
    if isinstance(batch, Mapping):
        return model(**{k: (v.to(dev) if isinstance(v, torch.Tensor) and dev is not None else v)
                        for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        batch = batch[0]   # (inputs, targets) pairs: inputs only
    if isinstance(batch, torch.Tensor) and dev is not None:
        batch = batch.to(dev)
    return model(batch)


class _HessianAccumulator:
    """Running ``2/n sum x x^T`` over every row of every call (pooled by weight tensor)."""

    def __init__(self, in_features: int, device):
        self.H = torch.zeros(in_features, in_features, device=device, dtype=torch.float32)
        self.n = 0
        self.calls = 0

    @tf32(False)
    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        m = x.shape[0]
        self.calls += 1
        if m == 0:
            return
        n_new = self.n + m
        self.H.mul_(self.n / n_new)
        x = x * math.sqrt(2.0 / n_new)
        self.H.addmm_(x.t(), x)
        self.n = n_new


def collect_hessians(model: nn.Module, calib_batches: Iterable, modules=None, *, skip=default_skip,
                     forward_fn: Callable | None = None, return_counts: bool = False):
    """Forward the calibration batches and return ``{name: H}`` for the target Linear modules.

    ``H = 2/n sum_x x x^T`` (fp32, [in, in]) over **all** calls of the module, so a looped
    Linear called L times per forward pools all L passes; ``n`` counts input rows (tokens)
    over all batches and calls.  Modules sharing one weight get the same pooled ``H``.

    ``modules``: None (all ``nn.Linear`` not excluded by ``skip``), a ``{name: Linear}``
    mapping, or an iterable of names / modules.  ``calib_batches``: LongTensors [B, T]
    (or ``(inputs, targets)`` tuples, or dicts of keyword arguments); ``forward_fn(model,
    batch)`` overrides how a batch is run.  With ``return_counts=True`` returns
    ``(hessians, {name: {"rows": n, "calls": calls}})``.
    """
    targets, _ = select_linears(model, modules, skip)
    accs: dict[int, _HessianAccumulator] = {}
    handles = []

    def make_hook(acc):
        def hook(mod, inputs, output):
            acc.add(inputs[0])
        return hook

    for _name, mod in targets.items():
        key = id(mod.weight)
        if key not in accs:
            accs[key] = _HessianAccumulator(mod.in_features, mod.weight.device)
        handles.append(mod.register_forward_hook(make_hook(accs[key])))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in calib_batches:
                _forward_batch(model, batch, forward_fn)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    hs = {name: accs[id(mod.weight)].H for name, mod in targets.items()}
    if return_counts:
        counts = {name: {"rows": accs[id(mod.weight)].n, "calls": accs[id(mod.weight)].calls}
                  for name, mod in targets.items()}
        return hs, counts
    return hs


def call_order(model, targets: Mapping[str, nn.Module], batch, forward_fn) -> list[str]:
    """Target names in the order of their first call on one batch (never-called ones last)."""
    order: list[str] = []
    handles = []
    for name, mod in targets.items():
        def hook(m, i, o, name=name):
            if name not in order:
                order.append(name)
        handles.append(mod.register_forward_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _forward_batch(model, batch, forward_fn)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return order + [n for n in targets if n not in order]
