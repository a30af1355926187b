"""The Triton backward kernels under the CPU interpreter (TRITON_INTERPRET=1) on tiny shapes.

Checks indexing, masking, GQA, varlen, tile-wise quantization axes and the matched/stale delta
against the PyTorch emulation (reference.py), which defines the numerics.

Tolerance (KERNEL_VS_EMULATION = 1e-4, relative Frobenius): under the interpreter the kernels round
to the FP8 grid exactly as torch does (backward_quant._round_to_fp8_grid works around the
interpreter's broken fp8 cast), so kernel and emulation quantize identically and differ only by
fp32 accumulation order (contractions of <= 64 terms: ~1e-6 relative) plus, rarely, one FP8 code
flipped where an fp32 last-bit difference meets a rounding tie. 1e-4 covers that with margin and is
~500x below the FP8 quantization error itself (~5e-2 against float64), so a wrong tile, scale axis,
mask or delta fails it by orders of magnitude.
"""
import collections
import os

import pytest
import torch

# Triton decides interpreted vs compiled when a kernel is decorated, i.e. when the kernels module is
# first imported; conftest.py switches the interpreter on for the whole test run on machines without
# a CUDA GPU. Where it is off (a GPU machine), tests/gpu covers these kernels instead.
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter is off (GPU machine: see tests/gpu)", allow_module_level=True)

from hf_fp8_attention import reference
from hf_fp8_attention.config import FP8AttentionConfig
from hf_fp8_attention.masking import MaskSpec

kernels = pytest.importorskip("hf_fp8_attention.kernels.backward")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from hf_fp8_attention.kernels import backward_fp8, tiles  # noqa: E402
from helpers import recipe_overrides  # noqa: E402

KERNEL_VS_EMULATION = 1e-4
TILES = dict(block_q=16, block_k=16)  # small tiles: several tiles (and partial ones) on tiny shapes


def _rel(a, b):
    b = b.double()
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(b, hq, hkv, sq, sk, d, seed):
    """fp32 tensors holding bf16 values (what a bf16 model hands over): the rotation's ±1 sums and
    the key mean are then exact in fp32 in any summation order, so the kernel's rotated codes equal
    the emulation's. With arbitrary fp32 values the two orders differ in the last bit, and a code
    at a rounding tie flips (seen: one element of 6.8k, moving dQ by 9e-4 relative)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, hq, sq, d))
    return [torch.randn(*s, generator=g).to(torch.bfloat16).float() for s in shapes]


def _mask(causal=False, window=None, cu=None):
    if cu is None:
        return MaskSpec(causal=causal, window=window)
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in cu)
    return MaskSpec(causal=causal, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck)


def _run(shape, mask, config, seed=0, debug=False):
    q, k, v, do = _inputs(*shape, seed)
    scale = shape[-1] ** -0.5
    out, lse = reference.emulated_forward(q, k, v, scale=scale, mask=mask, config=config)
    fn = kernels.triton_backward_row_sums if debug else kernels.triton_backward
    got = fn(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    ref = reference.emulated_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    return got, ref


def _assert_near_emulation(grads, ref):
    """dQ, dK, dV finite and within KERNEL_VS_EMULATION of the emulation's."""
    for label, x, r in zip(("dq", "dk", "dv"), grads, ref):
        assert torch.isfinite(x).all(), label
        assert _rel(x, r) <= KERNEL_VS_EMULATION, (label, _rel(x, r))


