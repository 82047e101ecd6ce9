"""The built-in architectures, each one plugin file registering one ``ArchSpec``: the
Llama-style baseline (``rope``), the Three-Phase Transformer (``three_phase``), the
Universal Transformer (``universal``, with ACT in ``act``), the Looped / Hyperloop / mHC
Transformers (``hyperloop``, with hyper-connections in ``hyperconn``), and the
encoder-decoder skeleton their task runs use (``seq2seq``). Importing this package
registers them all."""

# isort: off
# registration order is listing order: the baseline first
from phaseloop.archs import rope, three_phase, universal, hyperloop  # noqa: F401
# isort: on
from phaseloop.archs.seq2seq import TransformerSeq2Seq, build_seq2seq
from phaseloop.archs.universal import UniversalSeq2Seq, UniversalTrunk
from phaseloop.model import DecoderLM, ModelOutput, build_model

__all__ = ["DecoderLM", "ModelOutput", "build_model", "TransformerSeq2Seq", "UniversalSeq2Seq",
           "build_seq2seq", "UniversalTrunk"]
