"""Input makers and the error-budget table shared by the numerics tests.

FP8 error budget (relative Frobenius error against float64 attention, random-normal inputs).
E4M3 keeps 3 mantissa bits: unit roundoff u = 2^-4 = 6.25%. Each FP8 matmul operand carries a
per-element rounding error of at most u (RMS about u/3 for uniform mantissas), and the errors of
independent elements average out in the sums, so one level of quantized matmul lands near u/2:
  - O and dV pass through two quantized operands (S's operands via P, and V or dO): budget u.
  - dQ and dK pass through three levels (S's operands, dP's operands, then dS and K/Q): budget 1.5u.
The hybrid (bf16) backward has bf16 operands (u = 2^-8) but inherits the FP8 forward's P only
through LSE/O; matched hybrid gradients must land within 4 bf16 units (1.6%).
A broken tile, scale or mask gives O(1) errors, far outside these budgets; exact agreement with the
kernels is checked separately (same quantization, tight bounds).
"""
import torch

U_E4M3 = 2.0**-4
BUDGET = {"out": U_E4M3, "dv": U_E4M3, "dq": 1.5 * U_E4M3, "dk": 1.5 * U_E4M3}
HYBRID_MATCHED_GRAD_BUDGET = 4 * 2.0**-8


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def assert_within_budget(results, reference, budget=BUDGET):
    """``results``/``reference``: (out, dq, dk, dv). An exactly-zero reference demands exact zeros
    (e.g. dq = dk = 0 when every query sees a single key: the softmax is constant)."""
    for name, x, ref in zip(("out", "dq", "dk", "dv"), results, reference):
        if ref.norm() == 0:
            assert not x.any(), f"{name} must be exactly zero"
        else:
            assert rel_err(x, ref) <= budget[name], (name, rel_err(x, ref), budget[name])


def make_qkv(b=1, hq=4, hkv=2, sq=128, sk=None, d=64, dtype=torch.bfloat16, seed=0, outliers=False):
    """Random q ``(b, hq, sq, d)``, k/v ``(b, hkv, sk, d)``, dout like q.

    ``outliers`` adds what trained LLMs show: a few large channels in q/k, a key bias along one
    channel, and an attention-sink key (position 0) aligned with the mean query.
    """
    g = torch.Generator().manual_seed(seed)
    sk = sq if sk is None else sk
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, sk, d, generator=g)
    v = torch.randn(b, hkv, sk, d, generator=g)
    dout = torch.randn(b, hq, sq, d, generator=g)
    if outliers:
        q[..., :2] *= 4.0
        k[..., :2] *= 4.0
        k[..., 3] += 8.0
        k[:, :, 0, :] = 3.0 * q.mean(dim=(1, 2))[:, None, :]
    return tuple(t.to(dtype) for t in (q, k, v, dout))
