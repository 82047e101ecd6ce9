"""--keep-checkpoints K / --keep-best: the last K checkpoints and the one of the lowest
validation loss are kept beside the resume point, each verified; the best one holds the
weights whose evaluation the record reports; a kill between writing a checkpoint and
keeping it (or mid-swap of the best) is mended on resume; the folders are read by eval."""

import json
import shutil

import pytest
import torch
from conftest import run_cli, snapshot
from safetensors.torch import load_file

from phaseloop import ModelConfig
from phaseloop.data import eval_windows, load_corpus
from phaseloop.engine import TrainConfig, read_metrics
from phaseloop.engine.checkpoint import TMP_PREFIX, load_run, verify_checkpoint
from phaseloop.engine.keep import ckpt_step, kept_steps
from phaseloop.errors import CheckpointError
from phaseloop.lm.train import evaluate, train

CFG = ModelConfig.from_preset("rope-tiny", max_seq_len=16)


def tc(**kw):
    return TrainConfig(**{**dict(steps=14, batch_size=2, lr=1e-2, warmup_steps=2, eval_every=3, ckpt_every=5,
                                 log_every=1, eval_windows=4, keep_checkpoints=3, keep_best=True), **kw})


def _best(run):
    evals = [(r["val_loss"], r["step"]) for r in read_metrics(run) if "val_loss" in r]
    return min(evals)


def _saves(run, t: TrainConfig) -> list[int]:
    """The steps a checkpoint was written at: every ckpt_every, the last, and each
    evaluation that improved on the best so far."""
    steps, best = set(range(t.ckpt_every, t.steps + 1, t.ckpt_every)) | {t.steps}, float("inf")
    for r in read_metrics(run):
        if "val_loss" in r and r["val_loss"] < best:
            best = r["val_loss"]
            steps.add(r["step"])
    return sorted(steps)


def test_last_k_and_the_best_are_kept_and_verified(tmp_path, text_file, capsys):
    run, t = tmp_path / "run", tc()
    train(CFG, t, text_file, run, progress=False)
    assert kept_steps(run) == _saves(run, t)[-3:]
    for s in kept_steps(run):
        verify_checkpoint(run / f"checkpoint-{s:08d}")
        assert ckpt_step(run / f"checkpoint-{s:08d}") == s
    last = run / f"checkpoint-{t.steps:08d}"
    assert (last / "model.safetensors").read_bytes() == (run / "checkpoint" / "model.safetensors").read_bytes()
    loss, step = _best(run)
    verify_checkpoint(run / "best")
    assert ckpt_step(run / "best") == step
    # the best folder holds the weights that evaluation scored: evaluated again, the same loss
    model, run_cfg = load_run(run / "best")
    corpus = load_corpus(str(text_file))
    _, val = corpus.split(t.val_fraction, CFG.max_seq_len + 1)
    again = evaluate(model, eval_windows(val, CFG.max_seq_len, t.eval_windows), corpus.tokenizer, t.batch_size)
    assert again["val_loss"] == pytest.approx(loss, rel=1e-6)
    code, err = run_cli(["eval", run / "best", "--json", "--windows", "2"], capsys)
    assert code == 0, err
    assert not any(p.name.startswith(TMP_PREFIX) or p.name == ".best.old" for p in run.iterdir())


