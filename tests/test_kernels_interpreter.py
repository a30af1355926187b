"""The Triton quantization and forward kernels, run by the Triton interpreter on the CPU.

The interpreter must be switched on before Triton compiles anything (``TRITON_INTERPRET`` is read
when the ``@triton.jit`` functions are created), so the checks run once in a subprocess with the
variable set (split over one subprocess per CPU core); each case below asserts on that run's result. Shapes are tiny (the interpreter runs
every program in NumPy) but cover every masking path: full tiles, masked tiles, skipped tiles,
GQA, varlen with empty sequences and fully masked rows, odd lengths, head dims 80, 96 and 256.

Tolerances (kernel vs emulation, same config). Under the interpreter the kernels round every FP8
code explicitly to nearest even, so Q/K/V codes and scales equal the emulation's bit for bit
(asserted exactly). What remains is fp32 summation order (QKᵀ over d, PV over keys, the online
rescaling) and exp2 vs exp: relative ~1e-6 at these sizes, hence 2e-5 on ‖Δ‖/‖ref‖ for fp32 inputs,
and on |ΔLSE| / max(1, |LSE|) (the logits' own fp32 rounding scales with their size).
A P code sitting on a rounding boundary may flip by one step (probability ~1e-6 per element; more
where the keys' channel mean, summed in another order, leaves a smoothed K element near zero): that
moves one query row's output by one step of one term, at most 2^-3·P_ij·‖v_j‖ ≤ 2^-3·max_j ‖v_j‖
(the default recipe's window_noncausal case showed one: 0.137 in one row, 1.7e-3 over the whole
output). So for fp32 inputs the bounds hold over all rows but the worst one, whose error is at most
one flip's; max-abs bound 2e-3·max|ref| (small terms' flips) on the same rows.
bf16 inputs: the interpreter's fp32 -> bf16 output cast truncates, so each element may differ by one
bf16 step (2^-7 relative) from the emulation's round-to-nearest output.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hf_fp8_attention.kernels.quantize import max_nan, min_nan, reduce_max_nan, reduce_min_nan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# name: (B, Hq, Hkv, Sq, Sk, D, causal, window, varlen cu_seqlens_q / _k, dtype, pow2, block_k, block_m)
FORWARD_CASES = {
    "full": (1, 2, 1, 20, 37, 64, False, None, None, "float32", False, 16, 16),
    # Sk a multiple of block_k, no causal mask or window: only the interior loop is compiled.
    "full_kv_aligned": (1, 2, 1, 20, 48, 64, False, None, None, "float32", False, 16, 16),
    "causal_end_aligned": (1, 2, 1, 20, 37, 64, True, None, None, "float32", False, 16, 16),
    "causal_gqa4_d96": (2, 4, 1, 33, 33, 96, True, None, None, "float32", False, 16, 32),
    "causal_gqa2_d80": (1, 2, 1, 37, 37, 80, True, None, None, "float32", False, 16, 16),
    "window_causal_skips_tiles": (1, 2, 2, 70, 70, 64, True, 9, None, "float32", False, 16, 16),
    "window_noncausal": (1, 2, 2, 37, 50, 64, False, 8, None, "float32", False, 16, 16),
    # Sk a multiple of block_k: the masked tiles (diagonal, window edges) load like interior ones.
    "window_causal_kv_aligned": (1, 2, 2, 50, 64, 64, True, 9, None, "float32", False, 16, 16),
    "window_noncausal_kv_aligned": (1, 2, 1, 37, 48, 64, False, 8, None, "float32", False, 16, 16),
    "len1_decode": (1, 2, 1, 1, 45, 128, True, None, None, "float32", False, 32, 16),
    "len17": (1, 1, 1, 17, 17, 128, True, None, None, "float32", True, 16, 16),
    "varlen_causal": (1, 2, 1, None, None, 64, True, None, ([0, 5, 22, 22, 40], [0, 5, 22, 22, 40]),
                      "float32", False, 16, 16),
    # q longer than k in a sequence: its first rows see no key (O = 0, LSE = -inf).
    "varlen_masked_rows": (1, 2, 2, None, None, 64, True, None, ([0, 7, 19], [0, 3, 30]), "float32", True, 16, 16),
    "varlen_window": (1, 2, 1, None, None, 96, False, 5, ([0, 11, 40], [0, 20, 41]), "float32", False, 16, 16),
    "bf16_causal": (2, 2, 1, 33, 33, 128, True, None, None, "bfloat16", False, 32, 16),
    # Head dim 256: the rotation's two 128-channel Hadamard blocks, 256-wide codes and scales (a
    # packed, windowed d = 256 case runs in tests/test_kernel_matrix_interpreter.py's slice).
    "causal_gqa2_d256": (1, 2, 1, 21, 21, 256, True, None, None, "float32", False, 16, 16),
    # Key tiles far below the running max (see KEY_TILE_GAIN): the forward's reference slack.
    "logit_gaps": (1, 2, 1, 20, 64, 64, False, None, None, "float32", False, 16, 16),
    "logit_gaps_causal": (1, 2, 1, 64, 64, 64, True, None, None, "float32", False, 16, 16),
}

# Per key tile, a gain on K: tile 1's logits (std 60) lie so far above the other tiles' that their
# maxima fall more than the forward's REF_SLACK below the running max (tile 0 before the jump, tiles
# 2 and 3 after it), often by more than 2^128: acc and l must neither overflow (as they do without
# the slack) nor drop the small tiles' weight beyond fp32 rounding.
KEY_TILE_GAIN = {"logit_gaps": (1.0, 60.0, 1.0, 0.3), "logit_gaps_causal": (1.0, 60.0, 1.0, 0.3)}


def _forward_case(name, seed):
    import torch

    from hf_fp8_attention.config import FP8AttentionConfig
    from hf_fp8_attention.kernels.forward import triton_forward
    from hf_fp8_attention.masking import MaskSpec
    from hf_fp8_attention.reference import emulated_forward

    b, hq, hkv, sq, sk, d, causal, window, cu, dtype, pow2, bk, bm = FORWARD_CASES[name]
    gen = torch.Generator().manual_seed(seed)
    cfg = FP8AttentionConfig(block_k=bk, pow2_scales=pow2)
    cu_q = cu_k = None
    if cu is not None:
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in cu)
        sq, sk = cu[0][-1] + 3, cu[1][-1] + 2  # trailing tokens outside every sequence
    dt = getattr(torch, dtype)
    # Non-contiguous q (a transposed view) exercises the stride arguments.
    q = torch.randn(b, sq, hq, d, generator=gen).to(dt).transpose(1, 2)
    k = torch.randn(b, hkv, sk, d, generator=gen)
    gains = KEY_TILE_GAIN.get(name)
    if gains is not None:
        k = k * torch.tensor(gains).repeat_interleave(bk)[:sk, None]
    k = k.to(dt)
    v = (torch.randn(b, hkv, sk, d, generator=gen) * 3).to(dt)
    mask = MaskSpec(causal=causal, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = triton_forward(q, k, v, scale=d**-0.5, mask=mask, config=cfg, block_m=bm)
    ref, ref_lse = emulated_forward(q, k, v, scale=d**-0.5, mask=mask, config=cfg)
    o, r = out.double(), ref.double()
    fin = torch.isfinite(ref_lse)
    row_err = (o - r).norm(dim=-1).flatten()  # one per (batch, head, query)
    worst = int(row_err.argmax())
    others = torch.ones_like(row_err, dtype=torch.bool)
    others[worst] = False
    diff_rows, ref_rows = (o - r).flatten(0, 2)[others], r.flatten(0, 2)[others]
    return {
        "rel": ((o - r).norm() / r.norm()).item(),
        # all rows but the worst one (a code flip reaches one query row, see the module docstring)
        "rel_but_one": (diff_rows.norm() / ref_rows.norm()).item(),
        "max_abs_but_one": diff_rows.abs().max().item() if others.any() else 0.0,
        "worst_row_err": row_err[worst].item(),
        "one_flip": 2.0**-3 * v.double().norm(dim=-1).max().item(),
        "max_abs": (o - r).abs().max().item(),
        "ref_max": r.abs().max().item(),
        "elem_ok_bf16": bool(((o - r).abs() <= 2.0**-7 * r.abs() + 1e-6).all()),
        # LSE carries the fp32 rounding of the logits, which grows with their size (|LSE| ~ 100
        # in the logit-gap cases): compared relative to max(1, |LSE|).
        "lse_max": ((lse[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp(min=1.0)).max().item()
        if fin.any() else 0.0,
        "lse_inf_same": bool((torch.isneginf(lse) == torch.isneginf(ref_lse)).all()),
        "n_empty_rows": int((~fin).sum()),
        "empty_rows_zero": bool((out.transpose(1, 2)[~fin.transpose(1, 2)] == 0).all()) if (~fin).any() else True,
        "finite": bool(torch.isfinite(out).all()),
        # Varlen with the longest lengths given on the host (as fp8_attention passes them): the
        # same launch, bit for bit, without reading cu_seqlens.
        "host_lengths_same": _host_lengths_same(q, k, v, mask, cfg, bm, out, lse) if cu is not None else True,
        "n_slack_tiles": _tiles_below_slack(q, k, mask, bk) if gains is not None else 0,
    }


def _tiles_below_slack(q, k, mask, bk):
    """How many (row, key tile) pairs have a tile max more than REF_SLACK (log2 units) below the
    running max at that tile (dense inputs; the emulation's masked logits, in float64): guards the
    logit-gap cases."""
    import torch

    from hf_fp8_attention.kernels.forward import LOG2E, REF_SLACK
    from hf_fp8_attention.reference import _grouped, _masked_logits

    s = _masked_logits(_grouped(q.double(), k.shape[1]), k.double(), q.shape[-1] ** -0.5 * LOG2E, mask.causal,
                       mask.window)
    tile_max = torch.stack([t.amax(-1) for t in s.split(bk, dim=-1)], -1)
    running = tile_max.cummax(-1).values
    return int((tile_max < running - REF_SLACK).sum())


def _host_lengths_same(q, k, v, mask, cfg, bm, out, lse):
    import dataclasses

    import torch

    from hf_fp8_attention.kernels.forward import triton_forward
    from hf_fp8_attention.masking import varlen_max_lengths

    max_q, max_k = varlen_max_lengths(mask)
    given = dataclasses.replace(mask, max_seqlen_q=max_q, max_seqlen_k=max_k)
    out2, lse2 = triton_forward(q, k, v, scale=q.shape[-1] ** -0.5, mask=given, config=cfg, block_m=bm)
    return bool(torch.equal(out, out2) and torch.equal(lse, lse2))


def _check_copies(x, out, fmt, pow2, cu, block):
    """Compare one operand's kernel copies with quant.quantize: {check name: bool}."""
    import torch

    from hf_fp8_attention.quant import quantize

    rc, rs, cc, cs, tile_off = out
    s_len, d = x.shape[2], x.shape[3]
    ok_col_codes, ok_col_scales = True, True
    n_tok = s_len if cu is None else int(cu[-1])  # tokens after the last sequence are never written
    want_codes, want_scales = quantize(x[:, :, :n_tok], dim=-1, block=None, fmt=fmt, pow2=pow2)
    ok_row_codes = torch.equal(rc[:, :, :n_tok, :d].view(torch.uint8), want_codes.view(torch.uint8))
    ok_row_codes &= bool((rc[:, :, :n_tok, d:].float() == 0).all())
    ok_row_scales = torch.equal(rs[:, :, :n_tok], want_scales[..., 0])
    bounds = [(0, s_len)] if cu is None else [(int(cu[i]), int(cu[i + 1])) for i in range(cu.numel() - 1)]
    slot0 = [0] if cu is None else tile_off.tolist()
    for (s, e), first in zip(bounds, slot0):
        if e == s:
            continue
        codes, scales = quantize(x[:, :, s:e], dim=-2, block=block, fmt=fmt, pow2=pow2)
        got = cc[:, :, :d, s:e].transpose(-1, -2)
        ok_col_codes &= torch.equal(got.contiguous().view(torch.uint8), codes.view(torch.uint8))
        ok_col_scales &= torch.equal(cs[:, :, first : first + scales.shape[2], :d], scales)
    ok_pad = bool((cc[..., s_len:].float() == 0).all())
    return {"row_codes": ok_row_codes, "row_scales": ok_row_scales, "col_codes": bool(ok_col_codes),
            "col_scales": bool(ok_col_scales), "pad_zero": ok_pad}


def _quantize_case(fmt_name, pow2, varlen, row_chunk, col_group, pair_fmt, d=96):
    import torch

    from hf_fp8_attention.config import FP8Format
    from hf_fp8_attention.kernels.quantize import Copies, quantize_operands

    fmt = FP8Format(fmt_name)
    gen = torch.Generator().manual_seed(7)
    shape = (1 if varlen else 2, 3, 45, d)
    x = (torch.randn(*shape, generator=gen) * torch.logspace(-3, 2, d)).to(torch.bfloat16)
    x[..., 5, :] = 0  # a zero row: scale 1
    # A tiny row (amax < 448·2^-126): the scale is floored at 2^-126. Values stay normal fp32: the
    # interpreter flushes fp32 subnormal inputs to zero (GPUs do not).
    r = torch.randn(x.shape[:-2] + (d,), generator=gen)
    x[..., 6, :] = (r.sign() * (0.5 + r.abs()) * 1e-36).to(torch.bfloat16)
    cu = torch.tensor([0, 9, 9, 40], dtype=torch.int32) if varlen else None
    block = 16
    xs, copies = (x,), (Copies(True, True, fmt),)
    if pair_fmt is not None:
        # A second operand in the same launch: its own values, strides (token-major, like a view
        # of a (B, S, H, D) projection) and format.
        y = (torch.randn(shape[0], shape[2], shape[1], d, generator=gen) * 30).to(torch.bfloat16).transpose(1, 2)
        xs, copies = (x, y), (copies[0], Copies(True, True, FP8Format(pair_fmt)))
    outs = quantize_operands(xs, copies, block=block, pow2=pow2, cu_seqlens=cu, row_chunk=row_chunk,
                             col_group=col_group)
    result = _check_copies(x, outs[0], fmt, pow2, cu, block)
    if pair_fmt is not None:
        result.update({f"y_{k}": v for k, v in _check_copies(xs[1], outs[1], copies[1].fmt, pow2, cu, block).items()})
    return result


# (format, pow2, varlen, row_chunk, col_group, format of a second operand in the same launch[, head
# dim, 96 unless given]): slices smaller than the 16-token block and the 128 padded channels (96
# real) read each tile in pieces; at 256 the default slices are head dim 256's (quantize.quant_launch).
QUANT_CASES = {
    "e4m3": ("e4m3", False, False, None, None, None),
    "e4m3_d256": ("e4m3", False, False, None, None, None, 256),
    "e4m3_pow2_varlen": ("e4m3", True, True, 4, 32, None),
    "e5m2_varlen": ("e5m2", False, True, 8, 64, None),
    "pair_e4m3_e5m2": ("e4m3", False, False, 8, 32, "e5m2"),
    "pair_varlen_pow2": ("e5m2", True, True, None, None, "e4m3"),
}


# The statistics kernel's checks: name -> (varlen, head dim, fold in the partials launch[, element-wise
# extremes for the smoothed operand[, the rotation as Hᵀxᵀ]]).
STATS_CASES = {"dense_d64": (False, 64, False), "varlen_d96": (True, 96, False),
               "dense_d64_fold": (False, 64, True), "varlen_d96_fold": (True, 96, True),
               "varlen_d96_fold_elementwise_smoothed": (True, 96, True, True),
               "varlen_d96_fold_transposed": (True, 96, True, False, True),
               "dense_d64_transposed": (False, 64, False, False, True)}


def _stats_case(varlen: bool, d: int, fold: bool, elementwise_smoothed: bool = False, transposed: bool = False):
    """The statistics kernel (two operands per launch, every kind of statistic) against PyTorch,
    with 32-token chunks instead of 256 (one slice each), so that the dense case's 45-token rows
    span two chunks and the fold (finishing launch, or ``fold``: the program that completes the
    last chunk) folds both (the interpreter also runs 8x fewer slices). The packed batch has an
    empty sequence, and a batch of empty sequences only must give zeros too. ``elementwise_smoothed``:
    the rotating launch keeps the smoothed K's extremes element-wise too (``ROTATED_PARTIALS``);
    ``transposed``: it rotates as Hᵀxᵀ and sums the rotated rows (``TRANSPOSED_ROTATION``)."""
    import torch

    from hf_fp8_attention.kernels import sequence_stats as stats_module
    from hf_fp8_attention.kernels.sequence_stats import StatsNeed, sequence_stats
    from hf_fp8_attention.transforms import rotate

    gen = torch.Generator().manual_seed(11)
    shape = (1 if varlen else 2, 3, 45, d)
    k = (torch.randn(*shape, generator=gen) * torch.logspace(-2, 1, d) + 3).to(torch.bfloat16).float()
    v = (torch.randn(*shape, generator=gen) * 5).to(torch.bfloat16).float()
    cu = torch.tensor([0, 9, 9, 40], dtype=torch.int32) if varlen else None
    needs = (StatsNeed(rotate=True, smooth=True, row_amax=True, col_amax=True), StatsNeed(row_amax=True, col_amax=True))
    saved = (stats_module.CHUNK, stats_module.FOLD_IN_PARTIALS, stats_module.ROTATED_PARTIALS,
             stats_module.TRANSPOSED_ROTATION)
    stats_module.CHUNK, stats_module.FOLD_IN_PARTIALS = 32, fold
    stats_module.ROTATED_PARTIALS = {**saved[2], "elementwise_smoothed": elementwise_smoothed}
    stats_module.TRANSPOSED_ROTATION = transposed
    try:
        got_k, got_v = sequence_stats((k, v), needs, cu_seqlens=cu)
        (got_q,) = sequence_stats((v,), (StatsNeed(rotate=True, row_amax=True),), cu_seqlens=cu)
        if varlen:
            nothing = torch.zeros(1, 3, 0, d)
            only_empty = sequence_stats((nothing, nothing), needs, cu_seqlens=torch.zeros(3, dtype=torch.int32))
    finally:
        (stats_module.CHUNK, stats_module.FOLD_IN_PARTIALS, stats_module.ROTATED_PARTIALS,
         stats_module.TRANSPOSED_ROTATION) = saved
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist())) if varlen else [(0, shape[2])] * shape[0]
    ok = {"shift": True, "row_amax": True, "col_amax": True, "empty_zero": True}
    if varlen:
        ok["only_empty_zero"] = all(float(t.abs().max()) == 0 for st in only_empty for t in st)
    for i, (lo, hi) in enumerate(bounds):
        b = 0 if varlen else i
        ks, vs = k[b, :, lo:hi], v[b, :, lo:hi]
        if hi == lo:
            ok["empty_zero"] &= all(float(t[i].abs().max()) == 0 for st in (got_k, got_v) for t in st)
            continue
        shift = rotate(ks.mean(dim=1, keepdim=True))[:, 0]
        want = {"shift": (got_k.shift[i, :, :d], shift),
                "row_amax": (torch.stack([got_k.row_amax[i], got_v.row_amax[i], got_q.row_amax[i]]),
                             torch.stack([(rotate(ks) - shift[:, None]).abs().amax((1, 2)), vs.abs().amax((1, 2)),
                                          rotate(vs).abs().amax((1, 2))])),
                "col_amax": (torch.stack([got_k.col_amax[i, :, :d], got_v.col_amax[i, :, :d]]),
                             torch.stack([ks.abs().amax(1), vs.abs().amax(1)]))}
        for name, (g, w) in want.items():
            # fp32 summation order. The shift sums 45 rotated rows (transposed) or rotates the mean:
            # both round partial sums as large as the largest rotated mean, so where the channel mean
            # cancels (entries ~1e-2 of the largest) the two orders differ by ~1e-7 of that largest.
            atol = max(1e-6 * float(w.abs().amax()), 1e-6) if name == "shift" else 1e-6
            ok[name] &= bool(torch.allclose(g, w, rtol=1e-5, atol=atol))
    return ok


