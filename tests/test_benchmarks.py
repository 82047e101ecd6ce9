"""The benchmark scripts run (tiny shapes) so they never rot; their figures are measured
by running them, never asserted here."""

import importlib.util
import json
import os
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
    assert set(res["generate"]) == {"rope full", "looped full", "looped exit", "looped speculative"}
    assert all(v["tok_per_s"] > 0 for v in res["generate"].values())
    assert res["generate"]["looped speculative"]["greedy_equal"] and res["generate"]["looped exit"]["mean_passes"] > 0
    assert res["loss_check"]["learns"] and res["loss_check"]["tracks"]


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


def test_bench_stream_text_runs(capsys):
    pytest.importorskip("tokenizers")
    import bench_stream_text

    assert bench_stream_text.main(["--lengths", "8,16", "--rounds", "1", "--vocab", "300"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| b")]
    assert [r.split("|")[1:3] for r in rows] == [[" bytes ", " 8 "], [" bytes ", " 16 "], [" bpe-300 ", " 8 "],
                                                 [" bpe-300 ", " 16 "]]


def test_bench_adaptive_runs(capsys, one_thread, tmp_path):
    import bench_adaptive

    out = tmp_path / "adaptive.json"
    assert bench_adaptive.main(["--models", "looped-tiny", "--rounds", "1", "--warmup", "0", "--decode", "3",
                                "--prefill", "12", "--windows", "2", "--seq", "12", "--json", str(out)]) == 0
    rows = {r["row"].split(":")[0].split(" ")[0]: r for r in json.loads(out.read_text())[0]["rows"]}
    assert {"full", "pass", "kl", "kl-lens", "entropy", "state", "kv-share", "speculative"} <= set(rows)
    assert rows["speculative"]["greedy_identical"] and "| full |" in capsys.readouterr().out


def test_bench_deploy_executorch_runs(tmp_path, capsys, one_thread):
    """The ExecuTorch rows at one layer on the portable kernels (the table's own rows export
    with XNNPACK, minutes each): export, the check, eager and the file in their own processes."""

    if not os.environ.get("CI"):  # CI installs the deploy extra
        pytest.importorskip("executorch")
    import bench_deploy

    assert bench_deploy.main(["executorch", "--rows", "rope-tiny-L1", "--shapes", "small", "--engines",
                              "eager,fp32", "--rounds", "1", "--prompt", "8", "--new", "4", "--backend", "portable",
                              "--cache", str(tmp_path), "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert "| rope-tiny-L1 | small | 0.15M | fp32 |" in out and "max|d|" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["engine"] for r in rows] == ["eager", "fp32"] and rows[1]["decode_vs_eager"] > 0


def test_bench_deploy_smoke_runs(capsys, tmp_path, one_thread):
    """Every engine that can run here, one process each, on rope-tiny: the table, its
    floors and the greedy-token comparison (transformers' Llama computes phaseloop's logits)."""
    import bench_deploy

    out_json = tmp_path / "deploy.json"
    assert bench_deploy.main(["--smoke", "--work", str(tmp_path / "w"), "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "| engine | weight MB | RSS MB: running (peak) | decode tok/s | floor tok/s |" in out
    assert "| batch | row-major ms | column-major ms | prepacked ms |" in out and "\n| 4 | " in out
    rows = json.loads(out_json.read_text())["shapes"]["rope-tiny"]
    assert {"phaseloop-fp32", "phaseloop-int8", "phaseloop-int4", "transformers"} <= set(rows)
    assert rows["transformers"]["same_tokens"] and rows["phaseloop-int4"]["weight_bytes"] < \
        0.4 * rows["phaseloop-fp32"]["weight_bytes"]
    # `generate --compile`'s step: phaseloop's greedy tokens, its compile reported apart
    assert rows["phaseloop-compiled-fp32"]["same_tokens"] and "compile (once per process" in out
    assert all(r["decode_tok_s"] > 0 and r["floor_tok_s"] > 0 for k, r in rows.items() if k != "ratios")
    if os.environ.get("CI") or importlib.util.find_spec("executorch"):  # CI installs the deploy extra
        # the run's own .pte in ExecuTorch's runtime: phaseloop's greedy tokens (fp32), fewer bytes
        assert rows["executorch-fp32"]["same_tokens"], rows["executorch-fp32"]
        assert rows["executorch-int4"]["weight_bytes"] < rows["executorch-fp32"]["weight_bytes"]
    for bits in ("int8", "int4"):  # `quantize --head`: the head packed too, fewer bytes read per token
        body, both = rows[f"phaseloop-{bits}"], rows[f"phaseloop-{bits}-head"]
        assert both["weight_bytes"] < body["weight_bytes"] and both["floor_tok_s"] > body["floor_tok_s"]
