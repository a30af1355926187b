"""The Triton forward's P codes in the P·V order (``forward.P_IN_PLACE_TRITON``), under the Triton
interpreter: with Vᵀ's keys written in ``quantize.pv_token_order``'s order and P's codes put in the
same order, O and LSE are the plain kernel's to the rounding of P·V's sums (causal and not, the
per-sequence and per-tile channel scales, a ragged last key tile); the switch applies to dense
batches whose key length is a multiple of 16 only.
"""
from __future__ import annotations

import pytest
import torch

from helpers import make_qkv
from hf_fp8_attention import RECIPES
from hf_fp8_attention.kernels import forward, quantize
from hf_fp8_attention.kernels.quantize import interpreting
from hf_fp8_attention.masking import MaskSpec

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")


def _forward(q, k, v, mask, config, monkeypatch, on: bool):
    """``triton_forward`` with the switch ``on``; returns (out, lse, the launch's P_IN_PLACE, whether
    V's channel-wise copy was asked in the P·V order)."""
    monkeypatch.setattr(forward, "P_IN_PLACE_TRITON", on)
    seen = {}
    launch, plan = forward.launch_kernel, quantize.plan_quantize

    def spy_launch(kernel, grid, *args, **kwargs):
        if kernel is forward._fwd_kernel:
            seen["in_place"] = kwargs["P_IN_PLACE"]
        return launch(kernel, grid, *args, **kwargs)

    def spy_plan(xs, copies, **kwargs):
        seen.setdefault("col_pv", any(c.col and c.col_pv for c in copies))
        return plan(xs, copies, **kwargs)

    monkeypatch.setattr(forward, "launch_kernel", spy_launch)
    monkeypatch.setattr(quantize, "plan_quantize", spy_plan)
    out, lse = forward.triton_forward(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask, config=config, block_m=16)
    return out, lse, seen["in_place"], seen["col_pv"]


@pytest.mark.parametrize("recipe, causal, sk", [("fp8_delta", True, 48), ("fp8_delta_fast", False, 48),
                                                ("fp8_delta_tile", True, 48), ("fp8_delta", False, 40)])
def test_p_in_the_pv_order_keeps_the_outputs(recipe, causal, sk, monkeypatch):
    """48 keys in tiles of 32: one whole tile, one ragged (16 keys); 40 keys: not a multiple of 16,
    so the switch does not apply there."""
    config = RECIPES[recipe].replace(backend="triton", block_q=16, block_k=32)
    q, k, v, _ = make_qkv(1, 2, 1, 48, sk=sk, d=64, dtype=torch.float32, seed=11, outliers=True)
    mask = MaskSpec(causal=causal)
    want, want_lse, plain, plain_pv = _forward(q, k, v, mask, config, monkeypatch, False)
    got, got_lse, in_place, pv = _forward(q, k, v, mask, config, monkeypatch, True)
    assert not plain and not plain_pv
    assert in_place is pv is (sk % 16 == 0)
    # Only P·V's fp32 sums run in another order: each output moves by at most sk·2^-24 of Σ|p||v|/l,
    # which is at most max|v| (p >= 0 sums to l), with the codes' dequantization error on top.
    bound = sk * 2.0**-24 * 1.1 * v.abs().max().item()
    assert (got - want).abs().max().item() <= bound
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=0)  # l: the same fp32 sums, in order


def test_packed_batches_keep_the_token_order(monkeypatch):
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=16, block_k=32)
    q, k, v, _ = make_qkv(1, 2, 1, 48, d=64, dtype=torch.float32, seed=12)
    mask = MaskSpec(causal=True, cu_seqlens_q=torch.tensor([0, 16, 48], dtype=torch.int32),
                    cu_seqlens_k=torch.tensor([0, 16, 48], dtype=torch.int32))
    *_, in_place, pv = _forward(q, k, v, mask, config, monkeypatch, True)
    assert not in_place and not pv
