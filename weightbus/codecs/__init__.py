"""Codecs: transforms of the bytes on the wire between writers and readers.

* :mod:`weightbus.codecs.fp8`: FP8 block quantization (e4m3, one scale per 128 x 128 block,
  DeepSeek-V3 style), writer-side, with a Triton kernel on GPU and torch elsewhere.
* :mod:`weightbus.codecs.delta`: sparse, bit-exact deltas against the previous sync.

Both plug into the sync path through :mod:`weightbus.plan.codec_plan`. Dtype casts are the
planner's (``PlanOptions.cast``) and need no codec.
"""

from weightbus.codecs.delta import DeltaConfig, DeltaPolicy
from weightbus.codecs.fp8 import Fp8Config, dequantize, quantize_blocks, quantized_layout

__all__ = [
    "DeltaConfig",
    "DeltaPolicy",
    "Fp8Config",
    "dequantize",
    "quantize_blocks",
    "quantized_layout",
]
