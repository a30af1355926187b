"""tests/hopper_accumulator.py, the model of Hopper's FP8 accumulation that
benchmarks/predict_gpu_bounds.py runs inside the emulation."""
from __future__ import annotations

import torch

import hf_fp8_attention.reference as reference
from hf_fp8_attention import RECIPES
from hf_fp8_attention.masking import MaskSpec
from hf_fp8_attention.reference import emulated_backward, emulated_forward
from helpers import make_qkv, rel_err
from hopper_accumulator import ACCUMULATOR_BITS, GUARD_BITS, accumulated_matmul, hopper_accumulation, truncate


def test_truncate_keeps_the_accumulator_bits_toward_zero():
    one_ulp = 2.0**-ACCUMULATOR_BITS
    x = torch.tensor([1 + one_ulp, 1 + one_ulp / 2, -(1 + one_ulp / 2), 3 * 2.0**-30, 0.0])
    assert truncate(x).tolist() == [1 + one_ulp, 1.0, -1.0, 3 * 2.0**-30, 0.0]


def test_small_integer_sums_are_exact():
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 9, (5, 96), generator=gen).float()
    b = torch.randint(-8, 9, (96, 7), generator=gen).float()
    assert torch.equal(accumulated_matmul(a, b), a @ b)  # every partial sum fits in 14 bits


def test_a_step_cuts_addends_below_its_largest():
    # one product of 1 and 31 of 2^-(bits+guard+2): each is below the step's cut, so all are lost
    tiny = 2.0 ** -(ACCUMULATOR_BITS + GUARD_BITS + 2)
    a = torch.tensor([[1.0] + [tiny] * 31])
    assert accumulated_matmul(a, torch.ones(32, 1)).item() == 1.0
    assert (a @ torch.ones(32, 1)).item() > 1.0


def test_the_model_perturbs_fp8_matmuls_only_and_restores_the_emulation():
    q, k, v, dout = make_qkv(1, 2, 1, 96, 96, 64, dtype=torch.float32, seed=3)
    mask, scale = MaskSpec(causal=True), 64**-0.5
    helpers = reference._matmul, reference._dense_backward
    for recipe, fp8_backward in (("fp8_delta", True), ("hybrid_delta", False)):
        config = RECIPES[recipe]
        out, lse = emulated_forward(q, k, v, scale=scale, mask=mask, config=config)
        grads = emulated_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config)
        with hopper_accumulation():
            out_m, _ = emulated_forward(q, k, v, scale=scale, mask=mask, config=config)
            grads_m = emulated_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config)
        assert 0 < rel_err(out_m, out) < 2e-2, recipe  # the FP8 forward accumulates in the model
        if fp8_backward:
            assert all(0 < rel_err(g, r) < 2e-2 for g, r in zip(grads_m, grads))
        else:  # the bf16 backward's matmuls accumulate in fp32: unchanged
            assert all(torch.equal(g, r) for g, r in zip(grads_m, grads))
    assert (reference._matmul, reference._dense_backward) == helpers
