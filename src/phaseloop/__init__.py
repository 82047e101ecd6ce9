"""phaseloop: Transformer LMs with structured residual streams or depth recurrence."""

from .config import PRESETS, ModelConfig
from .errors import CheckpointError, ConfigError, DataError, PhaseloopError
from .model import DecoderLM, ModelOutput, build_model

# Each architecture module registers its trunk, block options and presets on import.
from . import three_phase, universal, hyperloop  # noqa: E402,F401  isort: skip

__version__ = "0.1.0"
__all__ = ["ModelConfig", "PRESETS", "build_model", "DecoderLM", "ModelOutput",
           "PhaseloopError", "ConfigError", "DataError", "CheckpointError", "__version__"]
