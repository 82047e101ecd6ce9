"""Fused CPU kernels for the Sinkhorn-form hyper-connection (mHC's; ``csrc/hyperconn.cpp``).

Kept by measurement (``benchmarks/bench_hyperloop.py``, docs/hyperloop.md): a connection
with a Sinkhorn H_res is, per token, tiny matrix products ([r, c] x [c, D]) and a
20-iteration Sinkhorn projection of an [n, n] matrix. Fused, the read, the mix and
Sinkhorn are one pass each with a token's rows in L1, the backward recomputes Sinkhorn
(as mHC §4.3's fused kernels do on GPU), and the connection's three readers of y share
one gradient buffer. That step beats the same model under ``torch.compile`` by 11 % at
d 512 (12 % at d 128); for the diagonal and identity forms (Hyperloop's default) the
hand-written path was within 3 % of compiled and was removed: they always run the plain
torch ops of ``hyperconn.HyperConnection``, which is also the reference this path is
tested against.

The extension is compiled with ``torch.utils.cpp_extension`` on first use (~30 s, then
cached under ``$TORCH_EXTENSIONS_DIR`` or ~/.cache/torch_extensions). Which path runs:

    PHASELOOP_KERNELS=auto   (default) fused when the extension builds, else torch ops
    PHASELOOP_KERNELS=fused  fused or an error saying why it cannot be built
    PHASELOOP_KERNELS=torch  always the torch ops

or in code ``with kernels.use("torch"): ...``. The fused path is taken for CPU tensors
of float32/float64 outside ``torch.compile`` tracing and autocast; everything else
(CUDA, bf16 autocast, compile) runs the torch ops, which compute the same values (tested).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch

from .errors import ConfigError

MODES = ("auto", "fused", "torch")
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
    """Run a block with kernel mode ``m`` (auto, fused or torch)."""
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
              "~30 s; PHASELOOP_KERNELS=torch skips them)", file=sys.stderr, flush=True)
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
    if torch.compiler.is_compiling():
        return False
    m = mode()
    if m == "torch":
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
    (``ProjSq``) adds its part and returns it as y's whole gradient."""
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


class ProjSq(torch.autograd.Function):
    """(y W^T, sum(y^2)) over the last dim of y [N, m], W [k, m], with one fused input
    gradient dy = g_p W + 2 g_s y, added in place to the other readers' gradient already
    in ``buf.dy`` and returned as y's whole gradient (autograd runs this backward last:
    the projection feeds everything else)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, W: torch.Tensor, buf: StreamGrad):
        ctx.save_for_backward(y, W)
        ctx.buf = buf
        return y @ W.t(), torch.linalg.vector_norm(y, dim=-1, keepdim=True).square()

    @staticmethod
    def backward(ctx, g_p: torch.Tensor, g_s: torch.Tensor):
        y, W = ctx.saved_tensors
        acc, ctx.buf.dy = ctx.buf.dy, None
        dy = y * (2 * g_s) if acc is None else acc.view(y.shape).addcmul_(y, 2 * g_s)
        return dy.addmm_(g_p, W), g_p.t() @ y, None


def applies(hc, y_BTnD: torch.Tensor) -> bool:
    """Whether ``hc`` (a ``hyperconn.HyperConnection``) runs fused on these streams."""
    return hc.form == "sinkhorn" and enabled(y_BTnD)


def hyper_connection(hc, y_BTnD: torch.Tensor, fn) -> torch.Tensor:
    """``hc(y, fn)`` with the kernels: the same equations as ``HyperConnection.forward``
    (alpha * W RMSNorm(y) + b computed as b + (W y) * alpha / rms(y), one matmul)."""
    lead, (n, D) = y_BTnD.shape[:-2], y_BTnD.shape[-2:]
    y_Nnd = y_BTnD.reshape(-1, n, D)  # copies the stride-0 view of copy_streams
    buf = StreamGrad()
    proj_Nk, ss_N1 = ProjSq.apply(y_Nnd.reshape(-1, n * D), hc.W, buf)
    scale_Nk = hc.alpha[hc.alpha_idx] * torch.rsqrt(ss_N1 / (n * D) + hc.eps)
    logits_Nk = torch.addcmul(hc.b, proj_Nk, scale_Nk)
    gates_Nk = torch.sigmoid(logits_Nk[:, :2 * n]).to(y_BTnD.dtype)
    res_Nnn = Sinkhorn.apply(logits_Nk[:, 2 * n:].reshape(-1, n, n), hc.iters).to(y_BTnD.dtype)
    x_ND = Rows.apply(gates_Nk[:, None, :n], y_Nnd, None, buf).view(-1, D)  # H_pre . y
    f_BTD = fn(x_ND.view(*lead, D))
    if hc.e is not None:
        f_BTD = f_BTD + hc.e
    A_Nnm = torch.cat([res_Nnn, 2 * gates_Nk[:, n:, None]], dim=-1)  # [H_res | H_post]
    out = Rows.apply(A_Nnm, y_Nnd, f_BTD.reshape(-1, D).to(y_BTnD.dtype), buf)
    return out.view(*lead, n, D)
