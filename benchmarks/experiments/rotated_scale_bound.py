"""Errors of the per-(sequence, head) scales of the QKᵀ operands (K for ``fp8_delta``, Q and K for
``fp8_delta_fast``) taken from a bound that needs no rotation, against the exact amax of the
rotated (and smoothed) operand, which the statistics launch rotates every token to find.

The bound: the rotation is a ±1 Hadamard matrix in blocks of n channels, so each rotated element
of a token x obeys |((x − μ)H)_j| ≤ √n · ‖x − μ‖₂ ≤ √n · (Σ_c e_c²)^½ with
e_c = max(max_t x_tc − μ_c, μ_c − min_t x_tc): per-channel extremes and the mean, one unrotated
read. It would take the rotation out of the statistics launch (benchmarks/NOTES.md, "Recipe" in
"Tried and not kept"). ``--factors`` instead times K's exact amax by each factor (``fp8_delta``):
a power of two moves no code but into or out of the subnormals, other factors round every code
anew, the largest included.

    PYTHONPATH=. python benchmarks/experiments/rotated_scale_bound.py [--fixture F --tokens N]
    PYTHONPATH=. python benchmarks/experiments/rotated_scale_bound.py --factors 1 1.37 2 4 5.5 0.8

CPU emulation, causal, relative errors against float64 attention, all heads at once.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from recipe_errors import DEFAULT_FIXTURE, SCALE, load_layers, recipe_errors  # noqa: E402

from hf_fp8_attention import RECIPES, reference  # noqa: E402
from hf_fp8_attention.config import Granularity  # noqa: E402
from hf_fp8_attention.exact import exact_attention_grads  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from hf_fp8_attention.quant import compute_scales  # noqa: E402
from hf_fp8_attention.transforms import hadamard_block, key_mean, rotate  # noqa: E402


def rotation_free_bound(x: torch.Tensor, mu: torch.Tensor | None) -> torch.Tensor:
    """``x (..., S, D)`` unrotated, ``mu (..., 1, D)`` or None: the bound above, ``(..., 1)``."""
    hi, lo = x.amax(-2, keepdim=True), x.amin(-2, keepdim=True)
    mu = torch.zeros_like(hi) if mu is None else mu
    e = torch.maximum(hi - mu, mu - lo)
    return math.sqrt(hadamard_block(x.shape[-1])) * e.pow(2).sum(-1).sqrt()


def fake_quantize_with(x: torch.Tensor, amax: torch.Tensor, fmt, pow2: bool) -> torch.Tensor:
    """``x (..., S, D)`` with one scale per leading index, from ``amax (..., 1)``."""
    scale = compute_scales(amax, fmt, pow2)[..., None]
    return (x / scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).float() * scale


RATIOS: list[torch.Tensor] = []


def rotated_operands(qg, k, config):
    """Q and K rotated, K smoothed (where the recipe smooths), as
    :func:`hf_fp8_attention.reference.qk_operands` forms them before quantizing: ``(q_t, k_t, mu,
    factor)``, ``mu (..., 1, D)`` the keys' unrotated mean or None."""
    mu = key_mean(k) if config.smooth_k else None
    q_t, k_t = rotate(qg.float()), rotate(k.float())
    if mu is not None:
        k_t = k_t - rotate(mu)
    return q_t, k_t, mu, 1.0 / hadamard_block(qg.shape[-1])


def qk_operands_from_bound(qg, k, config):
    """:func:`hf_fp8_attention.reference.qk_operands` with the per-head scales from the bound."""
    q_t, k_t, mu, factor = rotated_operands(qg, k, config)
    k_bound, q_bound = rotation_free_bound(k.float(), mu), rotation_free_bound(qg.float(), None)
    if config.qdo_scales is Granularity.HEAD:
        q_op = fake_quantize_with(q_t, q_bound, config.q_format, config.pow2_scales)
    else:
        q_op = reference._fq_row(q_t, config.q_format, config.qdo_scales, config)
    RATIOS.append((k_bound[..., 0] / k_t.abs().amax((-2, -1))).flatten())
    return q_op, fake_quantize_with(k_t, k_bound, config.k_format, config.pow2_scales), factor


def qk_operands_scaled_amax(factor: float):
    """``fp8_delta``'s :func:`~hf_fp8_attention.reference.qk_operands` with K's amax times ``factor``
    (< 1: the largest codes clamp at the format's maximum)."""
    def operands(qg, k, config):
        q_t, k_t, _, logit_factor = rotated_operands(qg, k, config)
        q_op = reference._fq_row(q_t, config.q_format, config.qdo_scales, config)
        amax = k_t.abs().amax((-2, -1))[..., None] * factor
        return q_op, fake_quantize_with(k_t, amax, config.k_format, config.pow2_scales), logit_factor
    return operands


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, default=DEFAULT_FIXTURE)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--recipes", nargs="+", default=["fp8_delta", "fp8_delta_fast"])
    parser.add_argument("--factors", nargs="+", type=float, help="K's exact amax times each (fp8_delta)")
    args = parser.parse_args(argv)
    exact_amax = reference.qk_operands
    variants = [("amax", exact_amax), ("bound", qk_operands_from_bound)]
    if args.factors:
        args.recipes = ["fp8_delta"]
        variants = [(f"x{f:g}", qk_operands_scaled_amax(f)) for f in args.factors]
    print(f"{'layer':>5} {'recipe':<15} {'scale':<6} {'O':>7} {'dQ':>7} {'dK':>7} {'dV':>7}  K's bound / amax")
    for layer, tensors in load_layers(args.fixture, args.tokens).items():
        exact = exact_attention_grads(*tensors[:3], tensors[3], scale=SCALE, mask=MaskSpec(causal=True))
        for name in args.recipes:
            config = RECIPES[name].replace(backend="emulation")
            assert config.hadamard and config.kv_scales is Granularity.HEAD, name
            for tag, operands in variants:
                reference.qk_operands, RATIOS[:] = operands, []
                try:
                    err = recipe_errors(*tensors, config, exact)
                finally:
                    reference.qk_operands = exact_amax
                ratio = (f"min {torch.cat(RATIOS).min():.2f} median {torch.cat(RATIOS).median():.2f} "
                         f"max {torch.cat(RATIOS).max():.2f}" if RATIOS else "")
                print(f"{layer:>5} {name:<15} {tag:<6} "
                      + " ".join(f"{100 * err[n]:6.2f}%" for n in ("O", "dQ", "dK", "dV")) + f"  {ratio}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
