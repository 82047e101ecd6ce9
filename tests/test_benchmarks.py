"""The benchmark scripts run (tiny shapes) so they never rot; their figures are measured
by running them, never asserted here."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from phaseloop.models import build_model

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def test_gpu_check_smoke_runs_on_cpu(tmp_path, one_thread):
    import gpu_check

    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["model"], r["mode"]) for r in res["throughput"]] == [
        ("rope-tiny", "eager"), ("rope-tiny", "compiled"), ("3pt-tiny", "eager"), ("3pt-tiny", "compiled")]
    assert set(res["ratios"]) == {"3pt/rope N=3", "3pt/rope N=12", "hyperloop/looped", "mhc/transformer"}
    assert res["generate_tok_per_s"] > 0 and res["loss_check"]["tracks"]


def test_bench_step_runs(capsys, one_thread):
    import bench_step

    assert bench_step.main(["--shapes", "nanogpt", "--archs", "rope", "--rounds", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "nanogpt    rope" in out and "rope/gpt2 step" in out


@pytest.mark.parametrize("mode", ["block", "pieces"])
def test_bench_step_compile_mode_runs(capsys, one_thread, mode):
    import bench_step

    assert bench_step.main(["--compile", mode, "--shapes", "rope-tiny", "--archs", "rope", "--rounds", "1",
                            "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert f"compile {mode}" in out and "compiled/floor" in out and "rope-tiny  rope" in out


def test_bench_step_pieces_compute_the_plain_forms():
    """The compiled pieces (RMSNorm, RoPE on q and k together) swapped into a model give its
    eager loss and gradients (inductor: float tolerance)."""
    import bench_step

    counters.clear()
    torch.manual_seed(0)
    cfg = bench_step.config("rope-tiny", "rope")
    model, twin = build_model(cfg), build_model(cfg)
    twin.load_state_dict(model.state_dict())
    twin, loss_of = bench_step.compiled(twin, "pieces")
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    for m in (model, twin):
        (model(x, x).loss if m is model else loss_of(x, x)).backward()
    assert torch.allclose(model(x, x).loss, loss_of(x, x), rtol=1e-5)
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), n
    assert counters["stats"]["unique_graphs"] >= 2  # the RMSNorm and the RoPE function ran compiled


def test_bench_documents_runs(capsys, one_thread):
    import bench_documents

    assert bench_documents.main(["--d-model", "24", "--layers", "1", "--heads", "3", "--batch", "2", "--seq", "16",
                                 "--doc-len", "4", "--rounds", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "both/plain" in out and out.count("\n") == 4  # header, columns, rope, three_phase


def test_claim_act_runs(tmp_path, capsys, one_thread):
    import claim_act

    claim_act.main(["--seeds", "0", "--steps", "4", "--fixed", "1", "--weights", "0.01", "--lengths", "1-3",
                    "--n-test", "3", "--threads", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Spearman rho(L, answer ponder)" in out and "needed T" in out
    run = json.loads((tmp_path / "act_w0.01_b1.0-s0.json").read_text())
    assert set(run["per_length"]) == {"1", "2", "3"} and 1.0 <= run["per_length"]["2"]["ponder"] <= 9.0
    assert claim_act.spearman([1, 2, 3], [2.0, 2.5, 4.0]) == 1.0


def test_claim_hyperloop_table_pairs_seeds(tmp_path):
    import claim_hyperloop

    for seed, shift in ((0, 0.0), (1, 0.01), (2, -0.005)):
        for i, arch in enumerate(claim_hyperloop.ARCHS):
            d = tmp_path / f"{arch}-s{seed}"
            d.mkdir()
            bpb = 3.0 + 0.1 * i + shift + 0.001 * seed * i
            (d / "claim.json").write_text(json.dumps({
                "arch": arch, "seed": seed, "params": 1000 * (i + 1), "bpb_eval": bpb, "bpb_rtn4": bpb + 0.01,
                "bpb_gptq4": bpb + 0.005, "tok_per_s": 100.0, "bytes_fp32": 4e6, "bytes_gptq4": 1e6}))
    out = claim_hyperloop.table(tmp_path)
    assert "transformer -> hyperloop: +0.3030 BPB" in out  # 0.3 + 0.003 * seed, mean over seeds 0-2
    assert "over 3 seeds" in out and "worse" in out


def test_bench_trackers_runs(capsys, one_thread, monkeypatch):
    import bench_trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert bench_trackers.main(["--preset", "rope-tiny", "--batch", "2", "--seq", "8", "--log-every", "2",
                                "--rounds", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{k} " in out for k in ("none", "tensorboard", "wandb", "both"))


def test_bench_grid_runs(capsys):
    import bench_grid

    assert bench_grid.main(["--steps", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 workers x 1 thread" in out and "wall-clock ratio sequential / local" in out


def test_bench_serve_runs(capsys, one_thread):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    import bench_serve

    assert bench_serve.main(["--models", "tiny", "--clients", "1,2", "--requests", "1", "--max-tokens", "3",
                             "--rounds", "1", "--max-batch", "4", "--threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 4 and all(line.split("|")[8].strip() == "0" for line in rows)  # 0 errors
