"""All model classes in one place: the decoder-only LM and the encoder-decoders."""

from .model import DecoderLM, ModelOutput, build_model
from .seq2seq import TransformerSeq2Seq, UniversalSeq2Seq, build_seq2seq
from .universal import UniversalTrunk

__all__ = ["DecoderLM", "ModelOutput", "build_model", "TransformerSeq2Seq", "UniversalSeq2Seq",
           "build_seq2seq", "UniversalTrunk"]
