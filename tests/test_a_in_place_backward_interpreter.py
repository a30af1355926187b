"""The Triton backward's A operands in the token order of their products (``backward.A_IN_PLACE_TRITON``),
under the Triton interpreter: with K's, Q's and dO's channel-wise copies written in
``quantize.pv_token_order``'s order and dS's, Pᵀ's and dSᵀ's codes put in the same order, dQ, dK and
dV are the plain launches' to the rounding of the products' fp32 sums (causal and not, GQA, the
tile recipe, the one-sweep dQ); the switch applies to dense batches whose contracted length is a
multiple of 16 only, and a kernel that takes the order from copies in token order fails the bounds.
"""
from __future__ import annotations

import pytest
import torch

from helpers import make_qkv
from hf_fp8_attention import RECIPES, reference
from hf_fp8_attention.kernels import backward, backward_fp8, quantize
from hf_fp8_attention.kernels.quantize import interpreting
from hf_fp8_attention.masking import MaskSpec

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")

LAUNCH, PLAN = backward.launch_kernel, quantize.plan_quantize
U = 2.0**-24  # fp32 unit roundoff
DEQUANT = 1.1  # the codes' dequantized products against the real ones (FP8 steps: <= 2^-4 each)


def _backward(inputs, mask, config, monkeypatch, on: bool, force_kernel: bool | None = None):
    """``triton_backward`` with the switch ``on``; returns ((dq, dk, dv), the A_IN_PLACE each Triton
    launch that forms a gradient got, whether any channel-wise copy was asked in the P·V order).
    ``force_kernel``: hand the kernels this A_IN_PLACE whatever the copies' order."""
    monkeypatch.setattr(backward, "A_IN_PLACE_TRITON", on)
    seen = {"in_place": set(), "col_pv": False}
    launch, plan = LAUNCH, PLAN  # the real ones, not an earlier call's spies

    def spy_launch(kernel, grid, *args, **kwargs):
        forms = kwargs.get("GRADS") if kernel is backward_fp8.bwd_dq_fp8_kernel else True
        if kernel in (backward_fp8.bwd_dq_fp8_kernel, backward_fp8.bwd_dkdv_fp8_kernel) and forms:
            if force_kernel is not None:
                kwargs["A_IN_PLACE"] = force_kernel
            seen["in_place"].add(kwargs["A_IN_PLACE"])
        return launch(kernel, grid, *args, **kwargs)

    def spy_plan(xs, copies, **kwargs):
        seen["col_pv"] |= any(c.col and c.col_pv for c in copies)
        return plan(xs, copies, **kwargs)

    monkeypatch.setattr(backward, "launch_kernel", spy_launch)
    monkeypatch.setattr(quantize, "plan_quantize", spy_plan)
    q, k, v, do = inputs
    scale = q.shape[-1] ** -0.5
    out, lse = reference.emulated_forward(q, k, v, scale=scale, mask=mask, config=config)
    grads = backward.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    return grads, seen["in_place"], seen["col_pv"]


def _order_bounds(inputs) -> tuple[float, float, float]:
    """How far reordering the products' fp32 sums can move dQ, dK and dV (two orders of n terms:
    each within n·u·Σ|terms| of the exact sum). With P >= 0 summing to 1 per row, |D| <= max|dP|
    and |dP| <= ‖dO_i‖·‖V_j‖ =: g: Σ_j |dS_ij| <= 2g per query, Σ_i |dS_ij| <= 2g·Sq and
    Σ_i P_ij <= Sq per key; τ = d^-0.5."""
    q, k, v, do = inputs
    sq, sk, d = q.shape[2], k.shape[2], q.shape[3]
    tau = d**-0.5
    g = do.norm(dim=-1).max().item() * v.norm(dim=-1).max().item()
    dq = 2 * sk * U * DEQUANT * tau * 2 * g * k.abs().max().item()
    dk = 2 * sq * U * DEQUANT * tau * 2 * g * sq * q.abs().max().item()
    dv = 2 * sq * U * DEQUANT * sq * do.abs().max().item()
    return dq, dk, dv


def _max_diffs(got, want) -> list[float]:
    return [(a - b).abs().max().item() for a, b in zip(got, want)]


@pytest.mark.parametrize("recipe, causal, s, gqa, one_sweep", [
    ("fp8_delta", True, 48, 1, False),
    ("fp8_delta_fast", False, 48, 2, False),
    ("fp8_delta_tile", True, 48, 1, False),
    ("fp8_stale", False, 48, 2, False),
    ("fp8_delta_fast", True, 48, 1, True),
    ("fp8_delta", True, 40, 1, False),
])
def test_a_operands_in_the_token_order_keep_the_gradients(recipe, causal, s, gqa, one_sweep, monkeypatch):
    """48 tokens: the 64-token tiles' one ragged tile at a multiple of 16; 40: not a multiple of 16,
    so the switch does not apply there."""
    config = RECIPES[recipe].replace(backend="triton", dq_in_stats=one_sweep)
    q, k, v, do = make_qkv(1, 2 * gqa, 2, s, d=64, dtype=torch.float32, seed=21, outliers=True)
    inputs, mask = (q, k, v, do), MaskSpec(causal=causal)
    want, plain, plain_pv = _backward(inputs, mask, config, monkeypatch, False)
    got, in_place, pv = _backward(inputs, mask, config, monkeypatch, True)
    assert plain == {False} and not plain_pv
    assert in_place == {s % 16 == 0} and pv is (s % 16 == 0)
    for diff, bound in zip(_max_diffs(got, want), _order_bounds(inputs)):
        assert diff <= bound, (diff, bound)


def test_codes_in_another_order_than_the_copies_fail_the_bounds(monkeypatch):
    """The bounds above catch a kernel that permutes its codes while the copies stay in token order."""
    config = RECIPES["fp8_delta"].replace(backend="triton")
    inputs = make_qkv(1, 2, 2, 48, d=64, dtype=torch.float32, seed=22)
    mask = MaskSpec(causal=True)
    want, *_ = _backward(inputs, mask, config, monkeypatch, False)
    got, in_place, pv = _backward(inputs, mask, config, monkeypatch, False, force_kernel=True)
    assert in_place == {True} and not pv
    assert all(diff > bound for diff, bound in zip(_max_diffs(got, want), _order_bounds(inputs)))


def test_packed_batches_keep_the_token_order(monkeypatch):
    config = RECIPES["fp8_delta"].replace(backend="triton")
    q, k, v, do = make_qkv(1, 2, 1, 48, d=64, dtype=torch.float32, seed=23)
    cu = torch.tensor([0, 16, 48], dtype=torch.int32)
    mask = MaskSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    _, in_place, pv = _backward((q, k, v, do), mask, config, monkeypatch, True)
    assert in_place == {False} and not pv
