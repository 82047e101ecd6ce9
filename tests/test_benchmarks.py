"""The benchmark scripts run (tiny shapes) so they never rot; their figures are measured
by running them, never asserted here."""

import json
import sys
from pathlib import Path

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
