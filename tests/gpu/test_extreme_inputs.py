"""The Triton kernels at extreme inputs (the CPU path's twins are in tests/test_reference.py).

- Huge logits: q = k = a·1, v = 1, causal. Every key of a row is the same, so every P code is the
  row max's, 448, and the exact output 1 comes out to fp32 rounding — if the max's exponent is
  exactly log2 448 (kernels/forward.py: exponents are formed in the units of the raw product, not
  from a rounded log2 reference, whose rounding saturated the codes beyond |logits| ~ 1e6).
- fp16 at the top of its range (logits 2.9e10): finite outputs equal to v.
- A query that sees a single key: P = 1, so dS = P (dP − D) = 0 with the matched D = dP, and dQ, dK
  are exactly 0 (kernels/backward_fp8.py: dP is rounded on its own, never fused into dP − D).

Recipes with K-smoothing subtract the keys' mean, here every key, which leaves logits of 0: the
large-logit cases run the recipes with the transforms off.
"""
from __future__ import annotations

import pytest
import torch

from hf_fp8_attention import RECIPES, fp8_attention

pytestmark = pytest.mark.gpu

NO_TRANSFORMS = {
    "fp8_delta_tile": RECIPES["fp8_delta_tile"],
    "fp8_delta": RECIPES["fp8_delta"].replace(smooth_k=False, hadamard=False),
    "fp8_delta_fast": RECIPES["fp8_delta_fast"].replace(smooth_k=False, hadamard=False),
}
MATCHED = ("fp8_delta", "fp8_delta_fast", "fp8_delta_tile", "hybrid_delta")


@pytest.mark.parametrize("name", sorted(NO_TRANSFORMS))
@pytest.mark.parametrize("a", [100.0, 1000.0, 3000.0])
def test_huge_logits_keep_rows_normalised(a, name):
    q = torch.full((1, 2, 300, 64), a, device="cuda")
    v = torch.ones_like(q)
    out = fp8_attention(q, q, v, causal=True, config=NO_TRANSFORMS[name].replace(backend="triton"))
    assert (out - 1).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", sorted(NO_TRANSFORMS) + ["fp8_delta_default"])
def test_fp16_near_the_top_of_the_range_gives_v(name):
    x = torch.full((1, 2, 256, 64), 6e4, dtype=torch.float16, device="cuda")
    config = RECIPES["fp8_delta"] if name == "fp8_delta_default" else NO_TRANSFORMS[name]
    out = fp8_attention(x, x, x, causal=True, config=config.replace(backend="triton"))
    assert torch.isfinite(out).all()
    assert (out.float() - 6e4).abs().max().item() <= 32  # fp16's spacing at 6e4


def _single_key_problems():
    g = torch.Generator(device="cuda").manual_seed(0)
    dense = [torch.randn(2, 4, 1, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4)]
    n = 300  # packed sequences of one token each: every tile masked, every row one key
    packed = [torch.randn(1, 4, n, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4)]
    cu = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    return {"dense": (dense, {}), "packed": (packed, {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "causal": True})}


@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("name", MATCHED)
def test_a_query_that_sees_one_key_gets_zero_dq_and_dk(name, layout):
    (q, k, v, dout), kwargs = _single_key_problems()[layout]
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = fp8_attention(q, k, v, config=RECIPES[name].replace(backend="triton"), **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert not dq.any() and not dk.any()
    assert dv.abs().amax() > 0  # the gradient that is not zero still flows
