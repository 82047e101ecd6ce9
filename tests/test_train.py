import json
import math

import pytest
import torch

from phaseloop import CheckpointError, ModelConfig, build_model
from phaseloop.engine import TrainConfig, lr_at, make_optimizer
from phaseloop.lm.train import train

CFG = ModelConfig.from_preset("rope-tiny", max_seq_len=32)


def tc(**kw):
    return TrainConfig(**{**dict(steps=20, batch_size=4, lr=3e-3, warmup_steps=4, eval_every=5,
                                 ckpt_every=5, log_every=1, eval_windows=4), **kw})


def records(run, key):
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if key in r:
            out.append((r["step"], r[key]))
    return out


def test_lr_schedule_warmup_then_cosine_to_floor():
    c = tc(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, c) == pytest.approx(0.1)
    assert lr_at(9, c) == pytest.approx(1.0)
    assert lr_at(10, c) == pytest.approx(1.0)
    assert lr_at(60, c) == pytest.approx(0.55)  # half way: floor + (1 - floor) / 2
    assert lr_at(110, c) == pytest.approx(0.1)
    assert all(lr_at(s, c) >= lr_at(s + 1, c) for s in range(10, 110))


def test_weight_decay_on_matrices_only():
    cfg = ModelConfig.from_preset("3pt-tiny")
    opt = make_optimizer(build_model(cfg), tc())
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"]) and len(no_decay["params"]) > 0
    assert opt.defaults["betas"] == (0.9, 0.95)


def _one_step(model, opt):
    """One optimiser step on fixed pseudo-random gradients (the same for every copy)."""
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    opt.step()


def test_weight_decay_on_every_parameter_with_decay_all():
    """decay="all": one group holding every parameter, θ and the norm gains included;
    a step equals torch's AdamW(model.parameters(), weight_decay=wd), and θ ends exactly
    lr * wd * θ0 below where decay="matrices" leaves it (the same Adam update)."""
    import copy

    from phaseloop.archs.three_phase import PhaseRMSNorm, PhaseRotation

    model = build_model(ModelConfig.from_preset("3pt-tiny")).double()
    c = tc(decay="all")
    (group,) = make_optimizer(model, c).param_groups
    ids = {id(p) for p in group["params"]}
    assert group["weight_decay"] == 0.1 and ids == {id(p) for p in model.parameters()}
    small = [m for m in model.modules() if isinstance(m, (PhaseRotation, PhaseRMSNorm))]
    assert small and all(id(p) in ids for m in small for p in m.parameters())

    a, b, m = (copy.deepcopy(model) for _ in range(3))
    _one_step(a, make_optimizer(a, c))
    _one_step(b, torch.optim.AdamW(b.parameters(), lr=c.lr, betas=(0.9, 0.95), eps=1e-8,
                                   weight_decay=0.1, foreach=True))
    _one_step(m, make_optimizer(m, tc(decay="matrices")))
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    for ra, rm, r0 in zip(*([x for x in mod.modules() if isinstance(x, PhaseRotation)] for mod in (a, m, model))):
        torch.testing.assert_close(ra.theta - rm.theta, -c.lr * 0.1 * r0.theta, rtol=1e-9, atol=1e-15)
        assert not torch.equal(rm.theta, r0.theta)  # the Adam update itself moved θ


def test_invalid_train_config_names_field():
    with pytest.raises(ValueError, match="batch_size"):
        tc(batch_size=0)
    with pytest.raises(ValueError, match="lr="):
        tc(lr=-1.0)


def test_training_reduces_loss_and_writes_run(tmp_path, text_file):
    run = tmp_path / "run"
    s = train(CFG, tc(steps=30), text_file, run, progress=False)
    losses = [v for _, v in records(run, "loss")]
    assert losses[-1] < losses[0] - 1.0
    assert s["finished"] and s["step"] == 30 and s["val_bpb"] == pytest.approx(s["val_loss"] / math.log(2))
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"] == CFG.to_dict() and cfg["data"]["fingerprint"] and cfg["train"]["steps"] == 30
    assert (run / "checkpoint" / "model.safetensors").exists()
    assert not list(run.glob(".checkpoint*"))  # no temp folders left behind
    assert json.loads((run / "summary.json").read_text())["step"] == 30


