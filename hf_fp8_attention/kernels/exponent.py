"""The forward kernels' exponent form: exact, or one FMA where a bound on the logits allows it.

Both forward kernels (``forward._fwd_kernel`` for the block-free recipes without logit modifiers,
``forward_gluon``) form each score's P code as 2^e with, in the units of x = Qc·Kcᵀ (the code
products) and the row factor q2 (log2 units per x unit),

    exact:  e = (x − r)·q2 + log2 448          an add and an FMA per score
    FMA:    e = x·q2 − (r·q2 − log2 448)        one FMA per score (r·q2 − log2 448 once per row)

where r is the tile's reference (its row max, or the running max less REF_SLACK). The exact form
gives the element that sets the reference e = log2 448 exactly at any logit size; the FMA form
rounds r·q2 − log2 448 to fp32 first, which moves every p of the row by up to 2^-24·|r·q2 − log2 448|
relative: at logits of ~1e6 the max's code saturated while l counted it in full (forward.py's module
docstring). So a kernel takes the FMA form only for rows whose bound on |r·q2 − log2 448|
(:func:`fma_row_bound`: |x| <= D·448², r within REF_SLACK of a row's max) is below
``FMA_EXPONENT_BOUND`` = 2^14, where p moves by at most 2^-24 · 2^14 · ln 2 = 6.8e-4 relative (by
~2^-19 at real logits, |r·q2| ~ 30-40), against 2^-4 to 2^-3 between E4M3 codes; larger bounds take
the exact form. On the real-activation fixture the bound is 866-934 at most
(``benchmarks/fma_exponent.py``). The decision comes from the largest row factor, once per consumer
warpgroup in the Gluon kernel (its MMAs are warpgroup-wide; both tile loops are compiled) and once
per program in the Triton kernel, which branches around each tile's exponents inside its one loop
(a second copy of its loops doubled their pipelined shared memory, 115 -> 214 KB, offline).

Off by default (``FMA_EXPONENT``) until timed on a GPU: with it off both kernels compile to their
previous SASS.
"""
from __future__ import annotations

import math

LOG2_PMAX = math.log2(448.0)  # P's codes: the reference's exponent, log2 of E4M3's largest value
FMA_EXPONENT = False
FMA_EXPONENT_BOUND = 2.0**14


def fma_row_bound(q2_max: float, head_dim: int, slack: float) -> float:
    """The bound a kernel compares with its FMA_BOUND, in Python: |r·q2 − log2 448| over rows whose
    largest row factor is ``q2_max`` (|x| <= head_dim · 448², r within ``slack`` log2 units of a
    row's max). NaN for a NaN factor, so that the comparison fails."""
    return q2_max * (head_dim * 448.0 * 448.0) + slack + LOG2_PMAX


def fma_bound() -> float:
    """The kernels' FMA_BOUND constexpr: ``FMA_EXPONENT_BOUND`` where ``FMA_EXPONENT`` is on, else 0
    (the exact form everywhere, and no second copy of the loops compiled)."""
    return float(FMA_EXPONENT_BOUND) if FMA_EXPONENT else 0.0


__all__ = ["FMA_EXPONENT", "FMA_EXPONENT_BOUND", "LOG2_PMAX", "fma_bound", "fma_row_bound"]
