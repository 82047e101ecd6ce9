"""Experiment trackers (--log-to): TensorBoard's event files and the W&B offline run read
back equal metrics.jsonl, record for record, also across an interrupted and resumed run
(no step twice); the architectures' own quantities are in the evaluation records; a
missing package or an unknown tracker is a one-line error before anything is written."""

import json

import pytest
import torch
from conftest import TINY, assert_one_line, run_cli

from phaseloop import ModelConfig, build_model, registry
from phaseloop.engine import TrainConfig, read_metrics
from phaseloop.engine.trackers import IDS, scalars, wandb_files, wandb_history
from phaseloop.lm.train import train

CFG = ModelConfig.from_preset("3pt-tiny", max_seq_len=16)
TIMING = ("tok_per_s", "elapsed_s")  # differ between an interrupted process and its resumption


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def tc(**kw):
    return TrainConfig(**{**dict(steps=12, batch_size=2, lr=3e-3, warmup_steps=2, eval_every=3, ckpt_every=5,
                                 log_every=2, eval_windows=2, log_to="tensorboard,wandb"), **kw})


def by_key(records) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for r in records:
        for k, v in scalars(r).items():
            out.setdefault(k, []).append((r["step"], v))
    return {k: sorted(v) for k, v in out.items()}


def rows(records: list[dict]) -> list[dict]:
    """The records as W&B's history holds them: one row per step, the records of a step
    (training, evaluation) merged (their elapsed_s is the same)."""
    out: dict[int, dict] = {}
    for r in records:
        out.setdefault(r["step"], {}).update(r)
    return list(out.values())


def tensorboard(run) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


def wandb(run) -> dict[str, list[tuple[int, float]]]:
    run_id = json.loads((run / IDS).read_text())["wandb"]
    files = wandb_files(run, run_id)
    assert files
    out: dict[str, list] = {}
    for f in files:  # every process of the run, oldest first
        for step, row in wandb_history(f):
            for k, v in row.items():
                out.setdefault(k, []).append((step, v))
    return {k: sorted(v) for k, v in out.items()}


def assert_mirrors(got: dict, records: list[dict], skip=()):
    """Every metric of metrics.jsonl at the same steps (TensorBoard holds float32)."""
    want = by_key(records)
    assert set(got) == set(want)
    for k, pairs in want.items():
        if k in skip:
            assert [s for s, _ in got[k]] == [s for s, _ in pairs], k
            continue
        assert [s for s, _ in got[k]] == [s for s, _ in pairs], k
        assert [v for _, v in got[k]] == pytest.approx([v for _, v in pairs], rel=1e-6, abs=1e-7), k


def test_trackers_mirror_metrics_jsonl(tmp_path, text_file):
    run = tmp_path / "run"
    train(CFG, tc(), text_file, run, progress=False)
    records = read_metrics(run)
    assert any("three_phase/angle_drift/layer1" in r for r in records)  # the arch's quantities
    assert_mirrors(tensorboard(run), records)
    assert_mirrors(wandb(run), rows(records))


def test_a_resumed_run_continues_its_tracker_runs_without_a_step_twice(tmp_path, text_file):
    run = tmp_path / "run"  # stopped past the checkpoint of step 5: steps 6, 7 are logged twice
    train(CFG, tc(), text_file, run, progress=False, stop_after=7)
    ids = json.loads((run / IDS).read_text())
    train(CFG, tc(), text_file, run, resume=True, progress=False)
    assert json.loads((run / IDS).read_text()) == ids  # the same W&B run
    assert len(wandb_files(run, ids["wandb"])) == 2  # continued by the second process
    full = tmp_path / "full"
    train(CFG, tc(log_to=None), text_file, full, progress=False)
    records = read_metrics(run)
    got, want = by_key(records), by_key(read_metrics(full))  # still exact
    assert got.keys() == want.keys()
    for k in set(want) - set(TIMING):
        assert [s for s, _ in got[k]] == [s for s, _ in want[k]]
        assert [v for _, v in got[k]] == pytest.approx([v for _, v in want[k]], abs=1e-6), k
    assert_mirrors(tensorboard(run), records)  # the purge dropped steps 6, 7 of the first process
    assert_mirrors(wandb(run), rows(records), skip=TIMING)  # steps 6, 7 as the first process sent them
    assert not (full / "tensorboard").exists() and not (full / IDS).exists()


