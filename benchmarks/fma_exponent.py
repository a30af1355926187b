"""The Gluon forward's two exponent forms, compared on real activations without a GPU.

The Gluon forward (``kernels/forward_gluon.py``) forms each score's exponent either exactly,
``(x − r)·q2 + log2 448`` (an add and an FMA), or as one FMA, ``x·q2 − (r·q2 − log2 448)``, where
the rounding of ``r·q2 − log2 448`` to fp32 moves every p of the row by up to 2^-24·|r·q2 − log2 448|
relative. A consumer warpgroup takes the FMA where its 64 rows' bound on that magnitude,
``exponent.fma_row_bound``, is below ``FMA_EXPONENT_BOUND``. This script replays the kernel's
online softmax in fp32 arithmetic (each FMA rounded once: the fp32 product is exact in float64) on
the FP8 codes the recipe makes of a fixture's real q and k, and prints per layer:

- the warpgroup bound (max and median over the 64-row groups) against ``FMA_EXPONENT_BOUND``;
- the largest relative difference of p between the forms, and the share of P codes that differ;
- ‖O_fma − O_exact‖ / ‖O_exact‖ and each form's error against float64 attention on the same codes.

    python benchmarks/fma_exponent.py                                  # tests/data slice (d = 64)
    python benchmarks/fma_exponent.py --fixture F --tokens 2048 --recipe fp8_delta_fast
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from recipe_errors import DEFAULT_FIXTURE, SCALE, load_layers  # noqa: E402

from hf_fp8_attention import RECIPES  # noqa: E402
from hf_fp8_attention.config import Granularity  # noqa: E402
from hf_fp8_attention.kernels.constants import LOG2E  # noqa: E402
from hf_fp8_attention.kernels.forward import REF_SLACK  # noqa: E402
from hf_fp8_attention.kernels.exponent import FMA_EXPONENT_BOUND, LOG2_PMAX, fma_row_bound  # noqa: E402
from hf_fp8_attention.kernels.forward_gluon import BLOCK_N, HALF_Q  # noqa: E402
from hf_fp8_attention.quant import quantize  # noqa: E402
from hf_fp8_attention.reference import qk_transformed  # noqa: E402

F32 = torch.float32


def f32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> the nearest fp32 (as float64 again)."""
    return x.to(F32).double()


def exponents(x: torch.Tensor, r: torch.Tensor, q2: torch.Tensor, fma: bool) -> torch.Tensor:
    """The kernel's exponent of each score, fp32-exact: ``x (R, N)`` fp32 code products, ``r (R,)``
    the tile's reference, ``q2 (R,)`` the row factor (all fp32 values in float64)."""
    if fma:
        c = f32(r * q2 - LOG2_PMAX)  # one FMA: the fp32 product is exact in float64
        return f32(x * q2[:, None] - c[:, None])
    return f32(f32(x - r[:, None]) * q2[:, None] + LOG2_PMAX)


def operands(q, k, config):
    """FP8 codes and scales of S = QKᵀ as the recipe makes them: ``(qc (H, S, D), sq (H, S),
    kc (Hkv, S, D), sk (Hkv,), factor)`` (float64), for the fixture's ``q (1, H, S, D)``."""
    qt, kt, factor = qk_transformed(q[0], k[0], config)  # (H, S, D) and (Hkv, S, D): the transforms are per row
    if config.qdo_scales is Granularity.HEAD:
        qc, sq = quantize(qt.reshape(qt.shape[0], -1), dim=-1, block=None)
        qc, sq = qc.reshape(qt.shape), sq.expand(-1, qt.shape[1])
    else:
        qc, sq = quantize(qt, dim=-1, block=None)
        sq = sq[..., 0]
    kc, sk = quantize(kt.reshape(kt.shape[0], -1), dim=-1, block=None)
    return qc.double(), sq.double(), kc.reshape(kt.shape).double(), sk.reshape(-1).double(), factor


