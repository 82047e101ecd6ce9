"""Trained runs in on-device runtimes (the ``deploy`` extra: ``pip install
'phaseloop[deploy]'``): ExecuTorch, whose LLM runner loads one ``.pte`` per backend.

* ``program.py``: a ``DecoderLM`` as the runner's contract wants it (``RunnerProgram``:
  ``forward(tokens, input_pos) -> logits``, the KV cache in module buffers, the metadata
  methods), its depth fixed; torch only;
* ``pte.py``: torch.export, torchao's int8 / int4 weights, lowering to XNNPACK; imports
  executorch and torchao;
* ``runtime.py``: ``PteModel``, a ``.pte`` in ExecuTorch's Python runtime;
* ``run.py``: ``export_run``, what ``phaseloop export --format executorch`` calls;
* ``generate.py``: ``phaseloop generate FILE.pte``, decoding in the runtime (imports
  executorch only when it loads a file).

docs/deploy.md ("ExecuTorch") has the commands and the measured sizes and speeds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from phaseloop.errors import ConfigError
from phaseloop.files import json_digest

EXTRA = "pip install 'phaseloop[deploy]'"


def require() -> None:
    """One line naming the extra when executorch / torchao is not installed."""
    for name in ("executorch", "torchao"):
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"--format executorch needs the {name} library, which is not installed: {EXTRA}")


def sidecars(out: Path) -> tuple[Path, Path]:
    """(tokenizer file, record) beside the program ``out``."""
    stem = Path(out).with_suffix("")
    return stem.with_name(stem.name + ".tokenizer.json"), stem.with_name(stem.name + ".json")


def record_digest(record: dict) -> str:
    """An export's record's own digest (``files.json_digest`` less ``record_sha256``): export
    stores it in the record, ``generate FILE.pte`` recomputes it, so a record damaged or
    edited after export is refused (the .pte and tokenizer have their digests in the record)."""
    return json_digest(record, "record_sha256")
