"""The Hyperloop and mHC trunks against the spec's equations written out here, with every
hyper-connection's alpha, bias and loop embedding random (at alpha = 0 all connections are
alike, so a swapped connection or a wrong merge would pass): Hyperloop (spec, Zeitoun et al.
arXiv 2604.21254 §2) per loop l y <- H_res y + H_post (F(H_pre . y) + e_l), the streams
averaged at the end; mHC per sub-layer x <- H_res x + H_post^T F(H_pre x), H_res projected
onto the doubly stochastic matrices by Sinkhorn from exp."""

import pytest
import torch

from phaseloop import ModelConfig, build_model
from phaseloop.layers import ForwardContext

D, B, T = 32, 2, 5


def _z(Y):  # the RMS-normalised flattened streams [B, T, n C]
    z = Y.flatten(-2)
    return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)


def _randomise(hcs, loop_embedding: bool):
    with torch.no_grad():
        for hc in hcs:
            hc.alpha.copy_(torch.randn(3))
            hc.b.add_(torch.randn_like(hc.b))
            if loop_embedding:
                hc.e.copy_(torch.randn(D))


def _blocks(blocks, h, cfg):
    for b in blocks:
        h = b(h, ForwardContext.at(cfg, 0, T, "cpu"))
    return h


def test_hyperloop_trunk_is_the_spec_recurrence():
    torch.manual_seed(0)
    cfg = ModelConfig(arch="hyperloop", d_model=D, n_heads=4, n_layers=4, n_begin=1, n_end=1, n_loops=3,
                      vocab_size=20)
    trunk = build_model(cfg).double().eval().trunk
    n, hcs = cfg.n_streams, list(trunk.hc)
    assert len(hcs) == 3 and n > 1
    _randomise(hcs, loop_embedding=True)
    x = torch.randn(B, T, D, dtype=torch.float64)
    with torch.no_grad():
        out = trunk(x, ForwardContext.at(cfg, 0, T, "cpu"))
        Y = _blocks(trunk.begin, x, cfg)[:, :, None, :].repeat(1, 1, n, 1)  # Y^(0): n copies
        for hc in hcs:
            z, a = _z(Y), hc.alpha
            W, b = hc.W.split(n), hc.b.split(n)
            pre, post, res = (torch.sigmoid(a[i] * (z @ W[i].T) + b[i]) for i in range(3))
            f = _blocks(trunk.middle, (pre[..., None] * Y).sum(-2), cfg) + hc.e
            Y = res[..., None] * Y + 2 * post[..., None] * f[..., None, :]
        ref = _blocks(trunk.end, Y.mean(2), cfg)  # averaged, then the end block
    assert (out - ref).abs().max().item() < 1e-12


def test_mhc_trunk_is_the_spec_recurrence_per_sub_layer():
    torch.manual_seed(1)
    cfg = ModelConfig(arch="mhc", d_model=D, n_heads=4, n_layers=2, vocab_size=20)
    trunk = build_model(cfg).double().eval().trunk
    n, hcs = cfg.n_streams, list(trunk.hc)
    assert len(hcs) == 2 * cfg.n_layers  # one before attention and one before the FFN of each layer
    _randomise(hcs, loop_embedding=False)
    x = torch.randn(B, T, D, dtype=torch.float64)
    ctx = ForwardContext.at(cfg, 0, T, "cpu")
    with torch.no_grad():
        out = trunk(x, ctx)
        Y = x[:, :, None, :].repeat(1, 1, n, 1)
        for i, blk in enumerate(trunk.layers):
            subs = (lambda h, blk=blk: blk.attn(blk.attn_norm(h), ctx), lambda h, blk=blk: blk.ffn(blk.ffn_norm(h)))
            for j, F_ in enumerate(subs):
                hc = hcs[2 * i + j]
                a = hc.alpha
                logits = hc.b + torch.cat([a[0].expand(n), a[1].expand(n), a[2].expand(n * n)]) * (_z(Y) @ hc.W.T)
                pre, post = torch.sigmoid(logits[..., :n]), 2 * torch.sigmoid(logits[..., n:2 * n])
                E = logits[..., 2 * n:].unflatten(-1, (n, n)).exp()
                for _ in range(cfg.sinkhorn_iters):
                    E = E / E.sum(-1, keepdim=True)
                    E = E / E.sum(-2, keepdim=True)
                f = F_((pre[..., None] * Y).sum(-2))
                Y = torch.einsum("btij,btjd->btid", E, Y) + post[..., None] * f[..., None, :]
        ref = Y.mean(2)
    assert (out - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("arch", ["hyperloop", "mhc"])
def test_a_swapped_connection_changes_the_output(arch):
    """The references above can tell connections apart: with random coefficients, two
    connections exchanged give another output (so the equality is not a symmetry's)."""
    torch.manual_seed(2)
    over = dict(n_begin=1, n_end=1, n_loops=3) if arch == "hyperloop" else {}
    cfg = ModelConfig(arch=arch, d_model=D, n_heads=4, n_layers=4 if arch == "hyperloop" else 2, vocab_size=20,
                      **over)
    trunk = build_model(cfg).double().eval().trunk
    _randomise(trunk.hc, loop_embedding=arch == "hyperloop")
    x = torch.randn(B, T, D, dtype=torch.float64)
    with torch.no_grad():
        out = trunk(x, ForwardContext.at(cfg, 0, T, "cpu"))
        trunk.hc[0], trunk.hc[1] = trunk.hc[1], trunk.hc[0]
        swapped = trunk(x, ForwardContext.at(cfg, 0, T, "cpu"))
    assert (out - swapped).abs().max().item() > 1e-3
