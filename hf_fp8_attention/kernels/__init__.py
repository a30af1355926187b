"""Triton kernels of the FP8 attention recipe, by role:

- :mod:`.quantize` (block-scaled FP8 quantization of the operands), :mod:`.forward`;
- :mod:`.backward` (the backward's launcher and ``LAUNCH`` table), :mod:`.backward_fp8` (the default
  FP8 backward on pre-quantized operands), :mod:`.backward_inreg` (hybrid bf16 / in-register kernels),
  :mod:`.backward_quant` (in-register quantization helpers);
- :mod:`.tiles` (tile ranges, the visibility rule, sequence bounds), :mod:`.constants`, :mod:`.autotune`.

Importing this package needs Triton; :mod:`hf_fp8_attention.ops` imports it lazily, only when a
CUDA tensor on an FP8-capable GPU (or the interpreter, in tests) asks for the kernels.
"""
