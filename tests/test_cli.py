"""The command line: each subcommand works, and bad input gets one line and exit code 2."""

import json
import subprocess
import sys

import pytest

from phaseloop.cli import main

TINY_TRAIN = ["--preset", "rope-tiny", "--steps", "6", "--batch-size", "2", "--eval-every", "3",
              "--eval-windows", "2", "--warmup", "2", "--quiet"]


@pytest.fixture
def run_dir(tmp_path, text_file):
    out = tmp_path / "run"
    assert main(["train", *TINY_TRAIN, "--data", str(text_file), "--out", str(out)]) == 0
    return out


def one_line_error(capsys, code, pattern):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert pattern in err, err


def test_train_eval_generate_params(run_dir, capsys, text_file):
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 6
    assert main(["eval", str(run_dir), "--json", "--windows", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["val_bpb"] > 0 and res["windows"] == 3
    assert main(["eval", str(run_dir), "--data", str(text_file), "--split", "all"]) == 0
    assert "bpb" in capsys.readouterr().out
    assert main(["generate", str(run_dir), "--prompt", "the ", "--max-new-tokens", "10",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("the ")
    assert main(["params", "--preset", "rope-123m", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert all(isinstance(p[k], int) for k in ("total", "embedding", "unembedding", "non_embedding",
                                                "flops_per_token"))
    assert p["total"] == 123_489_024


def test_resume_continues_with_saved_settings(run_dir, capsys, text_file):
    """--resume with no other options reuses the run's config; a finished run stays finished."""
    before = (run_dir / "metrics.jsonl").read_text()
    assert main(["train", "--out", str(run_dir), "--resume", "--quiet"]) == 0
    assert (run_dir / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("argv, pattern", [
    (["train", "--preset", "nope"], "unknown preset"),
    (["train", "--preset", "rope-tiny", "--set", "n_heads=5"], "n_heads=5"),
    (["train", "--preset", "rope-tiny", "--set", "bogus=1"], "bogus"),
    (["train", "--preset", "rope-tiny", "--set", "novalue"], "KEY=VALUE"),
    (["train", "--preset", "rope-tiny", "--data", "/no/such/file.txt"], "does not exist"),
    (["train", "--preset", "rope-tiny", "--steps", "0"], "steps=0"),
    (["train", "--steps", "many"], "invalid int value"),
    (["eval", "/no/such/run"], "does not exist"),
    (["params", "--preset", "nope"], "unknown preset"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_one_line_exit_2(argv, pattern, capsys, tmp_path):
    if argv[0] == "train":
        argv = argv + ["--out", str(tmp_path / "r")]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse errors
        code = e.code
    one_line_error(capsys, code, pattern)
    assert not (tmp_path / "r").exists()


def test_empty_data_file(tmp_path, capsys):
    p = tmp_path / "empty.txt"
    p.write_text("")
    one_line_error(capsys, main(["train", "--data", str(p), "--out", str(tmp_path / "r")]), "empty")


def test_existing_run_is_not_overwritten(run_dir, capsys, text_file):
    before = {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    code = main(["train", *TINY_TRAIN, "--data", str(text_file), "--out", str(run_dir)])
    one_line_error(capsys, code, "already holds a run")
    code = main(["train", *TINY_TRAIN, "--set", "n_layers=3", "--data", str(text_file),
                 "--out", str(run_dir), "--resume"])
    one_line_error(capsys, code, "different model config")
    after = {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert before == after


def test_damaged_and_mismatched_checkpoints(run_dir, capsys):
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg["model"]["n_layers"] = 3
    (run_dir / "config.json").write_text(json.dumps(cfg))
    one_line_error(capsys, main(["eval", str(run_dir)]), "was changed after the checkpoint")
    manifest = run_dir / "checkpoint" / "manifest.json"  # as a checkpoint of 0.1 (no config digest)
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items()
                                    if k != "config_sha256"}))
    one_line_error(capsys, main(["eval", str(run_dir)]), "does not match")
    (run_dir / "config.json").write_text("{not json")
    one_line_error(capsys, main(["eval", str(run_dir)]), "cannot read")
    (run_dir / "config.json").write_text(json.dumps({**cfg, "model": {**cfg["model"], "n_layers": 2}}))
    (run_dir / "checkpoint" / "model.safetensors").write_bytes(b"\x00garbage")
    one_line_error(capsys, main(["eval", str(run_dir)]), "damaged")


def test_module_entry_point_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-m", "phaseloop", "eval", str(tmp_path / "missing")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_archs_lists_every_registered_architecture(capsys):
    from phaseloop import registry

    assert main(["archs", "--json"]) == 0
    rows = {r["arch"]: r for r in json.loads(capsys.readouterr().out)}
    assert list(rows) == registry.arch_names()
    assert rows["looped"]["layers"] == {"n_unique_layers": registry.get_arch("looped").layers}
    assert "UniversalOptions" in rows["universal"]["options"] and rows["universal"]["defaults"] == {"n_layers": 1}
    assert "3pt-tiny" in rows["three_phase"]["presets"]
    assert main(["archs"]) == 0
    assert "n_unique_layers: unique layers" in capsys.readouterr().out
