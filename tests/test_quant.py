"""Block-scaled quantization: shapes, rounding bound, saturation, power-of-two scales, specials."""
import pytest
import torch

from hf_fp8_attention.config import FP8Format
from hf_fp8_attention.quant import compute_scales, dequantize, fake_quantize, quantize

# Round-to-nearest into a format with m mantissa bits errs by at most 2^-(m+1) relative to the value
# in the normal range, and by at most half the smallest subnormal (2^(emin-m-1)) in absolute terms.
BOUNDS = {FP8Format.E4M3: (2.0**-4, 2.0**-10), FP8Format.E5M2: (2.0**-3, 2.0**-17)}


@pytest.mark.parametrize("fmt", list(FP8Format))
@pytest.mark.parametrize("dim, block", [(-1, None), (1, 16), (0, 3), (2, 7)])
def test_roundtrip_error_within_rounding_bound(fmt, dim, block):
    torch.manual_seed(0)
    x = torch.randn(5, 37, 24) * torch.logspace(-3, 3, 24)  # channels spanning six decades
    codes, scales = quantize(x, dim=dim, block=block, fmt=fmt)
    assert codes.dtype == fmt.dtype and codes.shape == x.shape
    n_blocks = 1 if block is None else -(-x.shape[dim] // block)
    expected = list(x.shape)
    expected[dim] = n_blocks
    assert list(scales.shape) == expected and scales.dtype == torch.float32
    back = dequantize(codes, scales, dim=dim, block=block)
    rel, sub = BOUNDS[fmt]
    per_elem_scale = dequantize(torch.ones_like(x), scales, dim=dim, block=block)
    bound = torch.maximum(x.abs() * rel, per_elem_scale * sub) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()


def test_block_maximum_maps_to_format_maximum():
    x = torch.tensor([[0.5, -3.0, 1.0], [2.0, 0.25, 0.0]])
    codes, scales = quantize(x, dim=-1, block=None)
    assert codes.float().abs().amax(dim=-1).tolist() == [448.0, 448.0]
    assert torch.allclose(scales, torch.tensor([[3.0], [2.0]]) / 448)


def test_saturates_when_fp32_rounding_pushes_the_maximum_past_the_format():
    # For amax = 513.4632568359375, amax / (amax / 448) rounds to just above 448 in fp32; unsaturated,
    # that would cast to the next binade (or NaN); it must clamp to the format maximum instead.
    amax = torch.tensor(513.4632568359375)
    assert amax / (amax / 448) > 448
    codes, _ = quantize(torch.stack([amax, -amax, amax / 3]), dim=0, block=None)
    assert codes.float()[:2].tolist() == [448.0, -448.0]


def test_pow2_scales_are_powers_of_two_and_bound_amax():
    torch.manual_seed(1)
    x = torch.randn(8, 64) * 37.0
    codes, scales = quantize(x, dim=-1, block=16, pow2=True)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)
    assert (codes.float().abs().amax(dim=-1) <= 448).all()
    # Dequantization is exact: codes * 2^k is representable, so requantizing is the identity.
    back = dequantize(codes, scales, dim=-1, block=16)
    assert torch.equal(fake_quantize(back, dim=-1, block=16, pow2=True), back)


def test_zero_block_gets_unit_scale_and_zero_codes():
    x = torch.zeros(2, 8)
    codes, scales = quantize(x, dim=-1, block=4)
    assert torch.equal(scales, torch.ones(2, 2)) and not codes.float().any()


def test_tiny_blocks_do_not_underflow_to_nan():
    x = torch.tensor([[1e-40, -2e-41, 3e-42, 0.0]])
    for pow2 in (False, True):
        assert torch.isfinite(fake_quantize(x, dim=-1, block=None, pow2=pow2)).all()


@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_poison_their_block_only(special):
    x = torch.randn(3, 16)
    x[1, 5] = special
    back = fake_quantize(x, dim=-1, block=8)
    assert not torch.isfinite(back[1, :8]).any(), "a non-finite input must never dequantize to finite values"
    assert torch.isfinite(back[1, 8:]).all() and torch.isfinite(back[[0, 2]]).all()


def test_compute_scales_guards():
    amax = torch.tensor([0.0, 448.0, float("nan"), float("inf")])
    s = compute_scales(amax, FP8Format.E4M3, pow2=False)
    assert s[0] == 1 and s[1] == 1 and s[2].isnan() and s[3].isinf()


def test_rejects_integer_tensors():
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(4, dtype=torch.int32), dim=0, block=None)
