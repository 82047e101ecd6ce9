"""Fused hyper-connection kernels (phaseloop.kernels, csrc/hyperconn.cpp): the same
values and gradients as the torch path, and the mode switch / fallback behaviour."""

import pytest
import torch

from phaseloop import ModelConfig, build_model, kernels
from phaseloop.errors import ConfigError
from phaseloop.hyperloop import _Mix, _Sinkhorn, mix, sinkhorn

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
    want = _Sinkhorn.apply(L, 20)
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


@needs_ext
@pytest.mark.parametrize("preset,over", [
    ("mhc-tiny", {}), ("hyperloop-tiny", {}), ("hyperloop-tiny", {"hc_res": "sinkhorn"}),
    ("hyperloop-tiny", {"hc_res": "identity", "hc_per_layer": True}),
    ("mhc-tiny", {"n_phases": 2, "phase_rotation": True})])
def test_model_fused_equals_torch_ops(preset, over):
    """A whole training step's loss and every gradient agree between the two paths."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset(preset, **over))
    for p in model.parameters():  # move off the init so every coefficient path carries signal
        p.data.add_(0.05 * torch.randn_like(p))
    x = torch.randint(0, 256, (2, 24))
    out = {}
    for m in ("eager", "fused"):
        model.zero_grad(set_to_none=True)
        with kernels.use(m):
            loss = model(x, x).loss
            nodes = _graph_nodes(loss)
            loss.backward()
        fused_nodes = {"RowsBackward"}
        if model.cfg.hc_res_form == "sinkhorn":
            fused_nodes.add("SinkhornBackward")
        if m == "fused":  # the path really taken
            assert fused_nodes <= nodes, fused_nodes - nodes
        else:
            assert not fused_nodes & nodes, fused_nodes & nodes
        out[m] = (loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()})
    torch.testing.assert_close(out["fused"][0], out["eager"][0], rtol=1e-5, atol=1e-6)
    for k, g in out["eager"][1].items():
        torch.testing.assert_close(out["fused"][1][k], g, rtol=1e-4, atol=1e-6, msg=k)


def test_mix_and_sinkhorn_take_torch_path_where_kernels_do_not_apply():
    """bf16 tensors and mode 'eager' run the torch ops (same function, same values)."""
    g = torch.Generator().manual_seed(0)
    A, y, f = (torch.randn(2, 3, 4, 5, generator=g), torch.randn(2, 3, 4, 8, generator=g),
               torch.randn(2, 3, 8, generator=g))
    with kernels.use("eager"):
        assert not kernels.enabled(A)
        torch.testing.assert_close(mix(A, y, f), _Mix.apply(A, y, f))
    assert not kernels.enabled(A.bfloat16())
    L = torch.randn(5, 4, 4, generator=g)
    with kernels.use("eager"):
        torch.testing.assert_close(sinkhorn(L), _Sinkhorn.apply(L, 20))


def test_mode_switch_and_bad_mode(monkeypatch):
    before = kernels.mode()
    with kernels.use("eager"):
        assert kernels.mode() == "eager"
    assert kernels.mode() == before
    with pytest.raises(ConfigError, match="choose one of auto, fused, eager"):
        kernels.set_mode("fast")
    monkeypatch.setitem(kernels._state, "mode", None)
    monkeypatch.setenv("PHASELOOP_KERNELS", "turbo")
    with pytest.raises(ConfigError, match="PHASELOOP_KERNELS='turbo'.*auto, fused, eager"):
        kernels.mode()
    monkeypatch.setenv("PHASELOOP_KERNELS", "EAGER")
    assert kernels.mode() == "eager"


def test_unbuildable_extension_falls_back_or_fails_by_mode(monkeypatch):
    """Without a compiler: 'auto' warns once and runs torch ops; 'fused' is a one-line
    error naming the fix."""
    monkeypatch.setitem(kernels._state, "ext", None)
    monkeypatch.setitem(kernels._state, "error", "CalledProcessError: no c++ compiler")
    monkeypatch.setitem(kernels._state, "warned", False)
    x = torch.randn(3, 4, 4)
    with kernels.use("auto"), pytest.warns(UserWarning, match="no c\\+\\+ compiler"):
        assert not kernels.enabled(x)
    with kernels.use("auto"):
        P = sinkhorn(x)  # torch path, no second warning needed
    torch.testing.assert_close(P, _Sinkhorn.apply(x, 20))
    with kernels.use("fused"), pytest.raises(ConfigError, match="PHASELOOP_KERNELS=auto"):
        kernels.enabled(x)


@needs_ext
@pytest.mark.parametrize("form", ["diagonal", "sinkhorn", "identity"])
def test_connection_gradcheck_with_shared_gradient_buffer(form, monkeypatch):
    """The fused connection returns y's whole gradient from the projection's backward
    (the mix and the read leave theirs in one buffer): gradcheck of the connection as a
    function of its streams and of every parameter, in float64."""
    from phaseloop.hyperloop import HyperConnection

    torch.manual_seed(0)
    cfg = ModelConfig.from_preset("mhc-tiny", d_model=8, n_heads=2, n_kv_heads=2, hc_res=form,
                                  hc_alpha_init=0.5)
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
