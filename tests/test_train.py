import json
import math

import pytest
import torch

from phaseloop import CheckpointError, ModelConfig
from phaseloop.engine import TrainConfig, lr_at, make_optimizer
from phaseloop.train import train
from phaseloop import build_model

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
    from phaseloop.checkpoint import checkpoint_dir, load_run

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

    from phaseloop.checkpoint import load_model_state

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