# The fast recipe's scale options, fp8_delta_token's (K and V per token, P and dS per tile) and
# fp8_delta_tile's, the first release's (also per-tile channel scales, no transforms: the only one
# the in-register FP8 kernels run), as config keywords.
FAST_RECIPE = recipe_overrides("fp8_delta_fast")
TOKEN_RECIPE = recipe_overrides("fp8_delta_token")
TILE_RECIPE = recipe_overrides("fp8_delta_tile")
CASES = {
    # name: ((B, Hq, Hkv, Sq, Sk, D), mask kwargs, config overrides)
    "dense": ((1, 2, 1, 32, 32, 64), {}, {}),
    "causal_gqa_qshort_odd": ((1, 2, 1, 17, 36, 64), {"causal": True}, {}),
    "window_noncausal_d96_batch2": ((2, 1, 1, 19, 19, 96), {"window": 5}, {}),
    "causal_window_d128": ((1, 1, 1, 24, 24, 128), {"causal": True, "window": 7}, {}),
    "causal_gqa_d80": ((1, 2, 1, 21, 21, 80), {"causal": True}, {}),
    "varlen_causal": ((1, 2, 1, 40, 40, 64), {"causal": True, "cu": ([0, 7, 40], [0, 7, 40])}, {}),
    "stale_causal": ((1, 2, 1, 20, 20, 64), {"causal": True}, {"delta": "stale"}),
    "pow2_e5m2": ((1, 2, 1, 20, 24, 64), {"causal": True}, {"pow2_scales": True, "do_format": "e5m2", "ds_format": "e5m2"}),
    "hybrid_matched": ((1, 2, 1, 20, 24, 64), {"causal": True}, {"backward": "bf16"}),
    "hybrid_stale": ((1, 2, 1, 20, 24, 64), {"causal": True}, {"backward": "bf16", "delta": "stale"}),
    "single_query": ((1, 2, 1, 1, 24, 64), {"causal": True}, {}),
    # The recipes' other scale granularities (the default above: per-token rows, sequence channels).
    "fast_recipe_gqa_varlen": ((1, 2, 1, 40, 40, 96), {"causal": True, "cu": ([0, 7, 40], [0, 7, 40])}, FAST_RECIPE),
    "fast_recipe_stale": ((1, 2, 1, 20, 24, 64), {"causal": True}, {**FAST_RECIPE, "delta": "stale"}),
    "tile_recipe": ((1, 2, 1, 17, 36, 64), {"causal": True}, TILE_RECIPE),
    # fp8_delta_token: K and V per token, P and dS per tile, sequence channel scales, both transforms.
    "token_recipe_gqa_varlen": ((1, 2, 1, 40, 40, 64), {"causal": True, "cu": ([0, 7, 40], [0, 7, 40])},
                                TOKEN_RECIPE),
    # dS with one scale per (sequence, head) beside per-tile channel scales (dQ and dK then keep a
    # product per tile), GQA's per-head rescale; and with a window, the stale delta's bound pass.
    "ds_head_tile_channels": ((1, 2, 1, 17, 36, 64), {"causal": True}, {**TOKEN_RECIPE, "channel_scales": "tile",
                                                                          "ds_scales": "head"}),
    "ds_head_window_stale": ((2, 1, 1, 19, 19, 96), {"window": 5}, {"ds_scales": "head", "delta": "stale"}),
    # Head dim 256: dQ, dK and dV in two 128-channel blocks per tile (LAUNCH_D256["channel_block"]),
    # with each recipe's channel scales (per sequence, per tile, per head), the stale delta's fused
    # statistics, GQA's per-head rescale; the hybrid kernels on their own tiles. (Packed, windowed
    # d = 256: tests/test_kernel_matrix_interpreter.py's slice. The fast recipe's rotated statistics
    # cost ~4 s per head under the interpreter: one head here, and GQA in its own case only.)
    "causal_gqa_d256": ((1, 2, 1, 20, 20, 256), {"causal": True}, {}),
    "stale_d256": ((1, 1, 1, 20, 24, 256), {"causal": True}, {"delta": "stale"}),
    "fast_recipe_d256": ((1, 1, 1, 20, 20, 256), {"causal": True}, FAST_RECIPE),
    "tile_recipe_d256": ((1, 1, 1, 17, 36, 256), {"causal": True}, TILE_RECIPE),
    "hybrid_matched_d256": ((1, 2, 1, 20, 24, 256), {"causal": True}, {"backward": "bf16"}),
    # dq_in_stats: the statistics and dQ in one sweep (bwd_dq_fp8_kernel's ONE_SWEEP), on the fast
    # recipe's free tiles, packed; with per-token Q/dO, sequence channel scales and per-tile dS on
    # the recipe's blocks; with a window; at d = 256 in two channel blocks.
    "dq_in_stats_fast_varlen": ((1, 1, 1, 24, 24, 64), {"causal": True, "cu": ([0, 7, 24], [0, 7, 24])},
                                {**FAST_RECIPE, "dq_in_stats": True}),
    "dq_in_stats_token_rows_gqa": ((1, 2, 1, 17, 36, 64), {"causal": True},
                                   {"ds_scales": "tile", "dq_in_stats": True}),
    "dq_in_stats_window": ((1, 1, 1, 19, 19, 64), {"window": 5}, {**FAST_RECIPE, "dq_in_stats": True}),
    "dq_in_stats_d256": ((1, 1, 1, 20, 20, 256), {"causal": True}, {**FAST_RECIPE, "dq_in_stats": True}),
}


