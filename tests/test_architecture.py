"""The package's layout (docs/architecture.md) beside the import contracts `lint-imports`
checks in CI: what those contracts cannot say, each a number a change can break."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path

import pytest

import phaseloop
from phaseloop import _aliases

SRC = Path(phaseloop.__file__).resolve().parent
REPO = SRC.parents[1]
MODULES = sorted(SRC.rglob("*.py"))
# imports inside functions that are allowed: an optional extra imported when a command runs
# (transformers / lm-eval, gguf, starlette / uvicorn / prometheus-client, submitit), and the hf package
# registering its classes once transformers is imported
LAZY_OK = {"phaseloop.hf", "phaseloop.hf.harness", "phaseloop.hf.modeling", "phaseloop.hf.export",
           "phaseloop.hf.llama", "phaseloop.hf.gguf",
           "phaseloop.hf.downstream", "phaseloop.hf.scoring",
           "phaseloop.explore.app", "phaseloop.explore.notebook", "phaseloop.explore.context",
           "phaseloop.explore.web", "phaseloop.compare.slurm", "phaseloop.deploy.run",
           "phaseloop.deploy.runtime",
           # phaseloop serve (the serve extra), and the chat template's tokenizer (hf.tokenizer)
           "phaseloop.serve.loading", "phaseloop.serve.options", "phaseloop.serve.runner", "phaseloop.serve.schema",
           "phaseloop.hf.tokenizer"}


def _name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(module imported, inside a function?) of every phaseloop import of ``path``."""
    tree = ast.parse(path.read_text())

    def walk(node, inside):
        for child in ast.iter_child_nodes(node):
            here = inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                yield from ((a.name, here) for a in child.names if a.name.split(".")[0] == "phaseloop")
            elif isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "phaseloop":
                for a in child.names:
                    full = f"{child.module}.{a.name}"
                    yield (full if importlib.util.find_spec(child.module) and _is_module(full) else child.module,
                           here)
            yield from walk(child, here)

    yield from walk(tree, False)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def test_at_most_20_modules_at_the_top_and_no_file_over_400_lines():
    top = [p for p in SRC.glob("*.py")]
    assert len(top) <= 20, sorted(p.name for p in top)
    long = {str(p.relative_to(SRC)): n for p in MODULES if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_no_module_imports_the_root_package():
    """``phaseloop/__init__`` is the facade: it imports the architectures; none imports it."""
    bad = [(_name(p), m) for p in MODULES if p.name != "__main__.py" for m, _ in _imports(p) if m == "phaseloop"]
    assert not bad, bad


def test_imports_inside_functions_are_only_of_optional_extras():
    lazy = sorted({(_name(p), m) for p in MODULES for m, inside in _imports(p) if inside})
    assert [x for x in lazy if x[1] not in LAZY_OK] == [], lazy


@pytest.mark.parametrize("old", sorted(_aliases.MOVED))
def test_every_old_import_path_is_the_module_that_moved(old):
    """``import phaseloop.train`` is ``phaseloop.lm.train`` itself: an attribute set on one
    (monkeypatch) is seen through the other."""
    module = importlib.import_module(old)
    assert module is importlib.import_module(_aliases.MOVED[old])
    assert module.__name__ == _aliases.MOVED[old]
    parent, leaf = old.rsplit(".", 1)
    assert getattr(importlib.import_module(parent), leaf) is module


def test_an_old_path_from_a_fresh_interpreter(tmp_path):
    """The aliases need no earlier import: ``from phaseloop.checkpoint import load_run`` as
    the first line of a script, and the plugin API's names of 0.1 (layers.Context)."""
    import subprocess
    import sys

    code = ("from phaseloop.checkpoint import load_run\nfrom phaseloop.train import train\n"
            "import phaseloop.three_phase as t\nfrom phaseloop.layers import Block, Context\n"
            "import phaseloop.engine.checkpoint as c, phaseloop.lm.train as l, phaseloop.archs.three_phase as a\n"
            "from phaseloop.layers import ForwardContext\n"
            "assert load_run is c.load_run and train is l.train and t is a and Context is ForwardContext\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_version_is_pyprojects_and_the_changelogs():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert phaseloop.__version__ == project["version"]
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(project['version'])}\]", changelog, re.M), "CHANGELOG.md lacks the version"
    assert project["requires-python"] == ">=3.11"  # tomllib, hashlib.file_digest: used without fallbacks
