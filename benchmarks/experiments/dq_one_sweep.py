"""dQ from the statistics sweep itself: the numerics of a backward whose statistics pass also
forms dQ, so that the separate dQ launch (S, dP and dS·K again) goes.

dS = P ∘ (dP − D), so dQ_i = Σ_j dS_ij K_j = A_i − D_i B_i with A_i = Σ_j (P∘dP)_ij K_j and
B_i = Σ_j P_ij K_j: both accumulate over the keys in one sweep, before D_i is known. In FP8, A's
operand is fq(P∘dP) (one scale per query row, fixed before the sweep: a bound from the row norms,
or the row's exact amax as an oracle) and B's is P on the fixed grid (the recipe's P for dV).
Taking D'_i = Σ_j fq(P∘dP)_ij / Σ_j P̂_ij makes the effective dS_ij = fq(P∘dP)_ij − D'_i P̂_ij sum
to exactly zero over each row, so the matched delta's property holds for dQ.

The risk is cancellation: where dP_ij ≈ D_i for the keys that carry the row's weight, A and D'B
nearly cancel and dQ keeps their quantization error. dP − D = dO_i·(V_j − O_i) is unchanged when V
loses its mean over the tokens (v̄ per (batch, kv head)), while dP itself shrinks: ``vsmooth``
variants compute dP from fq(V − v̄) (the backward reads V only for dP).

    PYTHONPATH=. python benchmarks/experiments/dq_one_sweep.py [--recipes fp8_delta_fast fp8_delta]

On the fixture slice (tests/data), CPU emulation; relative errors of dQ against float64
attention, all heads at once; ``shipped`` is the recipe's own dQ. ``bound_head`` is the bound
``FP8AttentionConfig(dq_in_stats=True)`` implements (its emulation gives the same numbers for the
fast recipe; results: ``benchmarks/results/cpu_dq_one_sweep.log``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from recipe_errors import DEFAULT_FIXTURE, SCALE, emulate, load_layers, rel  # noqa: E402

from hf_fp8_attention import RECIPES  # noqa: E402
from hf_fp8_attention.config import FP8Format  # noqa: E402
from hf_fp8_attention.exact import exact_attention_grads  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from hf_fp8_attention.quant import compute_scales  # noqa: E402
from hf_fp8_attention.reference import (  # noqa: E402
    _fq_col, _fq_row, _grouped, _rows_times, _scores, fp8_round)

E4M3 = FP8Format.E4M3


def with_scale(x: torch.Tensor, amax: torch.Tensor, fmt: FP8Format = E4M3) -> torch.Tensor:
    """fp32 x quantized with the scale for ``amax`` (broadcast against x), dequantized."""
    s = compute_scales(amax, fmt, pow2=False)
    return (x / s).clamp(-fmt.max, fmt.max).to(fmt.dtype).float() * s


def one_sweep_dq(p, dp, k_op, do_op, v_op, *, bound: str) -> torch.Tensor:
    """dQ / τ ``(B, Hkv, G, Sq, D)`` as A − D'·B from P, dP ``(B, Hkv, G, Sq, Sk)``."""
    pdp = p * dp
    # Row scales fixed before the sweep, from bounds on |P_ij dP_ij| <= |dP_ij| (P <= 1), tightest first.
    v_head = v_op.flatten(-2).abs().amax(-1)[..., None, None, None]  # (B, Hkv, 1, 1, 1)
    if bound == "oracle":  # the row's exact amax: needs the row first (what a statistics pass has)
        amax = pdp.abs().amax(-1, keepdim=True)
    elif bound == "bound":  # ||dO_i|| max_j ||V_j||
        amax = do_op.norm(dim=-1, keepdim=True) * v_op.norm(dim=-1).amax(-1)[..., None, None, None]
    elif bound == "bound_head":  # ||dO_i|| sqrt(D) amax(V): V's per-head amax only
        amax = do_op.norm(dim=-1, keepdim=True) * v_op.shape[-1] ** 0.5 * v_head
    else:  # "bound_amax": D amax(dO_i) amax(V): the operands' scales alone
        amax = do_op.abs().amax(-1, keepdim=True) * v_op.shape[-1] * v_head
    if bound != "oracle":  # a power of two at or above: the same scale from any summation order
        amax = (2.0 ** torch.ceil(torch.log2(amax / E4M3.max))) * E4M3.max
    a_codes = with_scale(pdp, amax)
    p_hat = fp8_round(p * E4M3.max, E4M3) / E4M3.max
    d_prime = a_codes.sum(-1) / p_hat.sum(-1).clamp_min(1e-30)
    return _rows_times(a_codes, k_op) - d_prime[..., None] * _rows_times(p_hat, k_op)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["fp8_delta_fast", "fp8_delta"])
    a = ap.parse_args(argv)
    mask = MaskSpec(causal=True)
    bounds = ("oracle", "bound", "bound_head", "bound_amax")
    cols = ("shipped", *bounds, "vsmooth_oracle", "vsmooth_bound")
    print(f"{'layer':>5} {'recipe':<15} " + " ".join(f"{c:>14}" for c in cols) + "   (dQ relative error)")
    for layer, (q, k, v, do) in load_layers(DEFAULT_FIXTURE, 1024).items():
        exact_dq = exact_attention_grads(q, k, v, do, scale=SCALE, mask=mask)[1]
        for name in a.recipes:
            config = RECIPES[name].replace(backend="emulation")
            _, (dq_emul, _, _), internals = emulate(q, k, v, do, config)
            hkv = k.shape[1]
            pr = internals.p
            k_op = _fq_col(k.float(), config.k_format, config.block_k, config)
            row = {"shipped": rel(dq_emul, exact_dq)}
            for smooth in (False, True):
                v_in = v.float() - v.float().mean(dim=-2, keepdim=True) if smooth else v.float()
                do_op = _fq_row(_grouped(do, hkv).float(), config.do_format, config.qdo_scales, config)
                v_op = _fq_row(v_in, config.v_format, config.kv_scales, config)
                dp = _scores(do_op, v_op) if smooth else internals.dp
                for bound in (bounds if not smooth else ("oracle", "bound")):
                    dq = one_sweep_dq(pr, dp, k_op, do_op, v_op, bound=bound) * SCALE
                    row[("vsmooth_" if smooth else "") + bound] = rel(dq.reshape(q.shape), exact_dq)
            print(f"{layer:>5} {name:<15} " + " ".join(f"{100 * row[c]:>13.2f}%" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