def test_log_to_in_a_config_file_and_resumed_with_other_trackers(tmp_path, text_file, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[train]\nlog_to = "tensorboard"\nsteps = 4\nlog_every = 2\neval_every = 2\nckpt_every = 2\n')
    out = tmp_path / "run"
    code, err = run_cli(["train", *TINY, "--config", cfg, "--data", text_file, "--out", out], capsys)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["train"]["log_to"] == "tensorboard"
    assert set(tensorboard(out)) == set(by_key(read_metrics(out)))
    code, err = run_cli(["train", *TINY, "--config", cfg, "--data", text_file, "--out", out, "--resume",
                         "--log-to", "wandb"], capsys)
    assert code == 0, err  # where metrics are mirrored is not part of the run
    assert not (out / "wandb").exists()  # the run was finished: nothing to log, nothing written


def test_unknown_tracker_and_missing_package_are_one_line_errors(tmp_path, text_file, capsys, monkeypatch):
    out = tmp_path / "run"
    code, err = run_cli(["train", *TINY, "--steps", "2", "--data", text_file, "--out", out,
                         "--log-to", "tensorbord"], capsys)
    assert_one_line(code, err, "unknown tracker 'tensorbord'")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    code, err = run_cli(["train", *TINY, "--steps", "2", "--data", text_file, "--out", out,
                         "--log-to", "tensorboard,wandb"], capsys)
    assert_one_line(code, err, "pip install 'phaseloop[track]'")
    assert "--log-to wandb needs the wandb package" in err
    assert not out.exists()  # refused before the run folder was made
    code, err = run_cli(["train", *TINY, "--steps", "2", "--data", text_file, "--out", out, "--log-to", ","],
                        capsys)
    assert_one_line(code, err, "log_to=',' names no tracker")


def test_a_damaged_tracker_ids_file_is_refused_before_the_run_changes(tmp_path, text_file, capsys):
    from conftest import snapshot

    run = tmp_path / "run"  # stopped past the checkpoint of step 5: resuming would drop the records of 6, 7
    train(CFG, tc(log_to="wandb"), text_file, run, progress=False, stop_after=7)
    (run / IDS).write_text("[")

    def files():  # W&B's own service may still be closing its debug log: the run's files
        return {k: v for k, v in snapshot(run).items() if not k.startswith("wandb/")}
    before = files()
    with pytest.raises(Exception, match="trackers.json is damaged"):
        train(CFG, tc(log_to="wandb"), text_file, run, resume=True, progress=False)
    assert files() == before and "metrics.jsonl" in before


def test_trackers_open_in_the_process_that_writes_the_run_only(tmp_path, text_file, monkeypatch):
    """Under torchrun, ranks > 0 have writes False: they open no tracker (rank 0 logs)."""
    from phaseloop.engine import trainer as trainer_mod

    opened = []
    real = trainer_mod.Trackers.open
    monkeypatch.setattr(trainer_mod.Trackers, "open",
                        classmethod(lambda cls, *a: opened.append(a) or real(*a)))
    monkeypatch.setattr(trainer_mod.Trainer, "writes", property(lambda self: False))
    train(CFG, tc(steps=2, ckpt_every=2), text_file, tmp_path / "run", progress=False)
    assert opened == []


# ------------------------------------------------------------------ the archs' own quantities
def test_3pt_angle_drift_per_layer():
    from phaseloop.archs.three_phase import PhaseRotation

    model = build_model(CFG)
    assert registry.diagnostics(model, {}) == {"three_phase/angle_drift/layer0": 0.0,
                                              "three_phase/angle_drift/layer1": 0.0}
    rot = [m for m in model.modules() if isinstance(m, PhaseRotation)]
    with torch.no_grad():
        rot[1].theta.add_(torch.linspace(-0.2, 0.2, rot[1].theta.numel()).reshape(rot[1].theta.shape))
    d = registry.diagnostics(model, {})
    assert d["three_phase/angle_drift/layer0"] == 0.0
    assert d["three_phase/angle_drift/layer1"] == pytest.approx(
        torch.linspace(-0.2, 0.2, rot[1].theta.numel()).abs().mean().item(), rel=1e-5)


def test_act_ponder_mean_spread_and_max_over_every_process():
    model = build_model(ModelConfig.from_preset("universal-act-tiny", max_seq_len=16))
    a, b = torch.tensor([[1.0, 2.0], [3.0, 1.5]]), torch.tensor([[2.5, 4.0]])
    d = registry.diagnostics(model, {"ponder_time": [a, b], "halting_probs": [torch.ones(3, 2, 2)]})
    allp = torch.tensor([1.0, 2.0, 3.0, 1.5, 2.5, 4.0], dtype=torch.float64)
    assert d == pytest.approx({"act/ponder_mean": allp.mean().item(), "act/ponder_std": allp.std(correction=0).item(),
                               "act/ponder_max": 4.0})
    assert registry.diagnostics(model, {"encoder_ponder_time": [a]})["act/encoder_ponder_mean"] == pytest.approx(1.875)


@pytest.mark.parametrize("over", [{}, {"hc_res": "sinkhorn"}, {"hc_dynamic": False}, {"hc_per_layer": True}])
def test_hyperloop_coefficients_per_loop(over):
    from phaseloop.archs.hyperconn import sinkhorn

    model = build_model(ModelConfig.from_preset("hyperloop-tiny", max_seq_len=16, **over))
    trunk, n = model.trunk, model.cfg.n_streams
    with torch.no_grad():
        for hc in trunk.hc:
            hc.b.normal_()
    d = registry.diagnostics(model, {})
    m = len(trunk.middle)
    for j, hc in enumerate(trunk.hc):
        name = f"hyperloop/loop{j // m}/layer{j % m}" if over.get("hc_per_layer") else f"hyperloop/loop{j}"
        b = hc.b.detach()
        assert d[f"{name}/pre_mean"] == pytest.approx(torch.sigmoid(b[:n]).mean().item(), rel=1e-6)
        assert d[f"{name}/post_mean"] == pytest.approx(2 * torch.sigmoid(b[n:2 * n]).mean().item(), rel=1e-6)
        res = torch.sigmoid(b[2 * n:]) if over.get("hc_res") != "sinkhorn" else \
            torch.diagonal(sinkhorn(b[2 * n:].reshape(n, n), hc.iters))
        assert d[f"{name}/res_diag_mean"] == pytest.approx(res.mean().item(), rel=1e-6)
        assert (f"{name}/alpha_res" in d) == (over.get("hc_dynamic", True))
    assert registry.diagnostics(build_model(ModelConfig.from_preset("rope-tiny")), {}) == {}
