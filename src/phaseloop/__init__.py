"""phaseloop: Transformer LMs with structured residual streams or depth recurrence."""

from .config import PRESETS, ModelConfig
from .errors import CheckpointError, ConfigError, DataError, PhaseloopError
from .model import DecoderLM, ModelOutput, build_model
from . import three_phase  # noqa: F401  (registers its presets)
from . import hyperloop  # noqa: F401  (registers its presets)
from . import universal  # noqa: F401  (registers its presets)

__version__ = "0.1.0"
__all__ = ["ModelConfig", "PRESETS", "build_model", "DecoderLM", "ModelOutput",
           "PhaseloopError", "ConfigError", "DataError", "CheckpointError", "__version__"]
