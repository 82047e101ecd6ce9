"""Format compatibility: what phaseloop 0.1.0 wrote still loads and computes what 0.1.0
computed from it.

tests/fixtures/compat/ holds files written by phaseloop 0.1.0 (commit f9e29c7) with
tests/fixtures/make_compat_fixtures.py: a tiny run folder per architecture (a 6-step run
interrupted after step 4: config.json, metrics.jsonl, checkpoint/), Hugging Face exports
of two of them, a finished two-variant comparison folder, and EXPECTED.json, the numbers
0.1.0 computed from them. Never regenerate them with the code under test (that would
compare it with itself); a deliberate format break needs a migration, or new fixtures
beside these and a note in the changelog.

Every test works on a copy in tmp_path (the fixtures are never written) and runs its
commands from the repository root, where the runs' relative data spec
(tests/fixtures/compat/corpus.txt) resolves. CLI calls go through ``phaseloop.cli.main``
in this process (a fresh interpreter per call costs ~3 s on 2 cores); the comparison,
which exercises the most code, runs as ``python -m phaseloop`` in a subprocess.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import phaseloop
from phaseloop.cli import main
from phaseloop.engine.checkpoint import load_run

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "compat"
EXPECTED = json.loads((FIX / "EXPECTED.json").read_text())
LM = sorted(EXPECTED["lm"])
HF = sorted(EXPECTED["hf"])
REL = 1e-5  # eval / resumed losses (exact on CPU in practice)
ATOL = 1e-5  # logits

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def at_repo(monkeypatch):
    """Commands run from the repository root (the runs' data spec is relative to it)."""
    monkeypatch.chdir(REPO)
    return REPO


def copy_of(rel: str, tmp_path: Path) -> Path:
    dst = tmp_path / rel.replace("/", "-")
    shutil.copytree(FIX / rel, dst)
    return dst


def input_ids() -> torch.Tensor:
    return torch.tensor([list(EXPECTED["input_text"].encode())], dtype=torch.long)


def check_logits(logits: torch.Tensor, want: dict, what: str) -> None:
    x = logits.detach().double()[0]
    assert list(logits.shape) == want["shape"], what
    for t, first in want["first"].items():
        torch.testing.assert_close(x[int(t), :len(first)], torch.tensor(first, dtype=torch.float64),
                                   atol=ATOL, rtol=0, msg=lambda m, t=t: f"{what}, position {t}: {m}")
    n = x.numel()
    for key, val in (("sum", x.sum()), ("abs_sum", x.abs().sum()), ("sq_sum", (x * x).sum())):
        # each value within ATOL moves a sum by at most n * ATOL; in practice far less
        assert val.item() == pytest.approx(want[key], rel=REL, abs=ATOL * math.sqrt(n)), f"{what}: {key}"
    top2 = x.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 10 * ATOL  # argmax only where it is no near tie
    got, exp = x.argmax(-1), torch.tensor(want["argmax"])
    assert torch.equal(got[clear], exp[clear]), f"{what}: argmax"


def approx(want: float):
    return pytest.approx(want, rel=REL)


def test_fixtures_are_those_of_0_1_0():
    """Guard against regenerating them with the code under test."""
    g = EXPECTED["generated_by"]
    assert (g["phaseloop"], g["commit"][:7]) == ("0.1.0", "f9e29c7")
    assert sorted(LM) == sorted(["rope", "three_phase", "universal", "universal_act", "looped",
                                 "hyperloop", "mhc"])


# ---------------------------------------------------------------------------- run folders
@pytest.mark.parametrize("name", LM)
def test_load_run_logits(name, tmp_path):
    exp = EXPECTED["lm"][name]
    model, run_cfg = load_run(copy_of(f"lm/{name}", tmp_path))
    assert model.cfg.arch == run_cfg["model"]["arch"]
    assert sum(p.numel() for p in model.parameters()) == exp["params"]
    with torch.no_grad():
        check_logits(model(input_ids()).logits, exp["logits"], f"lm/{name}")
    # the checkpoint folder itself loads too
    model2, _ = load_run(tmp_path / f"lm-{name}" / "checkpoint")
    with torch.no_grad():
        assert torch.equal(model2(input_ids()).logits, model(input_ids()).logits)


@pytest.mark.parametrize("name", LM)
def test_eval(name, tmp_path, at_repo, capsys):
    exp = EXPECTED["lm"][name]["eval"]
    run = copy_of(f"lm/{name}", tmp_path)
    assert main(["eval", str(run), "--json", "--windows", str(EXPECTED["eval_windows"]),
                 "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    for k in ("val_loss", "val_bpb", "val_ppl"):
        assert got[k] == approx(exp[k]), k
    for k in ("val_tokens", "windows", "seq_len", "split", "fingerprint"):
        assert got[k] == exp[k], k


@pytest.mark.parametrize("name", LM)
def test_resume_continues_exactly(name, tmp_path, at_repo, capsys):
    """config.json (model, train and data sections), the checkpoint's weights, optimiser,
    RNG and data-position state: resuming the interrupted run gives 0.1.0's steps 5-6."""
    exp = EXPECTED["lm"][name]["resume"]
    run = copy_of(f"lm/{name}", tmp_path)
    assert main(["train", "--out", str(run), "--resume", "--quiet"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["step"] == exp["summary"]["step"] == EXPECTED["train"]["steps"]
    assert got["params"] == exp["summary"]["params"]
    for k in ("val_loss", "val_bpb"):
        assert got[k] == approx(exp["summary"][k]), k
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    new = [r for r in records if r["step"] > EXPECTED["stop_after"]]
    assert [sorted(r) for r in exp["records"]] == [sorted(k for k in r if k in exp["records"][i])
                                                    for i, r in enumerate(new)]
    for want, r in zip(exp["records"], new):
        for k, v in want.items():
            assert r[k] == (v if isinstance(v, int) else approx(v)), (r["step"], k)
    assert (run / "summary.json").is_file()


# ---------------------------------------------------------------------------- Hugging Face
@pytest.mark.parametrize("name", HF)
def test_hf_export_loads(name, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exp = EXPECTED["hf"][name]
    d = copy_of(f"hf/{name}", tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    assert type(hf).__name__ == exp["class"]
    with torch.no_grad():
        check_logits(hf(input_ids()).logits, exp["logits"], f"hf/{name}")
    assert AutoTokenizer.from_pretrained(d)(EXPECTED["input_text"]).input_ids == exp["tokenizer_ids"]
    # the trust_remote_code shims the folder ships still name importable classes
    cfg = json.loads((d / "config.json").read_text())
    for ref in cfg["auto_map"].values():
        module, cls = ref.split(".")
        ns: dict = {}
        exec(compile((d / f"{module}.py").read_text(), str(d / f"{module}.py"), "exec"), ns)
        assert isinstance(ns[cls], type), ref


# ---------------------------------------------------------------------------- comparison
def test_compare_folder_resumes_without_retraining(tmp_path):
    """Rerunning the comparison's recipe on its folder finds both runs finished (the stored
    recipe.json equals today's reading of the recipe), trains nothing and re-reports the
    same numbers. As ``python -m phaseloop``, from the repository root."""
    exp = EXPECTED["compare"]
    out = copy_of("compare", tmp_path)
    before = {p.relative_to(out): p.read_bytes() for p in (out / "runs").rglob("*") if p.is_file()}
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(phaseloop.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "phaseloop", "compare", exp["recipe"], "--out", str(out),
                        "--quiet"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"{len(exp['runs'])} of {len(exp['runs'])} runs already finished" in r.stderr
    after = {p.relative_to(out): p.read_bytes() for p in (out / "runs").rglob("*") if p.is_file()}
    assert after == before  # nothing retrained, no run folder touched
    s = json.loads((out / "summary.json").read_text())
    assert s["target_val_loss"] == approx(exp["target_val_loss"])
    got = {v["name"]: v for v in s["variants"]}
    assert sorted(got) == sorted(exp["variants"])
    for name, v in exp["variants"].items():
        assert got[name]["finished_seeds"] == v["finished_seeds"]
        assert got[name]["val_loss"]["mean"] == approx(v["val_loss_mean"])
    assert (out / "report.md").is_file()
