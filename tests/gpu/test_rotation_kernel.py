"""The quantization kernels' Hadamard rotation (``kernels.quantize.rotate_rows``), on the GPU only (the
Triton interpreter's 16-bit dots are not the hardware's): fp32 inputs at head dim 256 are rotated by
three 16-bit dots on split parts (x = x₁ + x₂ + x₃, 8 significand bits each), which must give x·H to
fp32 accuracy, as the full-precision dot does at head dims up to 128; the one-dot 16-bit path on the
same fp32 values (what the split replaces) loses their low bits."""
import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
quantize = pytest.importorskip("hf_fp8_attention.kernels.quantize")
from hf_fp8_attention.transforms import rotate  # noqa: E402

hadamard_operand, load_hadamard, rotate_rows = quantize.hadamard_operand, quantize.load_hadamard, quantize.rotate_rows

ROWS, DP = 16, 256


@triton.jit
def _rotate_kernel(x_ptr, h_ptr, y_ptr, R: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   SRC_DTYPE: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    y = rotate_rows(tl.load(x_ptr + offs), load_hadamard(h_ptr, BLOCK_D), DOT_DTYPE, SRC_DTYPE)
    tl.store(y_ptr + offs, y)


def _rotated(x, src_dtype):
    h = hadamard_operand(DP, x.device, torch.bfloat16)
    y = torch.empty_like(x)
    _rotate_kernel[(1,)](x, h, y, R=ROWS, BLOCK_D=DP, DOT_DTYPE=tl.bfloat16, SRC_DTYPE=src_dtype)
    return y


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def test_split_dots_rotate_fp32_inputs_to_fp32_accuracy():
    x = (torch.randn(ROWS, DP, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, DP)).cuda()
    exact = x.double() @ hadamard_operand(DP, x.device, torch.float32).double()
    assert _rel(_rotated(x, tl.float32), exact) <= 2.0**-21  # fp32 sums of 128 exact terms
    assert _rel(rotate(x), exact) <= 2.0**-21  # the emulation's rotation, the same accuracy
    assert _rel(_rotated(x, tl.bfloat16), exact) >= 2.0**-10  # one bf16 dot: ~2^-9 of the values lost
