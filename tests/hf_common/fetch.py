"""Fetch transformers' own common model tests for the installed transformers version.

    python tests/hf_common/fetch.py            # into tests/hf_common/.sdist (gitignored)

Downloads the sdist of the installed version from the package index (``pip download
--no-binary :all: --no-deps transformers==VERSION``) and extracts ``tests/
test_modeling_common.py`` and ``tests/test_configuration_common.py`` into
``DEST/transformers-VERSION/hf_sdist_tests/`` (a package, imported by
tests/test_hf_common.py). ``.ci/run`` runs it before pytest.

The sdist does not carry the three modules those files import relatively
(``generation/test_utils.py``, ``exporters/test_export.py``, ``utils/
test_configuration_utils.py``: transformers' repository has them, the sdist does not), so
this writes stand-ins of its own: ``generation/test_utils.py`` re-exports phaseloop's
``GenerationTesterMixin`` (``tests/hf_common/generation_contract.py``, written to the
contract of transformers' own; tests/test_hf_common.py puts this folder on ``sys.path``
and mixes the same class into its tester classes), an empty ``ExportTesterMixin``
(torch.export and torch.compile of the model are tested by tests/test_hf_conformance.py)
and a ``config_common_kwargs`` of non-default values for the base config's fields.

``PHASELOOP_HF_TESTS`` overrides DEST. Idempotent: an existing extraction is kept (no
download); stand-ins that differ from the ones here are rewritten.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

FILES = ("test_modeling_common.py", "test_configuration_common.py")
PACKAGE = "hf_sdist_tests"

STANDINS = {
    "__init__.py": '"""transformers\' common tests, from its sdist (tests/hf_common/fetch.py)."""\n',
    "generation/__init__.py": "",
    "generation/test_utils.py": (
        '"""Stand-in (the sdist lacks tests/generation): phaseloop\'s GenerationTesterMixin,\n'
        'written to the contract of transformers\' own (tests/hf_common/generation_contract.py;\n'
        'tests/test_hf_common.py puts that folder on sys.path)."""\n\n'
        "from generation_contract import GenerationTesterMixin  # noqa: F401\n"),
    "exporters/__init__.py": "",
    "exporters/test_export.py": (
        '"""Stand-in (the sdist lacks tests/exporters): torch.export and torch.compile of the\n'
        'model are tested by tests/test_hf_common.py (item 7 of issue 31)."""\n\n\n'
        "class ExportTesterMixin:\n    pass\n"),
    "utils/__init__.py": "",
    "utils/test_configuration_utils.py": (
        '"""Stand-in (the sdist lacks tests/utils): non-default values for fields every\n'
        'PretrainedConfig takes, for ConfigTester.check_config_arguments_init."""\n\n'
        "config_common_kwargs = {\n"
        '    "return_dict": False,\n'
        '    "output_hidden_states": True,\n'
        '    "dtype": "float16",\n'
        '    "chunk_size_feed_forward": 5,\n'
        '    "architectures": ["BertModel"],\n'
        '    "id2label": {0: "label"},\n'
        '    "label2id": {"label": "0"},\n'
        '    "problem_type": "regression",\n'
        '    "tie_word_embeddings": False,\n'
        "}\n"),
}


def transformers_version() -> str:
    from importlib.metadata import version
    return version("transformers")


def default_dest() -> Path:
    env = os.environ.get("PHASELOOP_HF_TESTS")
    return Path(env) if env else Path(__file__).resolve().parent / ".sdist"


def package_dir(dest: Path | None = None, version: str | None = None) -> Path:
    """Where the package of the given (default: installed) version lives."""
    return (dest or default_dest()) / f"transformers-{version or transformers_version()}" / PACKAGE


def fetch(dest: Path | None = None, version: str | None = None) -> Path:
    version = version or transformers_version()
    pkg = package_dir(dest, version)
    if not all((pkg / f).is_file() for f in FILES):
        _download(pkg, version)
    write_standins(pkg)
    return pkg


def write_standins(pkg: Path) -> None:
    """(Re)write the stand-ins that differ from STANDINS (an extraction made by an older
    fetch.py gets the current ones; tests/test_hf_common.py calls this too)."""
    for name, text in STANDINS.items():
        path = pkg / name
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def _download(pkg: Path, version: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:",
                        "--no-deps", f"transformers=={version}", "-d", tmp],
                       check=True)
        sdist = next(Path(tmp).glob("transformers-*.tar.gz"))
        pkg.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for f in FILES:
                member = tar.getmember(f"transformers-{version}/tests/{f}")
                (pkg / f).write_bytes(tar.extractfile(member).read())


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