def test_grad_accumulation_equals_bigger_batch(tmp_path, text_file):
    """2 micro-batches of 2 give the same update as 1 batch of 4 only if the loss is
    averaged over micro-batches; compare the first step's parameters."""
    a = train(CFG, tc(steps=1, batch_size=4), text_file, tmp_path / "a", progress=False)
    b = train(CFG, tc(steps=1, batch_size=2, grad_accum=2), text_file, tmp_path / "b", progress=False)
    from safetensors.torch import load_file

    wa = load_file(tmp_path / "a" / "checkpoint" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "checkpoint" / "model.safetensors")
    # the batch sampler draws 4 starts vs 2+2 starts from the same generator: same windows
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6), k
    assert a["step"] == b["step"] == 1


@pytest.mark.parametrize("stop_after", [10, 12])  # exactly at a checkpoint / between checkpoints
def test_resume_matches_uninterrupted_run(tmp_path, text_file, stop_after):
    cfg = CFG.replace(dropout=0.1)  # dropout consumes the RNG: its state must be restored
    full = tmp_path / "full"
    train(cfg, tc(), text_file, full, progress=False)
    part = tmp_path / "part"
    s = train(cfg, tc(), text_file, part, progress=False, stop_after=stop_after)
    assert not s["finished"] and not (part / "summary.json").exists()
    train(cfg, tc(), text_file, part, resume=True, progress=False)
    for key in ("loss", "val_loss"):
        got, want = records(part, key), records(full, key)
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-6)


def test_resume_refuses_a_different_config(tmp_path, text_file):
    run = tmp_path / "run"
    train(CFG, tc(steps=5), text_file, run, progress=False)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(CheckpointError, match="different model config.*n_layers"):
        train(CFG.replace(n_layers=3), tc(steps=5), text_file, run, resume=True, progress=False)
    with pytest.raises(CheckpointError, match="different train config.*lr"):
        train(CFG, tc(steps=5, lr=1e-2), text_file, run, resume=True, progress=False)
    with pytest.raises(CheckpointError, match="already holds a run"):
        train(CFG, tc(steps=5), text_file, run, progress=False)
    other = tmp_path / "other.txt"
    other.write_text("different data " * 500)
    with pytest.raises(CheckpointError, match="other data"):
        train(CFG, tc(steps=5), other, run, resume=True, progress=False)
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert before == after


def test_resume_refuses_changed_author_switches_and_accepts_older_runs(tmp_path, text_file):
    """decay, loss_ignore_id, schedule and init change what is trained: a resume that
    changes one is refused by name; a run of an earlier version (no such keys) resumes at
    the defaults."""
    run = tmp_path / "run"
    train(CFG, tc(steps=2), text_file, run, progress=False)
    for model_cfg, c, what in ((CFG, tc(steps=2, decay="all"), "train config.*decay"),
                               (CFG, tc(steps=2, loss_ignore_id=0), "train config.*loss_ignore_id"),
                               (CFG, tc(steps=2, schedule="wsd"), "train config.*schedule"),
                               (CFG.replace(init="torch"), tc(steps=2), "model config.*init")):
        with pytest.raises(CheckpointError, match=f"different {what}"):
            train(model_cfg, c, text_file, run, resume=True, progress=False)
    saved = json.loads((run / "config.json").read_text())
    for section, key in (("train", "decay"), ("train", "loss_ignore_id"), ("model", "init"),
                         ("train", "optimizer"), ("train", "schedule"), ("train", "decay_fraction")):
        del saved[section][key]
    (run / "config.json").write_text(json.dumps(saved))
    manifest = run / "checkpoint" / "manifest.json"  # nor did its checkpoints record a digest of config.json
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items()
                                    if k != "config_sha256"}))
    assert train(CFG, tc(steps=2), text_file, run, resume=True, progress=False)["step"] == 2


def test_loss_ignore_id_in_an_lm_run(tmp_path, text_file):
    """The first logged loss of an LM run with loss_ignore_id = the space byte is the
    cross-entropy over the first batch's other targets, computed by hand."""
    from phaseloop.data import TrainBatches, load_corpus

    c = tc(steps=1, loss_ignore_id=ord(" "))
    train(CFG, c, text_file, tmp_path / "run", progress=False)
    (loss,) = [v for _, v in records(tmp_path / "run", "loss")]
    train_tok, _ = load_corpus(text_file).split(c.val_fraction, CFG.max_seq_len + 1)
    x, y = TrainBatches(train_tok, CFG.max_seq_len, c.batch_size, c.seed).next()
    torch.manual_seed(c.seed)
    with torch.no_grad():
        logp = build_model(CFG)(x).logits.log_softmax(-1)
    keep = y != ord(" ")
    assert 0 < (~keep).sum() < keep.sum()
    want = -logp.gather(-1, y[..., None])[..., 0][keep].mean()
    assert loss == pytest.approx(float(want), rel=1e-5)
    all_targets = -logp.gather(-1, y[..., None])[..., 0].mean()
    assert loss != pytest.approx(float(all_targets), rel=1e-3)