def _huge_logits_case(a: float):
    """q = k = a·1, v = 1, causal (tile recipe: no smoothing, so the logits stay huge): the exact
    output is 1. Such rows take the forward's exact second pass (kernels/forward.py, HUGE_LOG2)."""
    import torch

    from hf_fp8_attention import RECIPES
    from hf_fp8_attention.kernels.forward import triton_forward
    from hf_fp8_attention.masking import MaskSpec

    q = torch.full((1, 1, 40, 64), a)
    out, lse = triton_forward(q, q, torch.ones_like(q), scale=0.125, mask=MaskSpec(causal=True),
                              config=RECIPES["fp8_delta_tile"].replace(block_k=16), block_m=16)
    exact_lse = 0.125 * a * a * 64 + torch.log(torch.arange(1, 41, dtype=torch.float64))  # log(n e^s)
    return {"max_err": (out.double() - 1).abs().max().item(),
            "lse_rel": ((lse[0, 0].double() - exact_lse).abs() / exact_lse).max().item()}


@triton.jit
def _reductions_kernel(x_ptr, out_ptr, N: tl.constexpr):
    """(N, N) fp32 ``x`` -> ``out`` (2, 4, N): per axis, max in both forms, then min in both forms."""
    x = tl.load(x_ptr + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :])
    i = tl.arange(0, N)
    for axis in tl.static_range(2):
        base = out_ptr + axis * 4 * N
        tl.store(base + i, reduce_max_nan(x, axis))
        tl.store(base + N + i, tl.reduce(x, axis, max_nan))
        tl.store(base + 2 * N + i, reduce_min_nan(x, axis))
        tl.store(base + 3 * N + i, tl.reduce(x, axis, min_nan))


