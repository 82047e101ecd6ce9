"""Post-training weight-only quantisation: round-to-nearest (RTN), GPTQ, optional torchao.

The Hyperloop paper reports weight-only INT4 with group size 128, quantised by GPTQ
where the Hessian of a looped (weight-shared) layer is pooled over all of its loop
passes.  This module implements that for any ``nn.Module`` whose matmuls are
``nn.Linear``; nothing here knows about a particular architecture.

Along its seams: ``core`` (the quantisation scheme, RTN, int4 packing), ``gptq`` (GPTQ and
the Hessians pooled over loop passes), ``targets`` (which Linears), ``apply``
(``quantize_model``, fake quantisation in place, torchao), ``io`` (packed safetensors),
``run`` (quantise a trained run: ``phaseloop quantize``), ``packed`` (Linears that run
packed on torch's int8 / int4 CPU kernels) and ``load`` (a run with its quantised file:
checked against the run, packed or dequantised).
"""

from phaseloop.quant.apply import quantize_model
from phaseloop.quant.core import (
    QUANT_ATTR,
    SUPPORTED_BITS,
    QuantizedWeight,
    dequantize,
    pack_int4,
    packed_bytes,
    quantize_rtn,
    unpack_int4,
)
from phaseloop.quant.gptq import collect_hessians, gptq_quantize
from phaseloop.quant.io import load_quantized_state_dict, quantized_state_dict, save_quantized
from phaseloop.quant.load import load_dequantized, load_packed
from phaseloop.quant.packed import PackedLinear, weight_bytes
from phaseloop.quant.run import quantize_run
from phaseloop.quant.targets import default_skip

__all__ = [
    "SUPPORTED_BITS", "QUANT_ATTR", "QuantizedWeight",
    "quantize_rtn", "dequantize", "gptq_quantize", "pack_int4", "unpack_int4",
    "collect_hessians", "quantize_model", "quantized_state_dict", "save_quantized",
    "load_quantized_state_dict", "packed_bytes", "default_skip", "quantize_run",
    "PackedLinear", "weight_bytes", "load_packed", "load_dequantized",
]