def test_resume_without_a_run_starts_it(tmp_path, text_file):
    """"Rerun with --resume until it is done" (preemptible jobs): with nothing to resume
    the run starts, and says so; it equals a run started without --resume."""
    notes = []
    s = train(CFG, tc(steps=5), text_file, tmp_path / "none", resume=True, progress=False, log=notes.append)
    assert notes == [f"note: {tmp_path / 'none'} holds no run yet; starting it"]
    ref = train(CFG, tc(steps=5), text_file, tmp_path / "ref", progress=False)
    assert s["val_loss"] == ref["val_loss"] and s["step"] == 5


def test_interrupted_checkpoint_swap_keeps_previous(tmp_path, text_file):
    """If the process dies between moving the old checkpoint aside and renaming the new
    one in, the old one is still found."""
    from phaseloop.engine.checkpoint import checkpoint_dir, load_run

    run = tmp_path / "run"
    train(CFG, tc(steps=5), text_file, run, progress=False)
    (run / "checkpoint").rename(run / ".checkpoint.old")
    assert checkpoint_dir(run) == run / ".checkpoint.old"
    model, _ = load_run(run)
    assert model.cfg == CFG


def test_checkpoint_of_an_earlier_version_loads(tmp_path):
    """Parameter names of earlier versions (the block's ``mid`` map, the embedding's
    ``horn``) are renamed on load: the same weights come back."""
    from safetensors.torch import save_file

    from phaseloop.engine.checkpoint import load_model_state

    cfg = ModelConfig.from_preset("3pt-tiny", learnable_horn=True)
    torch.manual_seed(0)
    src = build_model(cfg)
    old = {k.replace(".between.", ".mid.").replace("embed.options.horn.", "embed.horn."): v.clone()
           for k, v in src.state_dict().items()}
    assert any(".mid.theta" in k for k in old) and "embed.horn.gain" in old
    (tmp_path / "ckpt").mkdir()
    save_file(old, tmp_path / "ckpt" / "model.safetensors")
    torch.manual_seed(1)
    dst = build_model(cfg)
    load_model_state(dst, tmp_path / "ckpt")
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def test_resuming_a_finished_run_changes_nothing(tmp_path, text_file):
    run = tmp_path / "run"
    s = train(CFG, tc(steps=5), text_file, run, progress=False)
    files = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = train(CFG, tc(steps=5), text_file, run, resume=True, progress=False)
    assert again["val_loss"] == s["val_loss"] and again["step"] == 5
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def test_evaluate_leaves_ignored_targets_out():
    """evaluate(ignore_id=k): nats, tokens and bytes over the targets != k only, equal to
    the cross-entropy of the kept targets; the run's loss_ignore_id reaches it."""
    from phaseloop.data.tokenizer import ByteTokenizer
    from phaseloop.lm.train import evaluate

    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("rope-tiny", vocab_size=256, max_seq_len=16)).eval()
    windows = torch.randint(0, 8, (5, 17))  # ids 0..7: about 1 in 8 targets is 3
    full = evaluate(model, windows, ByteTokenizer(), batch_size=2)
    part = evaluate(model, windows, ByteTokenizer(), batch_size=2, ignore_id=3)
    y = windows[:, 1:]
    with torch.no_grad():
        logits = model(windows[:, :-1]).logits
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    keep = (y != 3).flatten()
    assert full["val_tokens"] == 80 and part["val_tokens"] == int(keep.sum()) < 80
    assert math.isclose(part["val_loss"], float(nll[keep].mean()), rel_tol=1e-5)
    assert math.isclose(full["val_loss"], float(nll.mean()), rel_tol=1e-5)
    assert math.isclose(part["val_bpb"], float(nll[keep].sum()) / (math.log(2) * int(keep.sum())), rel_tol=1e-5)
    assert part["val_tokens_per_byte"] == 1.0


def test_run_evaluates_without_ignored_targets(tmp_path, text_file):
    tc = TrainConfig(steps=2, batch_size=2, seq_len=16, eval_every=2, eval_windows=4, log_every=1,
                     ckpt_every=2, loss_ignore_id=ord("e"))
    cfg = ModelConfig.from_preset("rope-tiny", max_seq_len=16)
    s = train(cfg, tc, str(text_file), tmp_path / "run", progress=False)
    assert s["val_tokens"] < 4 * 16  # every 'e' target left out
