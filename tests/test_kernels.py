"""Fused kernels of the Sinkhorn-form hyper-connection (phaseloop.kernels,
csrc/hyperconn.cpp): the same values and gradients as the torch ops of
hyperconn.HyperConnection, where they apply, and the mode switch / fallback behaviour."""

import pytest
import torch

from phaseloop import ModelConfig, build_model, kernels
from phaseloop.errors import ConfigError
from phaseloop.hyperconn import HyperConnection, copy_streams, sinkhorn

needs_ext = pytest.mark.skipif(kernels.extension() is None,
                               reason=f"fused kernels not built: {kernels.error()}")


@needs_ext
@pytest.mark.parametrize("r,m,with_f,D", [(4, 4, True, 16), (4, 1, True, 13), (1, 4, False, 9),
                                          (3, 3, True, 8), (9, 2, True, 5), (2, 5, False, 21)])
def test_rows_matches_torch_and_gradchecks(r, m, with_f, D):
    """out = A @ [Y; F] per token: values equal the batched product, gradients pass
    gradcheck (float64), including D not a multiple of the vector width and r > 8."""
    g = torch.Generator().manual_seed(r * 100 + m)
    N = 11
    A = torch.randn(N, r, m + with_f, generator=g, dtype=torch.float64, requires_grad=True)
    Y = torch.randn(N, m, D, generator=g, dtype=torch.float64, requires_grad=True)
    F = torch.randn(N, D, generator=g, dtype=torch.float64, requires_grad=True) if with_f else None
    Z = torch.cat([Y, F.unsqueeze(1)], 1) if with_f else Y
    torch.testing.assert_close(kernels.Rows.apply(A, Y, F), A @ Z, rtol=1e-12, atol=1e-12)
    args = (A, Y, F) if with_f else (A, Y)
    assert torch.autograd.gradcheck(kernels.Rows.apply, args)


@needs_ext
@pytest.mark.parametrize("n,N", [(4, 13), (3, 8), (4, 1), (5, 17)])
def test_sinkhorn_kernel_equals_torch_path(n, N):
    """Fused Sinkhorn (vectorised over blocks of 8 tokens, a padded last block, n = 4
    specialised, other n generic) equals the unrolled torch version forward and backward."""
    g = torch.Generator().manual_seed(n * N)
    L = (2 * torch.randn(N, n, n, generator=g, dtype=torch.float64)).requires_grad_()
    G = torch.randn(N, n, n, generator=g, dtype=torch.float64)
    P = kernels.Sinkhorn.apply(L, 20)
    want = sinkhorn(L, 20)
    torch.testing.assert_close(P, want, rtol=1e-12, atol=1e-13)
    dL, = torch.autograd.grad((P * G).sum(), L)
    dW, = torch.autograd.grad((want * G).sum(), L)
    torch.testing.assert_close(dL, dW, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: kernels.Sinkhorn.apply(t, 5), (L,))
    torch.testing.assert_close(P.sum(-2), torch.ones(N, n, dtype=torch.float64))


def _graph_nodes(t: torch.Tensor) -> set:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def test_projsq_values_and_gradcheck():
    """(y W^T, |y|^2) with the fused input gradient g_p W + 2 g_s y (empty buffer)."""
    d = dict(dtype=torch.double, requires_grad=True)
    y, W = torch.randn(6, 8, **d), torch.randn(5, 8, **d)
    p, ss = kernels.ProjSq.apply(y, W, kernels.StreamGrad())
    torch.testing.assert_close(p, y @ W.t())
    torch.testing.assert_close(ss, y.square().sum(-1, keepdim=True))
    assert torch.autograd.gradcheck(lambda a, b: kernels.ProjSq.apply(a, b, kernels.StreamGrad()), (y, W))


@needs_ext
@pytest.mark.parametrize("preset,over", [
    ("mhc-tiny", {}), ("hyperloop-tiny", {}), ("hyperloop-tiny", {"hc_res": "sinkhorn"}),
    ("hyperloop-tiny", {"hc_res": "identity", "hc_per_layer": True}),
    ("mhc-tiny", {"n_phases": 2, "phase_rotation": True})])
