"""Three-Phase Transformer (Abu Ayyash 2026): each of the five modifications, its
switch, and the presets."""

import math

import pytest
import torch

from phaseloop import ConfigError, ModelConfig, build_model
from phaseloop.analysis.params import count_params
from phaseloop.archs.three_phase import HornInjection, PhaseRMSNorm, PhaseRotation, zero_sum_diagnostic


def cfg3(**kw):
    return ModelConfig(**{**dict(arch="three_phase", vocab_size=64, d_model=48, n_layers=3,
                                 n_heads=6, n_kv_heads=3, d_ff=96, max_seq_len=32), **kw})


def givens_reference(x, theta, N):
    """Independent per-pair loop: phase i, pair k rotated by theta_k + 2*pi*i/N."""
    D = x.shape[-1]
    dp = D // N
    y = x.clone()
    for i in range(N):
        for k in range(dp // 2):
            a = theta[k] + 2 * math.pi * i / N
            c0, c1 = i * dp + 2 * k, i * dp + 2 * k + 1
            R = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=x.dtype)
            y[..., [c0, c1]] = x[..., [c0, c1]] @ R.T
    return y


@pytest.mark.parametrize("N", [1, 2, 3, 6])
def test_rotation_equals_explicit_givens_and_preserves_stripe_norms(N):
    cfg = cfg3(n_phases=N, phase_aligned_gqa=False, d_model=48, n_heads=6, n_kv_heads=6)
    pr = PhaseRotation(cfg, layer_idx=1, n_layers=3)
    with torch.no_grad():
        pr.theta.copy_(torch.randn_like(pr.theta))
    x = torch.randn(2, 5, 48)
    y = pr(x)
    assert torch.allclose(y, givens_reference(x, pr.theta.detach().tolist(), N), atol=1e-5)
    stripes = lambda t: t.unflatten(-1, (N, -1)).norm(dim=-1)
    assert torch.allclose(stripes(y), stripes(x), atol=1e-5)


