"""Triton kernels of the FP8 attention recipe (quantization, forward; the backward lives beside them).

Importing this package needs Triton; :mod:`hf_fp8_attention.ops` imports it lazily, only when a
CUDA tensor on an FP8-capable GPU (or the interpreter, in tests) asks for the kernels.
"""