@pytest.fixture(params=["prequant", "prequant_fused", "inregister"])
def fp8_path(request, monkeypatch):
    """The FP8 schedules: operands quantized once up front, with the default launches (LSE'/D, dQ,
    dK and dV each in a launch of its own) or the fused ones (LSE'/D with dQ, dK with dV); or
    operands quantized in registers inside each program."""
    monkeypatch.setitem(kernels.LAUNCH, "prequant", request.param != "inregister")
    if request.param == "prequant_fused":
        monkeypatch.setitem(kernels.LAUNCH, "split_dkdv", False)
        monkeypatch.setitem(kernels.LAUNCH, "split_dq_stats", False)
    return request.param


# The other schedules share the masking/tiling code of the default one: a few cases suffice.
FEW_CASES = ("causal_gqa_qshort_odd", "varlen_causal", "pow2_e5m2", "stale_causal", "causal_gqa_d256")


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_emulation(name, fp8_path):
    if fp8_path != "prequant" and (name not in FEW_CASES or "hybrid" in name):
        pytest.skip(f"{fp8_path} schedule: the cases {FEW_CASES} suffice")
    if fp8_path == "inregister" and CASES[name][0][-1] > 128:
        pytest.skip("the in-register FP8 kernels refuse head dims above 128 "
                    "(test_inregister_fp8_kernels_refuse_head_dim_256)")
    shape, mask_kw, cfg_kw = CASES[name]
    if fp8_path == "inregister":
        cfg_kw = {**cfg_kw, **TILE_RECIPE}
    config = FP8AttentionConfig(**TILES, **cfg_kw)
    (dq, dk, dv), ref = _run(shape, _mask(**mask_kw), config)
    for label, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert x.shape == r.shape and x.dtype == r.dtype, label
        assert torch.isfinite(x).all(), label
        assert _rel(x, r) <= KERNEL_VS_EMULATION, (label, _rel(x, r))


def test_inregister_fp8_kernels_refuse_head_dim_256(monkeypatch):
    monkeypatch.setitem(kernels.LAUNCH, "prequant", False)
    config = FP8AttentionConfig(**TILES, **TILE_RECIPE)
    with pytest.raises(ValueError, match=r"in-register FP8 kernels .* head dims up to 128, got 256.*prequant"):
        _run((1, 1, 1, 16, 16, 256), _mask(), config)


def test_d256_launch_retries_with_fewer_stages_when_shared_memory_runs_out(monkeypatch):
    """LAUNCH_D256's 2-stage shapes fill a block's shared memory to within 1-2 KB; a Triton that
    allocates more raises OutOfResources at launch, and the launcher falls back to fewer stages."""
    from triton.runtime.errors import OutOfResources

    real = kernels.bwd_dkdv_fp8_kernel
    stages_seen = []

    class TooBigWithTwoStages:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                stages_seen.append(kwargs["num_stages"])
                if kwargs["num_stages"] > 1:
                    raise OutOfResources(233472, 232448, "shared memory")
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(kernels, "bwd_dkdv_fp8_kernel", TooBigWithTwoStages())
    for name in ("dk", "dv"):
        monkeypatch.setitem(kernels.LAUNCH_D256, name, {"num_warps": 8, "num_stages": 2})
    (dq, dk, dv), ref = _run((1, 2, 1, 20, 20, 256), _mask(causal=True), FP8AttentionConfig(**TILES))
    assert stages_seen == [2, 1, 2, 1]  # dK, then dV: each retried once
    assert kernels.LAUNCH_D256["dk"]["num_stages"] == kernels.LAUNCH_D256["dv"]["num_stages"] == 1
    for x, r in zip((dq, dk, dv), ref):
        assert _rel(x, r) <= KERNEL_VS_EMULATION


