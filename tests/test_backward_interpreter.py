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
import os

import pytest
import torch

# Triton decides interpreted vs compiled when a kernel is decorated, i.e. when the kernels module is
# first imported; conftest.py switches the interpreter on for the whole session on machines without
# a CUDA GPU. Where it is off (a GPU machine), tests/gpu covers these kernels instead.
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter is off in this session (GPU machine: see tests/gpu)", allow_module_level=True)

from hf_fp8_attention import reference
from hf_fp8_attention.config import FP8AttentionConfig
from hf_fp8_attention.masking import MaskSpec

kernels = pytest.importorskip("hf_fp8_attention.kernels.backward")

KERNEL_VS_EMULATION = 1e-4
TILES = dict(block_q=16, block_k=16)  # small tiles: several tiles (and partial ones) on tiny shapes


def _rel(a, b):
    b = b.double()
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(b, hq, hkv, sq, sk, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d), (b, hq, sq, d))]


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


CASES = {
    # name: ((B, Hq, Hkv, Sq, Sk, D), mask kwargs, config overrides)
    "dense": ((1, 2, 1, 32, 32, 64), {}, {}),
    "causal_gqa_qshort_odd": ((1, 2, 1, 17, 36, 64), {"causal": True}, {}),
    "window_noncausal_d96_batch2": ((2, 1, 1, 19, 19, 96), {"window": 5}, {}),
    "causal_window_d128": ((1, 1, 1, 24, 24, 128), {"causal": True, "window": 7}, {}),
    "varlen_causal": ((1, 2, 1, 40, 40, 64), {"causal": True, "cu": ([0, 7, 40], [0, 7, 40])}, {}),
    "stale_causal": ((1, 2, 1, 20, 20, 64), {"causal": True}, {"delta": "stale"}),
    "pow2_e5m2": ((1, 2, 1, 20, 24, 64), {"causal": True}, {"pow2_scales": True, "do_format": "e5m2", "ds_format": "e5m2"}),
    "hybrid_matched": ((1, 2, 1, 20, 24, 64), {"causal": True}, {"backward": "bf16"}),
    "hybrid_stale": ((1, 2, 1, 20, 24, 64), {"causal": True}, {"backward": "bf16", "delta": "stale"}),
    "single_query": ((1, 2, 1, 1, 24, 64), {"causal": True}, {}),
}


@pytest.fixture(params=[True, False], ids=["prequant", "inregister"])
def fp8_path(request, monkeypatch):
    """Both FP8 schedules: operands quantized once up front, or in registers inside each program."""
    monkeypatch.setitem(kernels.LAUNCH, "prequant", request.param)
    return request.param


INREGISTER_CASES = ("causal_gqa_qshort_odd", "varlen_causal", "pow2_e5m2")


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_emulation(name, fp8_path):
    if not fp8_path and (name not in INREGISTER_CASES or "hybrid" in name):
        pytest.skip("in-register FP8 path: a few cases suffice (it shares the masking/tiling code)")
    shape, mask_kw, cfg_kw = CASES[name]
    config = FP8AttentionConfig(**TILES, **cfg_kw)
    (dq, dk, dv), ref = _run(shape, _mask(**mask_kw), config)
    for label, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert x.shape == r.shape and x.dtype == r.dtype, label
        assert torch.isfinite(x).all(), label
        assert _rel(x, r) <= KERNEL_VS_EMULATION, (label, _rel(x, r))


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


def test_matched_row_sums_vanish_and_stale_do_not():
    """Σ_j dS_ij of the kernel's own fp32 dS: fp32 rounding level when matched (sums of <= 32
    terms of size P|dP|, so |Σ| / Σ P|dP| <= ~32 · 2^-24 ≈ 2e-6; bound 1e-5), and orders of
    magnitude larger with the stale delta (FP8 dO·V vs rowsum(dO∘O): ~1e-2)."""
    shape, mask = (1, 1, 1, 32, 32, 64), _mask(causal=True)
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
    q, k, v, do = _inputs(1, 1, 1, 16, 16, 64, seed=3)
    config = FP8AttentionConfig(**TILES)
    mask = _mask()
    out, lse = reference.emulated_forward(q, k, v, scale=0.125, mask=mask, config=config)
    q[0, 0, 5, 7] = float("nan")
    dq, dk, dv = kernels.triton_backward(q, k, v, out, lse, do, scale=0.125, mask=mask, config=config)
    assert not torch.isfinite(dq[0, 0, 5]).any()  # the poisoned row
    assert not torch.isfinite(dk).all() and not torch.isfinite(dv).all()


def test_bad_inputs_raise_clear_errors():
    q, k, v, do = _inputs(1, 2, 1, 16, 16, 64, seed=1)
    lse = torch.zeros(1, 2, 16)
    stale = FP8AttentionConfig(delta="stale")
    with pytest.raises(ValueError, match="needs the forward output"):
        kernels.triton_backward(q, k, v, None, lse, do, scale=0.1, mask=MaskSpec(), config=stale)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.triton_backward(q[..., :32], k[..., :32], v[..., :32], None, lse, do[..., :32],
                                scale=0.1, mask=MaskSpec(), config=FP8AttentionConfig())
    with pytest.raises(ValueError, match="lse"):
        kernels.triton_backward(q, k, v, None, lse.double(), do, scale=0.1, mask=MaskSpec(), config=FP8AttentionConfig())
    with pytest.raises(ValueError, match="dout"):
        kernels.triton_backward(q, k, v, None, lse, do[:, :1], scale=0.1, mask=MaskSpec(), config=FP8AttentionConfig())
