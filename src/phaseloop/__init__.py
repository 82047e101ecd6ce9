"""phaseloop: Transformer LMs with structured residual streams or depth recurrence."""

from . import _startup

if _startup.started_as_command():  # Ctrl-C while torch imports: one line, exit 130
    _startup.install()

from .config import PRESETS, ModelConfig
from .errors import CheckpointError, ConfigError, DataError, PhaseloopError
from .model import DecoderLM, ModelOutput, build_model

# The built-in architectures register on import (registry.py); plugins through entry points.
from . import rope, three_phase, universal, hyperloop  # noqa: E402,F401  isort: skip
from . import hf as _hf  # noqa: E402  isort: skip

_hf.register_when_imported()  # Auto classes know model_type "phaseloop" (hf/__init__.py)

__version__ = "0.1.0"
__all__ = ["ModelConfig", "PRESETS", "build_model", "DecoderLM", "ModelOutput",
           "PhaseloopError", "ConfigError", "DataError", "CheckpointError", "__version__"]