def _reductions_case():
    """The NaN-keeping reductions' interpreter form (``tl.max`` / ``tl.min`` plus a NaN test) against
    the ``tl.reduce`` with a combine function that compiled kernels run, along both axes, on rows
    and columns holding NaN at the start, middle and end, ±inf, only -inf, only ±0 and ordinary
    values: NaN in the same places, every other value equal. Equal, not the same bits: the sign of a
    maximum over zeros of both signs follows the order of the comparisons (NumPy's pairwise form
    keeps the later zero, its reduction the first), and no kernel tells the two zeros apart (scales
    test amax == 0, the statistics feed magnitudes)."""
    import torch

    n = 16
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(3))
    nan, inf = float("nan"), float("inf")
    x[0, 1] = x[7, 2] = x[n - 1, 3] = nan  # NaN first, in the middle, last (columns 1-3, rows 0/7/15)
    x[:, 4], x[5, 5], x[6, 5] = -inf, inf, -inf
    x[:, 6] = torch.tensor([0.0, -0.0] * (n // 2))
    x[8] = torch.tensor([-0.0, 0.0] * (n // 2))
    x[9, :] = -inf
    out = torch.empty(2, 4, n)
    _reductions_kernel[(1,)](x, out, N=n)
    ok = {}
    for axis in range(2):
        for name, (fast, generic) in {"max": (out[axis, 0], out[axis, 1]), "min": (out[axis, 2], out[axis, 3])}.items():
            same_nan = bool(torch.equal(fast.isnan(), generic.isnan()))
            finite = ~fast.isnan()
            ok[f"{name}_axis{axis}"] = same_nan and bool(torch.equal(fast[finite], generic[finite]))
    ok["nan_seen"] = bool(out[0, 0, 1:4].isnan().all()) and bool(out[1, 0, [0, 7, n - 1]].isnan().all())
    return ok


def _cases() -> dict:
    """Every check of the subprocess run, by result key, as a zero-argument callable."""
    cases = {"reductions": _reductions_case}
    for a in (100.0, 1000.0, 3000.0):
        cases[f"huge/{a:g}"] = lambda a=a: _huge_logits_case(a)
    # One dense and one packed batch, at a power-of-two head dim and a padded one (16-32 s each in
    # the interpreter; the other pairings and head dim 256 run inside the forward cases and the
    # backward tests, checked end to end).
    for name, args in STATS_CASES.items():
        cases[f"stats/{name}"] = lambda args=args: _stats_case(*args)
    for i, name in enumerate(FORWARD_CASES):
        seed = int(os.environ.get("FWD_SEED_BASE", "0")) + i
        cases[f"fwd/{name}"] = lambda name=name, seed=seed: _forward_case(name, seed=seed)
    for name, args in QUANT_CASES.items():
        cases[f"quant/{name}"] = lambda args=args: _quantize_case(*args)
    return cases


def _run_all(part: int = 0, parts: int = 1) -> dict:
    """The checks whose index is ``part`` modulo ``parts`` (all of them by default)."""
    return {key: run() for i, (key, run) in enumerate(_cases().items()) if i % parts == part}


@pytest.fixture(scope="module")
def interpreter_results():
    from helpers import interpreter_results as run_parts

    # One process a core (two a core were no faster: each imports torch and Triton); ~30 s on 2 cores.
    results = run_parts(__file__)
    assert len(results) == len(_cases())
    return results


@pytest.mark.parametrize("a", ["100", "1000", "3000"])
def test_huge_logits_keep_rows_normalised(interpreter_results, a):
    """Logits 8e4 to 7e7: every P code is the row max's (448), so the output is 1 to fp32 rounding;
    the LSE to fp32's relative rounding of the logit (2^-24, a few ulps after the log2 conversions)."""
    r = interpreter_results[f"huge/{a}"]
    assert r["max_err"] < 1e-5, r
    assert r["lse_rel"] < 1e-6, r


@pytest.mark.parametrize("name", sorted(FORWARD_CASES))
def test_forward_kernel_matches_emulation(interpreter_results, name):
    r = interpreter_results[f"fwd/{name}"]
    assert r["finite"], "kernel output has NaN/Inf on finite inputs"
    assert r["host_lengths_same"], "max_seqlen given on the host changed the result"
    assert r["lse_inf_same"], "rows without a visible key differ (LSE -inf pattern)"
    assert r["empty_rows_zero"], "rows without a visible key must output 0"
    assert r["lse_max"] <= 2e-5, r
    if FORWARD_CASES[name][9] == "bfloat16":
        assert r["elem_ok_bf16"], r
    else:
        assert r["rel_but_one"] <= 2e-5, r
        assert r["max_abs_but_one"] <= 2e-3 * r["ref_max"], r
        assert r["worst_row_err"] <= r["one_flip"], r


def test_masked_rows_case_has_empty_rows(interpreter_results):
    # Guards the test itself: the masked-rows case must really contain rows with no key.
    assert interpreter_results["fwd/varlen_masked_rows"]["n_empty_rows"] > 0


@pytest.mark.parametrize("name", sorted(KEY_TILE_GAIN))
def test_logit_gap_cases_exceed_the_reference_slack(interpreter_results, name):
    # Guards the test itself: tiles beyond REF_SLACK below the running max must occur.
    assert interpreter_results[f"fwd/{name}"]["n_slack_tiles"] > 0


@pytest.mark.parametrize("name", sorted(QUANT_CASES))
def test_quantize_kernel_bit_exact(interpreter_results, name):
    r = interpreter_results[f"quant/{name}"]
    assert all(r.values()), r
    if QUANT_CASES[name][5] is not None:  # the second operand of the launch was checked too
        assert any(key.startswith("y_") for key in r), r


def test_interpreter_reductions_equal_the_compiled_form(interpreter_results):
    r = interpreter_results["reductions"]
    assert all(r.values()), r


@pytest.mark.parametrize("name", sorted(STATS_CASES))
def test_sequence_statistics_match_pytorch(interpreter_results, name):
    r = interpreter_results[f"stats/{name}"]
    assert all(r.values()), r


def test_forward_autotune_key_buckets_the_sequence_length():
    # The launch tuned on a short call must not serve long ones (and vice versa); lengths of one
    # power-of-two bucket share a launch, and the bucket count stays small.
    from hf_fp8_attention.kernels.forward import length_bucket

    assert [length_bucket(n) for n in (0, 1, 17, 256, 257, 700, 1024, 1025, 4097, 8192, 100_000)] == [
        256, 256, 256, 256, 512, 1024, 1024, 2048, 8192, 8192, 8192]


def test_forward_autotune_key_buckets_the_grid():
    # A launch tuned on a call that leaves most SMs idle must not serve one that fills them many
    # times over (same length bucket, 64 vs 4096 query-tile programs on 132 SMs).
    from hf_fp8_attention.kernels.forward import wave_bucket

    assert [wave_bucket(n, 132) for n in (0, 1, 64, 132, 133, 264, 265, 4096, 10**6)] == [
        1, 1, 1, 1, 2, 2, 4, 16, 16]


def test_pinned_forward_launch_per_head_dim(monkeypatch):
    # One entry pins every head dim; "DP:" entries pin a padded head dim of their own (head dim 256
    # cannot take the 128-channel launches' 3-stage pipeline: tests/gpu pin "128,8,3;256:64,8,2").
    from hf_fp8_attention.kernels.forward import PIN_ENV, _pinned_launch

    monkeypatch.setenv(PIN_ENV, "128,8,3")
    assert _pinned_launch(128) == _pinned_launch(256) == (128, 8, 3)
    monkeypatch.setenv(PIN_ENV, "128,8,3;256:64,8,2")
    assert (_pinned_launch(64), _pinned_launch(128), _pinned_launch(256)) == ((128, 8, 3), (128, 8, 3), (64, 8, 2))
    monkeypatch.setenv(PIN_ENV, "256:64,8,2")
    assert (_pinned_launch(128), _pinned_launch(256)) == (None, (64, 8, 2))
    monkeypatch.delenv(PIN_ENV)
    assert _pinned_launch(128) is None
    monkeypatch.setenv(PIN_ENV, "128,8")
    with pytest.raises(ValueError, match="BLOCK_M,num_warps,num_stages"):
        _pinned_launch(128)


if __name__ == "__main__":
    print(json.dumps(_run_all(*map(int, sys.argv[1:3]))))
