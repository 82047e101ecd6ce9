"""Fused CPU kernels for the hyper-connections' stream maths (``csrc/hyperconn.cpp``).

A hyper-connection's per-token work is tiny matrix products ([r, c] x [c, D]) and a
20-iteration Sinkhorn projection of an [n, n] matrix. As torch ops these are batched
matmuls of 4 x 5 matrices (several times slower than a pass over memory on CPU) and
~200 small kernels for Sinkhorn; fused, each is one pass with a token's rows in L1 --
what mHC's fused kernels do on GPU (Xie et al., arXiv 2512.24880, §4.3: fused
coefficient/mixing kernels, Sinkhorn recomputed in the backward). The mHC/Transformer
step-time ratio the paper reports drops from 1.53 (unfused) to 1.07 (fused);
``benchmarks/bench_hyperloop.py`` measures both paths here.

The extension is compiled with ``torch.utils.cpp_extension`` on first use (~30 s, then
cached under ``$TORCH_EXTENSIONS_DIR`` or ~/.cache/torch_extensions). Which path runs:

    PHASELOOP_KERNELS=auto   (default) fused when the extension builds, else the torch path
    PHASELOOP_KERNELS=fused  fused or an error saying why it cannot be built
    PHASELOOP_KERNELS=eager  always the torch path (hand-written autograd functions)

or in code ``with kernels.use("eager"): ...``. The fused path is taken for CPU tensors
of float32/float64 outside ``torch.compile`` tracing; everything else (CUDA, bf16
autocast, compile) runs the torch path, which computes the same values (tested).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch

from .errors import ConfigError

MODES = ("auto", "fused", "eager")
_SOURCE = Path(__file__).parent / "csrc" / "hyperconn.cpp"
_state = {"mode": None, "ext": None, "error": None, "warned": False}


def mode() -> str:
    """The active mode: set by ``use``/``set_mode``, else $PHASELOOP_KERNELS, else auto."""
    if _state["mode"] is None:
        m = os.environ.get("PHASELOOP_KERNELS", "auto").strip().lower() or "auto"
        if m not in MODES:
            raise ConfigError(f"PHASELOOP_KERNELS={m!r} is not a kernel mode; "
                              f"set it to one of {', '.join(MODES)}")
        _state["mode"] = m
    return _state["mode"]


def set_mode(m: str) -> None:
    if m not in MODES:
        raise ConfigError(f"kernel mode {m!r} is unknown; choose one of {', '.join(MODES)}")
    _state["mode"] = m


@contextlib.contextmanager
def use(m: str):
    """Run a block with kernel mode ``m`` (auto, fused or eager)."""
    old = mode()
    set_mode(m)
    try:
        yield
    finally:
        _state["mode"] = old


def _cpu_tag() -> str:
    """Short hash of this CPU's instruction-set flags: the build uses -march=native, so a
    cache shared between machines keeps one build per CPU kind."""
    import hashlib
    import platform

    info = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as fh:
            info += next((ln for ln in fh if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(info.encode()).hexdigest()[:8]


def _build():
    import shutil

    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:  # say so plainly instead of a failed build's log
        raise RuntimeError(f"no C++ compiler ({cxx}) on PATH")
    venv_bin = str(Path(sys.executable).parent)  # pip's ninja lands next to the interpreter
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")

    name = f"phaseloop_hyperconn_{_cpu_tag()}"
    try:
        built = any(Path(cpp_extension._get_build_directory(name, False)).glob(f"{name}*.so"))
    except Exception:  # private helper; only used to decide whether to say "building"
        built = False
    if not built:
        print("phaseloop: compiling the fused hyper-connection kernels (first use only, "
              "~30 s; PHASELOOP_KERNELS=eager skips them)", file=sys.stderr, flush=True)
    return cpp_extension.load(name=name, sources=[str(_SOURCE)],
                              extra_cflags=["-O3", "-fopenmp-simd", "-march=native"], verbose=False)


def extension():
    """The compiled extension, or None where it cannot be built (the reason in ``error()``)."""
    if _state["ext"] is None and _state["error"] is None:
        try:
            _state["ext"] = _build()
        except Exception as exc:  # no compiler / ninja / headers: fall back to torch ops
            last = (str(exc).strip().splitlines() or [""])[-1]  # a failed build's last line
            _state["error"] = f"{type(exc).__name__}: {last}"
    return _state["ext"]


def error() -> str | None:
    return _state["error"]


def enabled(*tensors: torch.Tensor) -> bool:
    """True when the fused kernels should run for these tensors."""
    m = mode()
    if m == "eager" or torch.compiler.is_compiling():
        return False
    dt = tensors[0].dtype
    if dt not in (torch.float32, torch.float64) or any(
            t.device.type != "cpu" or t.dtype != dt for t in tensors):
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    if extension() is None:
        if m == "fused":
            raise ConfigError(f"PHASELOOP_KERNELS=fused but the fused kernels could not be built "
                              f"({error()}); install a C++ compiler and ninja, or set "
                              f"PHASELOOP_KERNELS=auto")
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(f"phaseloop: fused hyper-connection kernels unavailable ({error()}); "
                          f"using torch ops (slower on CPU)", stacklevel=2)
        return False
    return True


class StreamGrad:
    """A shared gradient buffer for one connection's input streams y.

    A hyper-connection reads y three times: the coefficient projection (W y, |y|^2), the
    read x = H_pre . y and the mix H_res y + H_post f. Left to autograd, each backward
    writes its own [tokens, n, D] gradient and two more passes add them up. Given one
    buffer, the readers fill it in the order autograd must run them (the mix's output is
    last in the forward, the projection feeds everything else): the mix's ``Rows``
    writes it, the read's adds into it, and the projection's backward
    (``hyperloop._ProjSq``) adds its part and returns it as y's whole gradient."""
    __slots__ = ("dy",)

    def __init__(self):
        self.dy = None


class Rows(torch.autograd.Function):
    """out[t] = A[t] @ [Y[t]; F[t]] for A [N, r, c], Y [N, m, D], F [N, D] or None
    (c = m + 1 or m): one fused pass forward, one backward. With ``buf`` (a
    ``StreamGrad``) Y's gradient is added into ``buf.dy`` instead of returned."""

    @staticmethod
    def forward(ctx, A, Y, F=None, buf: StreamGrad | None = None):
        A, Y = A.contiguous(), Y.contiguous()
        F = F.contiguous() if F is not None else None
        ctx.save_for_backward(A, Y, F)
        ctx.buf = buf
        return extension().rows_forward(A, Y, F)

    @staticmethod
    def backward(ctx, G):
        A, Y, F = ctx.saved_tensors
        buf = ctx.buf
        dA, dY, dF = extension().rows_backward(A, Y, F, G.contiguous(),
                                               None if buf is None else buf.dy)
        if buf is not None:
            buf.dy, dY = dY, None
        return dA, dY, (dF if F is not None else None), None


class Sinkhorn(torch.autograd.Function):
    """Sinkhorn-Knopp on [N, n, n] logits (rows then columns, ``iters`` times); the
    backward recomputes the iterations per token instead of storing them."""

    @staticmethod
    def forward(ctx, L, iters: int):
        L = L.contiguous()
        ctx.save_for_backward(L)
        ctx.iters = iters
        return extension().sinkhorn_forward(L, iters)

    @staticmethod
    def backward(ctx, G):
        L, = ctx.saved_tensors
        return extension().sinkhorn_backward(L, G.contiguous(), ctx.iters), None