def online_forward(x: torch.Tensor, q2: torch.Tensor, v: torch.Tensor, fma: bool):
    """Causal rows ``x (R, S)`` (fp32 code products; row i sees keys <= i) through the kernel's
    per-tile references (REF_SLACK), P's codes in E4M3. Returns (O (R, D) float64, p (R, S), codes)."""
    rows, sk = x.shape
    keys = torch.arange(sk)
    visible = keys[None, :] <= torch.arange(rows)[:, None]
    x = torch.where(visible, x, -math.inf)
    m = torch.full((rows,), -math.inf, dtype=torch.float64)
    r_prev = torch.full((rows,), -math.inf, dtype=torch.float64)
    acc = torch.zeros(rows, v.shape[-1], dtype=torch.float64)
    l = torch.zeros(rows, dtype=torch.float64)
    p_all, codes_all = torch.zeros_like(x), torch.zeros_like(x)
    slack_x = f32(REF_SLACK / q2)
    for t0 in range(0, sk, BLOCK_N):
        xt = x[:, t0:t0 + BLOCK_N]
        m_t = xt.amax(dim=1)
        m_new = torch.maximum(m, m_t)
        r_t = torch.maximum(m_t, f32(m_new - slack_x))
        r_ref = torch.where(r_t == -math.inf, 0.0, r_t)
        p = f32(torch.exp2(exponents(xt, r_ref, q2, fma)))
        gamma = torch.where(r_prev == -math.inf, 0.0, torch.exp2(f32(r_prev - r_ref) * q2))
        codes = p.to(F32).to(torch.float8_e4m3fn).double()
        l = l * gamma + p.sum(dim=1)
        acc = acc * gamma[:, None] + codes @ v[t0:t0 + BLOCK_N]
        m, r_prev = m_new, r_ref
        p_all[:, t0:t0 + BLOCK_N], codes_all[:, t0:t0 + BLOCK_N] = p, codes
    return acc / torch.where(l == 0, 1.0, l)[:, None], p_all, codes_all


def compare(q, k, v, config) -> dict[str, float]:
    """The two forms on one layer (every query head, causal): the statistics of the module docstring."""
    qc, sq, kc, sk, factor = operands(q, k, config)
    group = qc.shape[0] // kc.shape[0]
    qk_scale = SCALE * LOG2E * factor
    out = {"bound_max": 0.0, "bounds": [], "dp": 0.0, "flips": 0, "scores": 0, "o_diff": [], "o_err": [[], []]}
    for h in range(qc.shape[0]):
        kv = h // group
        q2 = f32(f32(sq[h] * qk_scale) * sk[kv])
        out["bounds"] += [fma_row_bound(q2[i:i + HALF_Q].max().item(), qc.shape[-1], REF_SLACK)
                          for i in range(0, q2.shape[0], HALF_Q)]
        x = f32(qc[h] @ kc[kv].T)
        vh = v[0, kv].double()
        (o_e, p_e, c_e), (o_f, p_f, c_f) = (online_forward(x, q2, vh, fma) for fma in (False, True))
        seen = p_e > 0
        out["dp"] = max(out["dp"], ((p_f[seen] / p_e[seen]) - 1).abs().max().item())
        out["flips"] += int((c_f != c_e).sum())
        out["scores"] += int(seen.sum())
        exact = torch.softmax(torch.where(torch.ones_like(x, dtype=torch.bool).tril(), x * q2[:, None] / LOG2E,
                                          -math.inf), dim=1) @ vh
        out["o_diff"].append(((o_f - o_e).norm() / o_e.norm()).item())
        for i, o in enumerate((o_e, o_f)):
            out["o_err"][i].append(((o - exact).norm() / exact.norm()).item())
    bounds = torch.tensor(out["bounds"])
    return {"bound_max": bounds.max().item(), "bound_median": bounds.median().item(), "dp": out["dp"],
            "flip_share": out["flips"] / out["scores"], "o_diff": max(out["o_diff"]),
            "o_err_exact": max(out["o_err"][0]), "o_err_fma": max(out["o_err"][1])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, default=DEFAULT_FIXTURE)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--recipe", default="fp8_delta")
    args = parser.parse_args(argv)
    config = RECIPES[args.recipe]
    print(f"{args.recipe}, {args.tokens} tokens, causal; FMA_EXPONENT_BOUND = {FMA_EXPONENT_BOUND:g}")
    print(f"{'layer':>5} {'bound max':>10} {'median':>8} {'max |dp|/p':>11} {'codes moved':>12} "
          f"{'O fma vs exact':>15} {'O err exact':>12} {'O err fma':>10}")
    for layer, (q, k, v, _) in load_layers(args.fixture, args.tokens).items():
        s = compare(q, k, v, config)
        print(f"{layer:>5} {s['bound_max']:10.0f} {s['bound_median']:8.0f} {s['dp']:11.2e} {s['flip_share']:12.2e} "
              f"{s['o_diff']:15.2e} {s['o_err_exact']:12.4%} {s['o_err_fma']:10.4%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