def test_rows_without_keys_and_tokens_outside_sequences_get_zero_gradients():
    # Varlen causal with q_len > kv_len in the first sequence: its first queries sit at negative
    # positions and see no key. Tokens 36..39 belong to no sequence.
    cu = ([0, 12, 36], [0, 5, 30])
    config = FP8AttentionConfig(**TILES)
    (dq, dk, dv), ref = _run((1, 2, 1, 40, 32, 64), _mask(causal=True, cu=cu), config)
    for x in (dq, dk, dv):
        assert torch.isfinite(x).all()
    assert not dq[:, :, :7].any()  # positions -7..-1 of sequence 0
    assert not dq[:, :, 36:].any() and not dk[:, :, 30:].any() and not dv[:, :, 30:].any()
    for x, r in zip((dq, dk, dv), ref):
        assert _rel(x, r) <= KERNEL_VS_EMULATION


def test_dq_in_stats_row_sums_vanish_and_rows_without_keys_stay_zero():
    """The one sweep's debug row sums (Σ_j of dQ's effective dS, fq(P dP) − D' P̂) are at fp32
    rounding, as the matched statistics pass's are; rows that see no key and tokens outside every
    sequence get zero gradients."""
    cu = ([0, 12, 36], [0, 5, 30])
    config = FP8AttentionConfig(**TILES, **FAST_RECIPE, dq_in_stats=True)
    (dq, dk, dv, ds_sum, pabs), ref = _run((1, 1, 1, 40, 32, 64), _mask(causal=True, cu=cu), config, debug=True)
    seen = pabs > 0
    assert seen.any() and (ds_sum[seen].abs() / pabs[seen]).max() <= 1e-5
    assert not dq[:, :, :7].any() and not dq[:, :, 36:].any()
    for x, r in zip((dq, dk, dv), ref):
        assert torch.isfinite(x).all() and _rel(x, r) <= KERNEL_VS_EMULATION


def test_dq_in_stats_refuses_softcap_and_sinks():
    config = FP8AttentionConfig(**TILES, **FAST_RECIPE, dq_in_stats=True)
    q, k, v, do = _inputs(1, 2, 1, 16, 16, 64, seed=0)
    mask = _mask(causal=True)
    out, lse = reference.emulated_forward(q, k, v, scale=0.125, mask=mask, config=config, softcap=30.0)
    for kw in ({"softcap": 30.0}, {"sinks": torch.zeros(2)}):
        with pytest.raises(ValueError, match="dq_in_stats: calls with a soft-cap or sinks"):
            kernels.triton_backward(q, k, v, out, lse, do, scale=0.125, mask=mask, config=config, **kw)
        with pytest.raises(ValueError, match="dq_in_stats: calls with a soft-cap or sinks"):
            reference.emulated_backward(q, k, v, out, lse, do, scale=0.125, mask=mask, config=config, **kw)


@pytest.mark.parametrize("d", [64, 256])
def test_matched_row_sums_vanish_and_stale_do_not(d):
    """Σ_j dS_ij of the kernel's own fp32 dS: fp32 rounding level when matched (sums of <= 32
    terms of size P|dP|, so |Σ| / Σ P|dP| <= ~32 · 2^-24 ≈ 2e-6; bound 1e-5), and orders of
    magnitude larger with the stale delta (FP8 dO·V vs rowsum(dO∘O): ~1e-2). d = 256: the row
    sums come from the first of dQ's two channel blocks."""
    shape, mask = (1, 1, 1, 32, 32, d), _mask(causal=True)
    residual = {}
    for delta in ("matched", "stale"):
        config = FP8AttentionConfig(**TILES, delta=delta)
        (dq, dk, dv, ds_sum, pabs), _ = _run(shape, mask, config, debug=True)
        assert ds_sum.shape == pabs.shape == shape[:2] + shape[3:4]
        assert (pabs > 0).all()  # causal: every query sees at least its own key
        residual[delta] = (ds_sum.abs() / pabs).max().item()
    assert residual["matched"] <= 1e-5, residual
    assert residual["stale"] >= 100 * residual["matched"], residual