def test_model_fused_equals_torch_ops(preset, over):
    """A whole training step's loss and every gradient agree between the two paths; the
    kernels run exactly for the Sinkhorn form (diagonal / identity: torch ops in both)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset(preset, **over))
    for p in model.parameters():  # move off the init so every coefficient path carries signal
        p.data.add_(0.05 * torch.randn_like(p))
    x = torch.randint(0, 256, (2, 24))
    out = {}
    for m in ("torch", "fused"):
        model.zero_grad(set_to_none=True)
        with kernels.use(m):
            loss = model(x, x).loss
            nodes = _graph_nodes(loss)
            loss.backward()
        fused_nodes = {"RowsBackward", "SinkhornBackward", "ProjSqBackward"}
        if m == "fused" and model.cfg.hc_res_form == "sinkhorn":  # the path really taken
            assert fused_nodes <= nodes, fused_nodes - nodes
        else:
            assert not fused_nodes & nodes, fused_nodes & nodes
        out[m] = (loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()})
    torch.testing.assert_close(out["fused"][0], out["torch"][0], rtol=1e-5, atol=1e-6)
    for k, g in out["torch"][1].items():
        torch.testing.assert_close(out["fused"][1][k], g, rtol=1e-4, atol=1e-6, msg=k)


def test_kernels_apply_only_where_kept():
    """The fused path: Sinkhorn form, fp32/fp64 CPU streams (the first connection's
    stride-0 copies included), mode not 'torch'; never bf16 or the other forms."""
    hcs = {f: HyperConnection(ModelConfig.from_preset("mhc-tiny", hc_res=f), False, False)
           for f in ("sinkhorn", "diagonal", "identity")}
    y = torch.randn(2, 3, 4, 64)
    with kernels.use("torch"):
        assert not kernels.enabled(y) and not kernels.applies(hcs["sinkhorn"], y)
    assert not kernels.enabled(y.bfloat16())
    assert not kernels.applies(hcs["diagonal"], y) and not kernels.applies(hcs["identity"], y)
    if kernels.extension() is not None:
        assert kernels.applies(hcs["sinkhorn"], y)
        x = y[:, :, 0].double().requires_grad_()  # the first connection's stride-0 copies
        hc = hcs["sinkhorn"].double()
        outs = []
        for m in ("fused", "torch"):
            with kernels.use(m):
                out = hc(copy_streams(x, 4), torch.tanh)
                outs.append((out, torch.autograd.grad(out.square().sum(), x)[0]))
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-10, atol=1e-12)


def test_mode_switch_and_bad_mode(monkeypatch):
    before = kernels.mode()
    with kernels.use("torch"):
        assert kernels.mode() == "torch"
    assert kernels.mode() == before
    with pytest.raises(ConfigError, match="choose one of auto, fused, torch"):
        kernels.set_mode("fast")
    monkeypatch.setitem(kernels._state, "mode", None)
    monkeypatch.setenv("PHASELOOP_KERNELS", "turbo")
    with pytest.raises(ConfigError, match="PHASELOOP_KERNELS='turbo'.*auto, fused, torch"):
        kernels.mode()
    monkeypatch.setenv("PHASELOOP_KERNELS", "TORCH")
    assert kernels.mode() == "torch"


def test_unbuildable_extension_falls_back_or_fails_by_mode(monkeypatch):
    """Without a compiler: 'auto' warns once and runs torch ops; 'fused' is a one-line
    error naming the fix."""
    monkeypatch.setitem(kernels._state, "ext", None)
    monkeypatch.setitem(kernels._state, "error", "CalledProcessError: no c++ compiler")
    monkeypatch.setitem(kernels._state, "warned", False)
    hc = HyperConnection(ModelConfig.from_preset("mhc-tiny"), False, False)
    y = torch.randn(2, 3, 4, 64)
    with kernels.use("auto"), pytest.warns(UserWarning, match="no c\\+\\+ compiler"):
        assert not kernels.applies(hc, y)
    with kernels.use("auto"):
        out = hc(y, torch.tanh)  # torch ops, no second warning
    with kernels.use("torch"):
        torch.testing.assert_close(out, hc(y, torch.tanh), rtol=0, atol=0)
    with kernels.use("fused"), pytest.raises(ConfigError, match="PHASELOOP_KERNELS=auto"):
        kernels.enabled(y)


@needs_ext
def test_connection_gradcheck_with_shared_gradient_buffer(monkeypatch):
    """The fused connection returns y's whole gradient from the projection's backward
    (the mix and the read leave theirs in one buffer): gradcheck of the connection as a
    function of its streams and of every parameter, in float64."""
    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("mhc-tiny", d_model=8, n_heads=2, n_kv_heads=2, hc_alpha_init=0.5)
    hc = HyperConnection(cfg, loop_embedding=True, residual_f=False).double()
    with torch.no_grad():
        hc.W.mul_(20)
        hc.e.normal_()
    y = torch.randn(2, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64)
    params = [hc.W, hc.b, hc.alpha, hc.e]

    def f(y, *ps):
        return hc(y, lambda h: torch.tanh(h) * w)

    bufs = []

    class Recorded(kernels.StreamGrad):
        def __init__(self):
            super().__init__()
            bufs.append(self)

    monkeypatch.setattr(kernels, "StreamGrad", Recorded)
    with kernels.use("fused"):
        out = f(y)
        assert len(bufs) == 1 and "RowsBackward" in _graph_nodes(out)  # the buffer path
        out.sum().backward()
        assert bufs[0].dy is None  # filled by mix and read, drained by the projection
        assert torch.autograd.gradcheck(f, (y, *params))


@needs_ext
def test_kernels_split_over_threads_give_identical_results():
    """Tokens are independent: splitting them over intra-op threads changes nothing."""
    g = torch.Generator().manual_seed(3)
    A, Y, F = torch.randn(300, 4, 5, generator=g), torch.randn(300, 4, 64, generator=g), \
        torch.randn(300, 64, generator=g)
    G, L = torch.randn(300, 4, 64, generator=g), torch.randn(300, 4, 4, generator=g)
    ext = kernels.extension()
    old = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append([ext.rows_forward(A, Y, F), *ext.rows_backward(A, Y, F, G, None),
                         ext.sinkhorn_forward(L, 20), ext.sinkhorn_backward(L, L, 20)])
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
