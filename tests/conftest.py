import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["explore_fixtures"]  # a live explore server and headless Chromium


def shared_data_dir() -> Path | None:
    """../shared/data (CI sets PHASELOOP_DATA_DIR to it)."""
    for cand in (os.environ.get("PHASELOOP_DATA_DIR"), REPO.parent / "shared" / "data"):
        if cand and Path(cand).is_dir():
            return Path(cand)
    return None


def pytest_configure(config):
    """Marks of transformers' common tests (tests/test_hf_common.py imports them)."""
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                 "torch_compile_test", "slow"):
        config.addinivalue_line("markers", f"{mark}: transformers' common tests (test_hf_common.py)")


@pytest.fixture(autouse=True)
def _isolate(tmp_path_factory, monkeypatch):
    """Token caches go to a per-session temp folder; runs are deterministic."""
    monkeypatch.setenv("PHASELOOP_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    torch.manual_seed(0)


@pytest.fixture
def data_dir(monkeypatch):
    d = shared_data_dir()
    if d is None:
        pytest.skip("../shared/data not present (set PHASELOOP_DATA_DIR)")
    monkeypatch.setenv("PHASELOOP_DATA_DIR", str(d))
    return d


def write_corpus(path: Path) -> Path:
    """A small user text file (not one of the named sources) at ``path``."""
    path.write_text(("the quick brown fox jumps over the lazy dog. " * 40 + "\n") * 30)
    return path


@pytest.fixture
def text_file(tmp_path):
    return write_corpus(tmp_path / "corpus.txt")


@pytest.fixture
def one_thread():
    """Tiny models: extra threads only add contention (used by modules via pytestmark)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------- bad-input cases
# (test_robustness, test_early_refusals, test_full_disk, test_hand_edits, test_text_store)
TINY = ["--preset", "rope-tiny", "--batch-size", "2", "--eval-windows", "2", "--warmup", "2", "--quiet"]


def snapshot(root) -> dict:
    """Every file under ``root`` and its bytes: "nothing changed" is an equal snapshot."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def run_cli(argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) of ``phaseloop ARGV`` in this process (argparse's exits too)."""
    from phaseloop.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err.strip()


def assert_one_line(code, err, pattern, status=2, prefix="phaseloop"):
    """Exit ``status``, one error line (after any notes the command printed first), no
    traceback, starting with ``prefix`` and holding ``pattern``."""
    assert code == status, err
    err = "\n".join(line for line in err.splitlines() if not line.startswith("note: "))
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(prefix), err
    assert pattern in err, err


def tiny_run(root: Path, steps: int = 4, every: int = 2, *extra: str) -> dict:
    """A finished tiny run under ``root`` (checkpoints and evaluations every ``every`` steps);
    ``extra``: more ``train`` arguments (a later ``--preset`` or ``--set`` wins)."""
    from phaseloop.cli import main

    text = write_corpus(root / "corpus.txt")
    run = root / "run"
    assert main(["train", *TINY, "--steps", str(steps), "--eval-every", str(every), "--ckpt-every",
                 str(every), "--data", str(text), "--out", str(run), *extra]) == 0
    return {"root": root, "run": run, "text": text}


def tiny_runs(root: Path, presets) -> dict:
    """Finished 2-step runs of each preset (rope-tiny's flags) on one small corpus under
    ``root``: preset -> run folder, and "text" -> the corpus."""
    from phaseloop.cli import main

    out = {"text": write_corpus(root / "corpus.txt")}
    for preset in presets:
        flags = [a if a != "rope-tiny" else preset for a in TINY]
        assert main(["train", *flags, "--steps", "2", "--eval-every", "2", "--ckpt-every", "2",
                     "--data", str(out["text"]), "--out", str(root / preset), "--device", "cpu"]) == 0
        out[preset] = root / preset
    return out


def cli_json(argv, capsys):
    """The JSON ``phaseloop ARGV`` prints (it must exit 0)."""
    import json

    from phaseloop.cli import main

    assert main([str(a) for a in argv]) == 0
    return json.loads(capsys.readouterr().out)


def tiny_model_config(arch: str, **over):
    """A ModelConfig of ``arch`` small enough for exact float64 checks of every trunk."""
    from phaseloop import ModelConfig

    base = dict(arch=arch, vocab_size=48, d_model=24, n_heads=2, n_layers=3, max_seq_len=32)
    if arch in ("looped", "hyperloop"):
        base.update(n_begin=1, n_end=1, n_loops=2)
    if arch == "three_phase":
        base.update(d_model=36, n_heads=3)
    if arch == "universal":
        base.update(n_layers=1)
    return ModelConfig.from_dict({**base, **over})