def test_debug_variant_returns_the_same_gradients():
    config = FP8AttentionConfig(**TILES)
    (g_dbg, _) = _run((1, 2, 1, 24, 24, 64), _mask(causal=True), config, debug=True)
    (g, _) = _run((1, 2, 1, 24, 24, 64), _mask(causal=True), config)
    for a, b in zip(g_dbg[:3], g):
        assert torch.equal(a, b)


def test_nan_input_is_not_hidden():
    """P per tile (fp8_delta_token): the interpreter's fp32 -> FP8 cast turns NaN into a finite code
    (384), so a NaN reaches dV through P's tile scale here, not through its code; with P on the
    fixed grid it travels in the code itself, which the GPU's cast keeps NaN
    (tests/gpu/test_backward_kernel.py::test_nan_in_q_reaches_every_gradient_it_touches)."""
    q, k, v, do = _inputs(1, 1, 1, 16, 16, 64, seed=3)
    config = FP8AttentionConfig(**TILES, **TOKEN_RECIPE)
    mask = _mask()
    out, lse = reference.emulated_forward(q, k, v, scale=0.125, mask=mask, config=config)
    q[0, 0, 5, 7] = float("nan")
    dq, dk, dv = kernels.triton_backward(q, k, v, out, lse, do, scale=0.125, mask=mask, config=config)
    assert not torch.isfinite(dq[0, 0, 5]).any()  # the poisoned row
    assert not torch.isfinite(dk).all() and not torch.isfinite(dv).all()


@pytest.mark.parametrize("delta", ["matched", "stale"])
def test_split_and_fused_launches_give_identical_gradients(delta, monkeypatch):
    """Forming LSE'/D, dQ, dK and dV in separate launches repeats the same operations per element as
    the fused launches: the gradients and debug row sums agree bit for bit."""
    shape, mask = (1, 2, 1, 40, 40, 64), _mask(causal=True, window=25)
    config = FP8AttentionConfig(**TILES, delta=delta)
    split, _ = _run(shape, mask, config, debug=True)
    monkeypatch.setitem(kernels.LAUNCH, "split_dkdv", False)
    monkeypatch.setitem(kernels.LAUNCH, "split_dq_stats", False)
    fused, _ = _run(shape, mask, config, debug=True)
    for a, b in zip(split, fused):
        assert torch.equal(a, b)


def test_blocks_below_32_are_refused_when_compiling_for_a_gpu():
    """The interpreter runs 16-token blocks (these tests use them); a GPU compile cannot (FP8 MMAs
    contract over >= 32 tokens), so the kernels' entry points refuse them with the fix named."""
    from hf_fp8_attention.kernels.tiles import check_compiled_blocks

    check_compiled_blocks(16, 16, "triton_backward", interpreting=True)
    check_compiled_blocks(32, 256, "triton_backward", interpreting=False)
    for bq, bk, named in ((16, 128, "block_q=16"), (128, 16, "block_k=16"), (16, 16, "block_q=16, block_k=16")):
        with pytest.raises(ValueError, match=rf"triton_backward: FP8AttentionConfig {named} is too small.*emulation"):
            check_compiled_blocks(bq, bk, "triton_backward", interpreting=False)