def test_a_kill_between_a_checkpoint_and_its_keeping_is_mended_on_resume(tmp_path, text_file):
    t = tc()
    full, part = tmp_path / "full", tmp_path / "part"
    train(CFG, t, text_file, full, progress=False)
    train(CFG, t, text_file, part, progress=False, stop_after=10)
    step = ckpt_step(part / "checkpoint")
    assert step == 10 and 10 in kept_steps(part)
    # killed after the checkpoint of step 10 was swapped in, before it was kept, while the
    # best was being swapped (the previous best moved aside, the new one half-built)
    shutil.rmtree(part / "checkpoint-00000010")
    (part / "best").rename(part / ".best.old")
    (part / f"{TMP_PREFIX}half").mkdir()
    train(CFG, t, text_file, part, resume=True, progress=False)
    assert kept_steps(part) == kept_steps(full)
    assert ckpt_step(part / "best") == ckpt_step(full / "best")
    for name in ["best", *(f"checkpoint-{s:08d}" for s in kept_steps(full))]:
        verify_checkpoint(part / name)
        a, b = load_file(full / name / "model.safetensors"), load_file(part / name / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert not any(p.name.startswith(TMP_PREFIX) or p.name == ".best.old" for p in part.iterdir())


def test_keep_settings_may_change_on_resume_and_are_checked(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    train(CFG, tc(keep_checkpoints=1, keep_best=False, steps=10), text_file, run, progress=False, stop_after=5)
    assert kept_steps(run) == [] and not (run / "best").exists()
    train(CFG, tc(keep_checkpoints=2, keep_best=False, steps=10), text_file, run, resume=True, progress=False)
    assert kept_steps(run) == [5, 10]  # the resumed checkpoint kept first
    with pytest.raises(Exception, match="keep_checkpoints=0: must be a positive integer"):
        tc(keep_checkpoints=0)
    assert json.loads((run / "config.json").read_text())["train"]["keep_checkpoints"] == 1  # as first written


def test_a_damaged_or_blocked_best_is_refused_before_the_run_changes(tmp_path, text_file):
    """On resume with --keep-best: a file where the best folder (or its swap name) goes, or a
    best whose weights differ from its manifest, is refused by name before a step trains
    and before the run folder changes (a best never beaten again is never rewritten)."""
    part = tmp_path / "part"
    train(CFG, tc(steps=10), text_file, part, progress=False, stop_after=5)
    cases = [(lambda r: (r / ".best.old").write_text("hi"), r"\.best\.old is not a folder"),
             (lambda r: (r / ".best.old").symlink_to(r / "nowhere"), r"\.best\.old is not a folder"),
             (lambda r: (shutil.rmtree(r / "best"), (r / "best").write_text("hi")), r"best is not a folder"),
             (lambda r: (r / "best" / "model.safetensors").write_bytes(
                 (r / "best" / "model.safetensors").read_bytes()[:100]),
              "model.safetensors differs .*; restore best/ from a copy, .* or resume without --keep-best")]
    for i, (damage, pattern) in enumerate(cases):
        run = tmp_path / f"r{i}"
        shutil.copytree(part, run)
        damage(run)
        before = snapshot(run)
        with pytest.raises(CheckpointError, match=pattern):
            train(CFG, tc(steps=10), text_file, run, resume=True, progress=False)
        assert snapshot(run) == before
    # without --keep-best the best folder is not the run's business: the resume trains
    train(CFG, tc(steps=10, keep_best=False), text_file, run, resume=True, progress=False)
    assert ckpt_step(run / "checkpoint") == 10


def test_a_superseded_best_and_a_copy_named_like_a_kept_checkpoint_on_resume(tmp_path, text_file):
    """A kill after the new best came in and before the old one went leaves .best.old beside
    best/: the next resume removes it. A folder named like a kept checkpoint but not as
    --keep-checkpoints names them (a user's checkpoint-1) is neither counted nor removed."""
    t = tc()
    full, part = tmp_path / "full", tmp_path / "part"
    train(CFG, t, text_file, full, progress=False)
    train(CFG, t, text_file, part, progress=False, stop_after=10)
    shutil.copytree(part / "best", part / ".best.old")
    shutil.copytree(part / "checkpoint", part / "checkpoint-1")
    assert 1 not in kept_steps(part)
    train(CFG, t, text_file, part, resume=True, progress=False)
    assert not (part / ".best.old").exists() and ckpt_step(part / "best") == ckpt_step(full / "best")
    assert kept_steps(part) == kept_steps(full)
    verify_checkpoint(part / "checkpoint-1")