def test_offsets_and_depth_linear_init():
    cfg = cfg3(n_layers=4)
    m = build_model(cfg)
    for layer_idx, layer in enumerate(m.trunk.layers):
        pr = layer.between
        assert isinstance(pr, PhaseRotation)
        assert torch.allclose(pr.offsets, torch.tensor([0, 2 * math.pi / 3, 4 * math.pi / 3]))
        assert torch.allclose(pr.theta, torch.full((8,), (layer_idx + 1) * math.pi / (2 * 4)))
        assert pr.theta.shape == (cfg.d_phase // 2,)


def test_rotation_sits_between_attention_and_ffn_not_residual():
    cfg = cfg3(n_layers=1)
    blk = build_model(cfg).trunk.layers[0]
    seen = {}
    blk.between.register_forward_hook(lambda mod, inp, out: seen.update(inp=inp[0], out=out))
    blk.ffn_norm.register_forward_pre_hook(lambda mod, inp: seen.update(ffn_in=inp[0]))
    from phaseloop.layers import ForwardContext, rope_tables

    x = torch.randn(1, 4, 48)
    cos, sin = rope_tables(torch.arange(4), cfg.head_dim, cfg.rope_base)
    y = blk(x, ForwardContext(cos, sin))
    h = x + blk.attn(blk.attn_norm(x), ForwardContext(cos, sin))
    assert torch.allclose(seen["inp"], h, atol=1e-6)
    assert torch.equal(seen["ffn_in"], seen["out"])
    assert torch.allclose(y, seen["out"] + blk.ffn(blk.ffn_norm(seen["out"])), atol=1e-6)
    # residual ablation: h + PR(h)
    res = PhaseRotation(cfg3(residual_rotation=True), 0, 1)
    plain = PhaseRotation(cfg3(), 0, 1)
    assert torch.allclose(res(x), x + plain(x), atol=1e-6)


@pytest.mark.parametrize("start", [0, 7])
def test_horn_sets_channel_mean_and_keeps_orthogonal_directions(start):
    horn = HornInjection(cfg3())
    x = torch.randn(2, 6, 48) * 3 + 0.5
    y = horn(x, start_pos=start)
    t = torch.arange(start, start + 6, dtype=torch.float32)
    assert torch.allclose(y.mean(-1), (1 / (t + 1)).expand(2, 6), atol=1e-6)
    centred = lambda v: v - v.mean(-1, keepdim=True)
    assert torch.allclose(centred(y), centred(x), atol=1e-5)


def test_learnable_horn_gain_scales_the_mean():
    """r(t) = g / (t + 1) with the learned gain g (ours), at a gain away from its init of 1."""
    horn = HornInjection(cfg3(learnable_horn=True))
    with torch.no_grad():
        horn.gain.fill_(0.5)
    y = horn(torch.randn(2, 4, 48) * 3, start_pos=2)
    assert torch.allclose(y.mean(-1), (0.5 / torch.arange(3.0, 7.0)).expand(2, 4), atol=1e-6)


def test_horn_is_on_the_embedding_output_at_absolute_positions():
    m = build_model(cfg3())
    idx = torch.randint(0, 64, (1, 5))
    assert torch.allclose(m.embed(idx, start_pos=10).mean(-1), 1 / torch.arange(11.0, 16.0), atol=1e-6)
    assert not any(isinstance(mod, HornInjection) for mod in m.trunk.modules())  # once, not per block


def test_zero_sum_diagnostic_after_injection():
    T, N = 64, 3
    y = HornInjection(cfg3())(torch.randn(4, T, 48))
    H_T = sum(1 / k for k in range(1, T + 1))
    assert zero_sum_diagnostic(y, N) == pytest.approx(N * H_T / T, rel=1e-5)


def test_phase_norm_equals_independent_rmsnorms():
    N, D = 3, 48
    pn = PhaseRMSNorm(D, N, eps=1e-6)
    with torch.no_grad():
        pn.weight.copy_(torch.randn(D))
    x = torch.randn(2, 5, D)
    refs = []
    for i in range(N):
        ref = torch.nn.RMSNorm(D // N, eps=1e-6)
        with torch.no_grad():
            ref.weight.copy_(pn.weight[i * D // N:(i + 1) * D // N])
        refs.append(ref(x[..., i * D // N:(i + 1) * D // N]))
    assert torch.allclose(pn(x), torch.cat(refs, -1), atol=1e-5)
    assert sum(p.numel() for p in pn.parameters()) == D


def test_phase_norm_at_every_norm_site():
    m = build_model(cfg3())
    norms = [m.norm] + [n for layer in m.trunk.layers for n in (layer.attn_norm, layer.ffn_norm)]
    assert all(isinstance(n, PhaseRMSNorm) for n in norms)


@pytest.mark.parametrize("twin, tp", [("rope-123m", "3pt-123m"), ("rope-5.5m", "3pt-5.5m"),
                                      ("rope-tiny", "3pt-tiny"), ("rope-small", "3pt-small")])
def test_3pt_presets_exceed_twins_by_L_dphase_over_2(twin, tp):
    a, b = ModelConfig.from_preset(twin), ModelConfig.from_preset(tp)
    assert (a.d_model, a.n_layers, a.n_heads, a.n_kv_heads, a.d_ff, a.vocab_size) == \
           (b.d_model, b.n_layers, b.n_heads, b.n_kv_heads, b.d_ff, b.vocab_size)
    assert b.n_phases == 3 and not b.embed_scale
    diff = count_params(b)["total"] - count_params(a)["total"]
    assert diff == b.n_layers * b.d_phase // 2
    if tp == "3pt-123m":
        assert diff == 1536  # the paper's figure


@pytest.mark.parametrize("kw, msg", [
    (dict(n_phases=5), "must divide d_model"),
    (dict(n_phases=16, d_model=48, n_heads=6, n_kv_heads=6, phase_aligned_gqa=False), "even"),
    (dict(n_phases=2, n_heads=6, n_kv_heads=3), "phase-aligned GQA"),
    (dict(arch="rope", learnable_offsets=True), "phase_rotation"),
    (dict(arch="rope", learnable_horn=True), "horn"),
])
def test_invalid_phase_configs(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        cfg3(**kw)


def test_n1_is_valid_and_a_plain_rotation():
    cfg = cfg3(n_phases=1)
    pr = build_model(cfg).trunk.layers[0].between
    assert torch.allclose(pr.offsets, torch.zeros(1))


# ---------------------------------------------------------------------------- ablation switches
def _keys(cfg):
    return {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()}


@pytest.mark.parametrize("switch, added, removed", [
    ("phase_rotation", set(), {f"trunk.layers.{i}.between.theta" for i in range(3)}),
    ("horn", set(), set()),
    ("phase_norm", set(), set()),
    ("phase_aligned_gqa", set(), set()),
])
def test_each_switch_changes_only_its_part(switch, added, removed):
    on = cfg3()
    off = on.replace(**{switch: False})
    k_on, k_off = _keys(on), _keys(off)
    assert set(k_off) == set(k_on) - removed | added
    m_on, m_off = build_model(on), build_model(off)
    if switch == "phase_rotation":
        assert all(isinstance(layer.between, torch.nn.Identity) for layer in m_off.trunk.layers)
        assert isinstance(m_off.norm, PhaseRMSNorm) and "horn" in m_off.embed.options
    if switch == "horn":
        assert "horn" not in m_off.embed.options and isinstance(m_off.trunk.layers[0].between, PhaseRotation)
    if switch == "phase_norm":
        assert not isinstance(m_off.norm, PhaseRMSNorm) and "horn" in m_off.embed.options
        assert isinstance(m_off.trunk.layers[0].between, PhaseRotation)
    if switch == "phase_aligned_gqa":  # only relaxes validation: N=2 with 3 kv heads allowed
        cfg3(phase_aligned_gqa=False, n_phases=2)
        assert k_on == k_off
    # with identical weights, the outputs differ (the switch does something)
    sd = {k: v for k, v in m_on.state_dict().items() if k in k_off}
    m_off.load_state_dict(sd, strict=False)
    idx = torch.randint(0, 64, (1, 8))
    if switch != "phase_aligned_gqa":
        assert not torch.allclose(m_on(idx).logits, m_off(idx).logits)


def test_extra_ablation_switches():
    base = cfg3()
    n_base = sum(p.numel() for p in build_model(base).parameters())
    lo = build_model(base.replace(learnable_offsets=True))
    assert sum(p.numel() for p in lo.parameters()) == n_base + 3 * base.n_phases
    assert isinstance(lo.trunk.layers[0].between.offsets, torch.nn.Parameter)
    lh = build_model(base.replace(learnable_horn=True))
    assert sum(p.numel() for p in lh.parameters()) == n_base + 1
    assert build_model(base.replace(residual_rotation=True)).trunk.layers[0].between.residual
    # the sqrt(d) embedding factor is its own switch
    assert build_model(base.replace(embed_scale=True)).embed.scale == pytest.approx(math.sqrt(48))


def test_phase_structure_composes_with_the_rope_arch():
    """The five options are block/embedding options: any trunk can switch them on."""
    cfg = ModelConfig(arch="rope", vocab_size=64, d_model=48, n_layers=2, n_heads=6, n_kv_heads=3,
                      d_ff=96, n_phases=3, phase_rotation=True, phase_norm=True, horn=True)
    m = build_model(cfg)
    assert isinstance(m.trunk.layers[1].between, PhaseRotation) and isinstance(m.norm, PhaseRMSNorm)


# ---------------------------------------------------------------------------- analysis commands
def test_angle_drift_and_zero_sum_commands(tmp_path, text_file, capsys):
    import json

    from phaseloop.cli import main

    run = tmp_path / "run"
    assert main(["train", "--preset", "3pt-tiny", "--steps", "8", "--batch-size", "2", "--warmup", "2",
                 "--eval-windows", "2", "--data", str(text_file), "--out", str(run), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["angles", str(run)]) == 0
    rows = json.loads((run / "angle_drift.json").read_text())
    assert [r["layer"] for r in rows] == [0, 1]
    assert rows[0]["init"] == pytest.approx(math.pi / 4) and rows[1]["init"] == pytest.approx(math.pi / 2)
    assert all(r["mean_abs_drift"] > 0 for r in rows)  # 8 AdamW steps moved the angles
    assert (run / "angle_drift.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["zero-sum", str(run), "--windows", "2"]) == 0
    out = capsys.readouterr().out
    H = sum(1 / k for k in range(1, 65))
    emb = float(out.split("embedding")[1].split()[0])
    assert emb == pytest.approx(3 * H / 64, abs=1e-4)
    assert f"N=3, T=64 (horn value N*H_T/T = {3 * H / 64:.4f})" in out
    # a PNG path that is a folder: refused before anything is written; a checkpoint: its run's files
    (run / "angle_drift.json").unlink()
    assert main(["angles", str(run), "--png", str(tmp_path)]) == 2
    assert "is a folder; name the PNG file" in capsys.readouterr().err
    assert not (run / "angle_drift.json").exists()
    assert main(["angles", str(run / "checkpoint")]) == 0
    assert (run / "angle_drift.json").is_file() and not (run / "checkpoint" / "angle_drift.json").exists()
    capsys.readouterr()
    assert main(["zero-sum", str(run), "--seq-len", "1000"]) == 2  # as eval: within max_seq_len
    assert "seq_len 1000 is longer than the model's max_seq_len 64" in capsys.readouterr().err


def test_angles_on_a_model_without_rotation(tmp_path, text_file, capsys):
    from phaseloop.cli import main

    run = tmp_path / "run"
    main(["train", "--preset", "rope-tiny", "--steps", "2", "--batch-size", "2", "--eval-windows", "1",
          "--seq-len", "16", "--data", str(text_file), "--out", str(run), "--quiet"])
    capsys.readouterr()
    assert main(["angles", str(run)]) == 2
    assert "no phase rotation" in capsys.readouterr().err
    # zero-sum measures any run: at its trained windows (16, not max_seq_len 64), no horn value
    # where it has none, over any number of stripes that tiles d_model (not only the heads')
    assert main(["zero-sum", str(run), "--windows", "1", "--phases", "4"]) == 0
    assert "N=4, T=16 (no horn)" in capsys.readouterr().out
    assert main(["zero-sum", str(run), "--windows", "1", "--phases", "5"]) == 2
    assert "5 stripes do not tile d_model=96" in capsys.readouterr().err


# ---------------------------------------------------------------------------- as the author trained it
def test_torch_init_is_pytorchs_nn_linear_default():
    """init="torch": each linear layer drawn exactly as nn.Linear's own constructor draws
    it (same seed, same weight and bias), U(±1/sqrt(fan_in)) everywhere: no depth scaling
    of the residual projections, the head too. init="normal" (default) keeps N(0, 0.02)
    with the residual projections at 0.02/sqrt(2L)."""
    from torch import nn

    from phaseloop.layers import init_weights

    lin = nn.Linear(48, 96)
    torch.manual_seed(5)
    init_weights(lin, cfg3(init="torch"), 3)
    torch.manual_seed(5)
    ref = nn.Linear(48, 96)
    assert torch.equal(lin.weight, ref.weight) and torch.equal(lin.bias, ref.bias)

    torch.manual_seed(0)
    m = build_model(cfg3(init="torch", embed_init_std=1.0))
    linears = {n: mod for n, mod in m.named_modules() if isinstance(mod, nn.Linear)}
    assert {"head", "trunk.layers.0.attn.o_proj", "trunk.layers.2.ffn.down"} <= set(linears)
    for name, mod in linears.items():
        w, bound = mod.weight.detach(), 1 / math.sqrt(mod.in_features)
        assert w.abs().max() <= bound, name
        assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1), name
    assert m.embed.tok.weight.std().item() == pytest.approx(1.0, rel=0.05)  # embed_init_std, not init

    torch.manual_seed(0)
    n = build_model(cfg3())
    assert n.cfg.init == "normal"
    assert n.trunk.layers[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert n.trunk.layers[0].attn.o_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(6), rel=0.1)


def test_invalid_init_names_the_field_and_choices():
    with pytest.raises(ConfigError, match=None) as ei:
        cfg3(init="xavier")
    assert "init='xavier': choose normal" in str(ei.value) and "torch" in str(ei.value)


def test_3pt_paper_recipe_uses_the_authors_settings():
    """recipes/3pt_paper.toml loads; every variant has PyTorch's default init and N(0, 1)
    embedding, the baseline its sqrt(d) factor; training decays every parameter and
    ignores the pad id, with the paper's betas, wd, clip and floor."""
    from pathlib import Path

    from phaseloop.compare import load_recipe, plan_variants
    from phaseloop.data.tokenizer import PAD

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "3pt_paper.toml")
    tc = recipe.train_config(0)
    assert (tc.decay, tc.loss_ignore_id, tc.weight_decay, tc.beta1, tc.beta2, tc.grad_clip,
            tc.min_lr_ratio) == ("all", PAD, 0.1, 0.9, 0.95, 1.0, 0.1)
    plan = {p.name: p.cfg for p in plan_variants(recipe, 256)}
    assert set(plan) == {"rope (paper baseline)", "3pt N=3", "3pt N=1"}
    assert recipe.reference == "rope (paper baseline)"
    for name, cfg in plan.items():
        assert (cfg.init, cfg.embed_init_std, cfg.dropout, cfg.tie_embeddings) == ("torch", 1.0, 0.0, False), name
    base = plan["rope (paper baseline)"]
    assert base.arch == "rope" and base.embed_scale and not base.phase_rotation
    for name, N in (("3pt N=3", 3), ("3pt N=1", 1)):
        cfg = plan[name]
        assert cfg.arch == "three_phase" and cfg.n_phases == N and not cfg.embed_scale
        assert cfg.horn and cfg.phase_rotation and cfg.phase_norm


def test_horn_zero_sum_closed_form_equals_the_diagnostic():
    """N·H_T/T (0.0220 for N = 3, T = 1024) is the zero-sum diagnostic of the horn's
    output on any input (the injection sets the all-ones component to r(t))."""
    from phaseloop.archs.three_phase import horn_zero_sum

    assert round(horn_zero_sum(3, 1024), 4) == 0.0220
    horn = HornInjection(cfg3())
    x = torch.randn(2, 1024, 48, dtype=torch.float64)
    assert abs(zero_sum_diagnostic(horn(x), 3) - horn_zero_sum(3, 1024)) < 1e-12