# The pre-quantized kernels visit interior tiles (every row and key in range, every pair visible)
# without mask work, boundary tiles with it. LAUNCH["free_tile"] is shrunk so that these shapes have
# both kinds of tiles in both kernels, with the two tile sides of a kernel differing. Seed 1: with
# seed 0, three of these shapes hit one FP8 code flipped at a rounding tie (as before the split).
SPLIT_CASES = {
    # name: ((B, Hq, Hkv, Sq, Sk, D), mask kwargs, free tile sides (dQ query rows, dK/dV keys))
    "causal_gqa_qshort": ((1, 2, 1, 40, 70, 64), {"causal": True}, (32, 32)),
    "causal_window": ((1, 1, 1, 80, 80, 64), {"causal": True, "window": 48}, (16, 32)),
    "window_noncausal_qlong": ((1, 1, 1, 70, 50, 64), {"window": 40}, (32, 16)),
    "varlen_causal_gqa": ((1, 2, 1, 100, 100, 64), {"causal": True, "cu": ([0, 7, 60, 100], [0, 10, 70, 100])},
                          (16, 32)),
    "varlen_window_noncausal": ((1, 1, 1, 90, 90, 64), {"window": 40, "cu": ([0, 41, 90], [0, 33, 88])}, (16, 16)),
    # aligned launches (every length a multiple of its tile): only the boundary loops that can visit a tile
    "causal_gqa_aligned": ((1, 2, 1, 64, 64, 64), {"causal": True}, (16, 32)),
    "causal_window_aligned": ((1, 1, 1, 64, 96, 64), {"causal": True, "window": 64}, (16, 32)),
    "window_noncausal_aligned": ((1, 1, 1, 96, 64, 64), {"window": 48}, (16, 16)),
    # head dim 256: the channel blocks in interior and boundary tiles
    "causal_window_d256": ((1, 1, 1, 80, 80, 256), {"causal": True, "window": 48}, (16, 32)),
}
TILE_LOOPS = ("_dq_stats_tiles", "_dq_tiles", "_dkdv_tiles")


def _count_tiles(monkeypatch):
    """Tiles each loop helper visits, per MASKED flag (the interpreter looks helpers up at each call)."""
    counts = collections.Counter()
    for name in TILE_LOOPS:
        fn = getattr(backward_fp8, name)
        at = fn.arg_names.index("MASKED")  # preceded by the tile range t_lo, t_hi

        def counted(*args, fn=fn, at=at, name=name):
            counts[name, bool(args[at])] += int(args[at - 1]) - int(args[at - 2])
            return fn(*args)

        monkeypatch.setattr(backward_fp8, name, counted)
    return counts


@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_prequant_interior_and_boundary_tiles(name, monkeypatch):
    shape, mask_kw, (bm, bn) = SPLIT_CASES[name]
    monkeypatch.setitem(kernels.LAUNCH, "prequant", True)
    for table in (kernels.LAUNCH, kernels.LAUNCH_D256):
        monkeypatch.setitem(table, "free_tile", {"dq": bm, "dq_stats": bm, "dkdv": bn, "dk": bn, "dv": bn})
    counts = _count_tiles(monkeypatch)
    # a recipe with per-tile P and dS (fp8_delta_token): block-free ones take LAUNCH["block_free"]'s
    # tiles instead (test_block_free_recipe_tiles_freely)
    config = FP8AttentionConfig(**TILES, **TOKEN_RECIPE)
    (dq, dk, dv), ref = _run(shape, _mask(**mask_kw), config, seed=1)
    for loop in TILE_LOOPS:
        assert counts[loop, False] > 0 and counts[loop, True] > 0, dict(counts)
    _assert_near_emulation((dq, dk, dv), ref)


# (BLOCK_Q, BLOCK_K) per launch, none equal to the recipe's 16-token blocks, the two sides differing.
BLOCK_FREE_TILES = {"dq_stats": (32, 16), "dq": (16, 32), "dk": (32, 16), "dv": (16, 32), "dkdv": (32, 32)}


# Each shape once, the split and fused dK/dV schedules between them (the interpreter takes ~15 s a case).
@pytest.mark.parametrize("name, fused", [("fast_recipe_gqa_varlen", True), ("fast_recipe_stale", False),
                                         ("window_noncausal_d96_batch2", True)])
