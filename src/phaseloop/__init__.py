"""phaseloop: Transformer LMs with structured residual streams or depth recurrence.

The plugin API lives at the top of the package (``config``, ``registry``, ``trunk``,
``layers``, ``model``, ``decoding``, ``depth``, ``early_exit``, ``errors``); the built-in
architectures, corpora, the training engine and the workflows are subpackages
(docs/architecture.md).
"""

from phaseloop import _aliases, _startup

if _startup.started_as_command():  # Ctrl-C while torch imports: one line, exit 130
    _startup.install()
_aliases.install()  # the modules' import paths before 0.2 (phaseloop.train, ...)
_startup.quiet_import_noise()  # torchao's import-time lines (_startup.py)

from phaseloop._version import __version__  # noqa: E402
from phaseloop.config import PRESETS, ModelConfig  # noqa: E402
from phaseloop.errors import CheckpointError, ConfigError, DataError, PhaseloopError  # noqa: E402
from phaseloop.model import DecoderLM, ModelOutput, build_model  # noqa: E402

# The built-in architectures register on import (registry.py); plugins through entry points.
from phaseloop import archs  # noqa: E402,F401  isort: skip
from phaseloop import hf as _hf  # noqa: E402  isort: skip

_hf.register_when_imported()  # Auto classes know model_type "phaseloop" (hf/__init__.py)

__all__ = ["ModelConfig", "PRESETS", "build_model", "DecoderLM", "ModelOutput",
           "PhaseloopError", "ConfigError", "DataError", "CheckpointError", "__version__"]
