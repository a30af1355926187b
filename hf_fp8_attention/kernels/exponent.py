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

Two switches, one a kernel, set by what each measured (``benchmarks/NOTES.md``, "Forward"):
``FMA_EXPONENT`` (the Gluon forward, head dim 128) is on: 1-6% faster forwards on an H100 and
4-10% on an H200 over the op grid's four shapes. ``FMA_EXPONENT_TRITON`` (the Triton forward: other
head dims, packed batches, windows) is off: at head dim 64 its forward ran 0-12% slower with it,
the second form's registers and spills costing more than the FMA saves. With a switch off, its
kernel compiles to the exact form alone.
"""
from __future__ import annotations

import math

LOG2_PMAX = math.log2(448.0)  # P's codes: the reference's exponent, log2 of E4M3's largest value
FMA_EXPONENT = True  # the Gluon forward
FMA_EXPONENT_TRITON = False  # the Triton forward
FMA_EXPONENT_BOUND = 2.0**14


def fma_row_bound(q2_max: float, head_dim: int, slack: float) -> float:
    """The bound a kernel compares with its FMA_BOUND, in Python: |r·q2 − log2 448| over rows whose
    largest row factor is ``q2_max`` (|x| <= head_dim · 448², r within ``slack`` log2 units of a
    row's max). NaN for a NaN factor, so that the comparison fails."""
    return q2_max * (head_dim * 448.0 * 448.0) + slack + LOG2_PMAX


def fma_bound(triton: bool = False) -> float:
    """A forward kernel's FMA_BOUND constexpr: ``FMA_EXPONENT_BOUND`` where its switch is on
    (``FMA_EXPONENT_TRITON`` for the Triton forward, ``triton=True``; ``FMA_EXPONENT`` for the Gluon
    one), else 0 (the exact form everywhere, and no second copy of the loops compiled)."""
    return float(FMA_EXPONENT_BOUND) if (FMA_EXPONENT_TRITON if triton else FMA_EXPONENT) else 0.0


def set_fma_exponent(on: bool) -> None:
    """Both forwards' switches at once (the benchmarks' ``--fma-exponent 0|1``)."""
    global FMA_EXPONENT, FMA_EXPONENT_TRITON
    FMA_EXPONENT = FMA_EXPONENT_TRITON = bool(on)


__all__ = ["FMA_EXPONENT", "FMA_EXPONENT_BOUND", "FMA_EXPONENT_TRITON", "LOG2_PMAX", "fma_bound", "fma_row_bound",
           "set_fma_exponent"]