def test_block_free_recipe_tiles_freely(name, fused, monkeypatch):
    """A backward no block binds (channel scales per head, fixed-grid P, dS per head) gives the
    emulation's gradients on tiles of any size (LAUNCH["block_free"]), dK/dV split or fused."""
    shape, mask_kw, cfg_kw = CASES[name]
    config = FP8AttentionConfig(**TILES, **{**cfg_kw, **FAST_RECIPE})
    assert kernels.backward_block_free(config)
    monkeypatch.setitem(kernels.LAUNCH, "prequant", True)
    monkeypatch.setitem(kernels.LAUNCH, "block_free", {**BLOCK_FREE_TILES, "split_dkdv": not fused})
    monkeypatch.setitem(kernels.LAUNCH, "block_free_d64", {})  # these tiles at every head dim
    (dq, dk, dv), ref = _run(shape, _mask(**mask_kw), config)
    _assert_near_emulation((dq, dk, dv), ref)


# The fused dK/dV launch on the fixed grid forms dS from dV's 448·P times dO's row scale / 448 (one
# exponential per element); the fast recipe takes that scale per head, these per query.
ONE_EXP_CASES = {
    # per-token Q, K, V, dO (V's scale per key in dP), dS per head, a window: block-free, so fused
    "token_rows_ds_head_window": ((1, 2, 1, 19, 19, 64), {"window": 5}, {"p_scales": "fixed", "ds_scales": "head"}),
    # K and V per head, dS per tile (its scales taken after the per-query factor), fused by the table
    "kv_head_ds_tile_causal": ((1, 2, 1, 17, 36, 64), {"causal": True}, {"kv_scales": "head", "p_scales": "fixed"}),
}


@pytest.mark.parametrize("name", sorted(ONE_EXP_CASES))
def test_fused_dkdv_on_the_fixed_grid_with_per_query_row_scales(name, monkeypatch):
    shape, mask_kw, cfg_kw = ONE_EXP_CASES[name]
    config = FP8AttentionConfig(**TILES, **cfg_kw)
    monkeypatch.setitem(kernels.LAUNCH, "prequant", True)
    monkeypatch.setitem(kernels.LAUNCH, "split_dkdv", False)
    monkeypatch.setitem(kernels.LAUNCH, "block_free", {**BLOCK_FREE_TILES, "split_dkdv": False})
    (dq, dk, dv), ref = _run(shape, _mask(**mask_kw), config)
    _assert_near_emulation((dq, dk, dv), ref)


def test_prequant_interior_tiles_keep_the_debug_row_sums(monkeypatch):
    shape, mask_kw, (bm, bn) = SPLIT_CASES["causal_window"]
    monkeypatch.setitem(kernels.LAUNCH, "prequant", True)
    monkeypatch.setitem(kernels.LAUNCH, "free_tile", {"dq": bm, "dq_stats": bm, "dkdv": bn, "dk": bn, "dv": bn})
    config, mask = FP8AttentionConfig(**TILES), _mask(**mask_kw)
    (dq, dk, dv, ds_sum, pabs), _ = _run(shape, mask, config, seed=1, debug=True)
    grads, _ = _run(shape, mask, config, seed=1)
    for a, b in zip((dq, dk, dv), grads):
        assert torch.equal(a, b)
    assert (pabs > 0).all()  # causal window: every query sees its own key
    assert (ds_sum.abs() / pabs).max().item() <= 1e-5  # matched: Σ_j dS_ij vanishes to fp32 rounding


@triton.jit
def _tile_bounds_kernel(P, OUT, N, KEY_TILES: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK: tl.constexpr):
    """Rows (first row / key of the fixed tile, q_len, k_len, window) of P (N, 4) -> rows (t_lo, f_lo,
    f_hi, t_hi) of OUT. The scalar helpers are elementwise, so one call covers BLOCK rows."""
    i = tl.arange(0, BLOCK)
    ok = i < N
    first, q_len = tl.load(P + 4 * i, mask=ok), tl.load(P + 4 * i + 1, mask=ok)
    k_len, window = tl.load(P + 4 * i + 2, mask=ok), tl.load(P + 4 * i + 3, mask=ok)
    if KEY_TILES:
        bounds = tiles.key_tiles(first, q_len, k_len, window, BLOCK_Q, BLOCK_K, CAUSAL, HAS_WINDOW)
    else:
        bounds = tiles.query_tiles(first, q_len, k_len, window, BLOCK_Q, BLOCK_K, CAUSAL, HAS_WINDOW)
    for j in tl.static_range(4):
        tl.store(OUT + 4 * i + j, bounds[j] + 0 * i, mask=ok)  # + 0 * i: a bound may be a scalar


