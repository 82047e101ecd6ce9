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
this writes stand-ins of its own: an empty ``GenerationTesterMixin`` and
``ExportTesterMixin`` (phaseloop's generation, torch.export and torch.compile are tested
by tests/test_hf.py and tests/test_hf_common.py themselves) and a
``config_common_kwargs`` of non-default values for the base config's fields.

``PHASELOOP_HF_TESTS`` overrides DEST. Idempotent: an existing extraction is kept.
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
        '"""Stand-in (the sdist lacks tests/generation): generation is tested by phaseloop\'s\n'
        'tests/test_hf.py (greedy, sampling, beam search, left padding against phaseloop\n'
        'itself) and tests/test_hf_common.py."""\n\n\n'
        "class GenerationTesterMixin:\n    pass\n"),
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
    if all((pkg / f).is_file() for f in (*FILES, *STANDINS)):
        return pkg
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
    for name, text in STANDINS.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


if __name__ == "__main__":
    print(fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