@pytest.mark.parametrize("key_tiles", [True, False], ids=["dq_key_tiles", "dkdv_query_tiles"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("has_window", [False, True], ids=["", "window"])
def test_interior_tile_ranges_against_brute_force(key_tiles, causal, has_window):
    """Interior tiles [f_lo, f_hi) are exactly the fully visible in-range tiles, and no tile outside
    [t_lo, t_hi) holds a visible pair: every length residue, q_len < and > k_len, partial tiles.
    The boundary ranges that the kernels do not compile (ALIGNED in backward_fp8) are empty."""
    windows = (1, 7, 16, 20, 33, 47) if has_window else (0,)
    for block_q, block_k in ((16, 16), (32, 16), (16, 32)):
        fixed_block = block_q if key_tiles else block_k
        params = [(first, q_len, k_len, window)
                  for q_len in (*range(1, 65, 7), 32, 48) for k_len in (*range(1, 65, 5), 32, 48, 64)
                  for window in windows
                  for first in range(0, q_len if key_tiles else k_len, fixed_block)]
        p = torch.tensor(params, dtype=torch.int32)
        out = torch.empty_like(p)
        _tile_bounds_kernel[(1,)](p, out, len(params), KEY_TILES=key_tiles, BLOCK_Q=block_q, BLOCK_K=block_k,
                                  CAUSAL=causal, HAS_WINDOW=has_window, BLOCK=triton.next_power_of_2(len(params)))
        rows = torch.arange(-64, 128)[:, None]  # rows and keys well beyond both sequences
        keys = torch.arange(-64, 128)[None, :]
        for (first, q_len, k_len, window), (t_lo, f_lo, f_hi, t_hi) in zip(params, out.tolist()):
            pos = rows + k_len - q_len
            vis = (rows >= 0) & (rows < q_len) & (keys >= 0) & (keys < k_len)
            if causal:
                vis &= keys <= pos
            if has_window:
                vis &= pos - keys < window
                if not causal:
                    vis &= keys - pos < window
            if key_tiles:  # fixed query rows first .. first + block_q - 1, tiles of block_k keys
                tiles = vis[first + 64: first + 64 + block_q].reshape(block_q, -1, block_k).transpose(0, 1)
            else:  # fixed keys, tiles of block_q query rows
                tiles = vis[:, first + 64: first + 64 + block_k].reshape(-1, block_q, block_k)
            index = torch.arange(tiles.shape[0]) - 64 // (block_k if key_tiles else block_q)
            full = set(index[tiles.flatten(1).all(1)].tolist())
            seen = set(index[tiles.flatten(1).any(1)].tolist())
            case = (block_q, block_k, first, q_len, k_len, window, t_lo, f_lo, f_hi, t_hi)
            assert 0 <= t_lo <= f_lo <= f_hi <= t_hi, case
            assert full == set(range(f_lo, f_hi)), (case, sorted(full))
            assert seen <= set(range(t_lo, t_hi)), (case, sorted(seen))
            aligned = q_len % block_q == 0 and k_len % block_k == 0
            if key_tiles:  # dQ kernel: leading loop only with a window, trailing as below
                leading_compiled, trailing_compiled = has_window, causal or has_window or not aligned
            else:  # dK/dV kernel: leading loop for the causal diagonal or a window
                leading_compiled, trailing_compiled = causal or has_window, has_window or not aligned
            assert leading_compiled or t_lo == f_lo, case
            assert trailing_compiled or f_hi == t_hi, case
