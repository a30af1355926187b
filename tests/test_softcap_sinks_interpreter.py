"""The Triton kernels with logit soft-capping and attention sinks, run by the Triton interpreter on
the CPU against the emulation (reference.py), which defines the numerics.

Tolerances are those of test_kernels_interpreter (forward) and test_backward_interpreter
(backward), for the same reasons: the interpreter rounds every FP8 code as torch does, so kernel
and emulation differ by fp32 summation order, exp2 against exp, and now the kernels' tanh (within
2 fp32 ulps of torch's: :func:`hf_fp8_attention.kernels.logit_mods._tanh`) and K-smoothing's row
constant added in log2 units; an FP8 code may flip where such a last-bit difference meets a
rounding tie (rare, but one flip moves a small gradient past the bound: with seed 2 one dS code of
the stale window case flipped, dQ 1.6e-4; the seeds below hit none). dsinks is a sum of per-row fp32 terms formed from the
kernels' statistics: the backward's bound applies. Inputs hold bf16 values (exact rotations and key
means, as in test_backward_interpreter), with q and k scaled and k biased so that the cap bends the
logits and K-smoothing's row constant is large.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton interpreter is off (GPU machine: see tests/gpu)", allow_module_level=True)

from hf_fp8_attention import reference  # noqa: E402
from hf_fp8_attention.config import FP8AttentionConfig  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from helpers import recipe_overrides  # noqa: E402

kernels = pytest.importorskip("hf_fp8_attention.kernels.backward")
forward = pytest.importorskip("hf_fp8_attention.kernels.forward")

FWD_REL, FWD_MAX_ABS, LSE_REL = 2e-5, 2e-3, 2e-5  # test_kernels_interpreter
KERNEL_VS_EMULATION = 1e-4  # test_backward_interpreter
TILES = dict(block_q=16, block_k=16)
SOFTCAP = 2.0  # logits of these inputs reach ~±6 (log2 units ~±9): most are bent
FAST = recipe_overrides("fp8_delta_fast")
TILE_RECIPE = recipe_overrides("fp8_delta_tile")
# Packed: sequence 0 has 10 queries and no key (with sinks: all mass on the sink), 4 tokens after
# the last sequence belong to none.
KEYLESS = ([0, 10, 36], [0, 0, 26])


def _inputs(b, hq, hkv, sq, sk, d, seed):
    g = torch.Generator().manual_seed(seed)

    def bf16_valued(*shape, gain=1.0, bias=0.0):
        return (torch.randn(*shape, generator=g) * gain + bias).to(torch.bfloat16).float()

    q, k = bf16_valued(b, hq, sq, d, gain=2.0), bf16_valued(b, hkv, sk, d, gain=2.0, bias=1.0)
    v, do = bf16_valued(b, hkv, sk, d), bf16_valued(b, hq, sq, d)
    return q, k, v, do, torch.randn(hq, generator=g)


def _mask(causal=False, window=None, cu=None):
    if cu is None:
        return MaskSpec(causal=causal, window=window)
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in cu)
    return MaskSpec(causal=causal, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck)


def _mods(name, sinks):
    return {"softcap": dict(softcap=SOFTCAP), "sinks": dict(sinks=sinks), "both": dict(softcap=SOFTCAP, sinks=sinks)}[name]


def _rel(a, b):
    b = b.double()
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


FORWARD_CASES = {
    # name: ((B, Hq, Hkv, Sq, Sk, D), mask kwargs, config overrides, modifiers)
    "causal_gqa_both": ((1, 4, 2, 40, 40, 64), {"causal": True}, {}, "both"),
    "window_noncausal_softcap": ((1, 2, 1, 37, 50, 64), {"window": 8}, {}, "softcap"),
    "varlen_keyless_rows_both": ((1, 2, 2, 40, 30, 64), {"cu": KEYLESS}, {}, "both"),
    "fast_recipe_sinks": ((1, 2, 1, 21, 21, 64), {"causal": True}, FAST, "sinks"),
    "tile_recipe_both": ((2, 2, 1, 20, 37, 64), {"causal": True}, TILE_RECIPE, "both"),
    "gemma2_d256_softcap": ((1, 2, 1, 20, 20, 256), {"causal": True}, {}, "softcap"),
}


@pytest.mark.parametrize("name", sorted(FORWARD_CASES))
def test_forward_kernel_matches_emulation(name):
    shape, mask_kw, cfg_kw, mods = FORWARD_CASES[name]
    q, k, v, _, sinks = _inputs(*shape, seed=1)
    mask, config, m = _mask(**mask_kw), FP8AttentionConfig(**TILES, **cfg_kw), _mods(mods, sinks)
    scale = shape[-1] ** -0.5
    out, lse = forward.triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16, **m)
    ref, ref_lse = reference.emulated_forward(q, k, v, scale=scale, mask=mask, config=config, **m)
    assert torch.isfinite(out).all()
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert ((lse[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp(min=1.0)).max() <= LSE_REL
    assert _rel(out, ref) <= FWD_REL, _rel(out, ref)
    assert (out - ref).abs().max() <= FWD_MAX_ABS * ref.abs().max()
    if "cu" in mask_kw:  # the keyless rows: O = 0 and, with sinks, LSE = σ
        assert not out[:, :, :10].any()
        assert ((lse[0, :, :10] - sinks[:, None]).abs() / sinks.abs().clamp(min=1.0)[:, None]).max() <= LSE_REL


@pytest.fixture
def launches(request, monkeypatch):
    """The backward schedules: pre-quantized split launches (default), fused ones, in-register."""
    schedule = getattr(request, "param", "prequant")
    monkeypatch.setitem(kernels.LAUNCH, "prequant", schedule != "inregister")
    if schedule == "prequant_fused":
        monkeypatch.setitem(kernels.LAUNCH, "split_dkdv", False)
        monkeypatch.setitem(kernels.LAUNCH, "split_dq_stats", False)
    return schedule


BACKWARD_CASES = {
    # name: ((B, Hq, Hkv, Sq, Sk, D), mask kwargs, config overrides, modifiers, schedule)
    "causal_gqa_both": ((1, 2, 1, 36, 36, 64), {"causal": True}, {}, "both", "prequant"),
    "causal_gqa_both_fused": ((1, 2, 1, 36, 36, 64), {"causal": True}, {}, "both", "prequant_fused"),
    "varlen_keyless_rows_both": ((1, 2, 1, 40, 30, 64), {"causal": True, "cu": KEYLESS}, {}, "both", "prequant"),
    "stale_window_both": ((1, 2, 1, 24, 24, 64), {"causal": True, "window": 7}, {"delta": "stale"}, "both",
                          "prequant"),
    "fast_recipe_sinks": ((1, 2, 1, 20, 24, 64), {"causal": True}, FAST, "sinks", "prequant"),
    "hybrid_both": ((1, 2, 1, 20, 24, 64), {"causal": True}, {"backward": "bf16"}, "both", "prequant"),
    "inregister_tile_recipe_both": ((1, 2, 1, 20, 24, 64), {"causal": True}, TILE_RECIPE, "both", "inregister"),
    # head dim 256: the launches split dQ's, dK's and dV's channels in two (LAUNCH_D256)
    "d256_both": ((1, 2, 1, 20, 24, 256), {"causal": True}, {}, "both", "prequant"),
    "hybrid_d256_softcap": ((1, 2, 1, 20, 24, 256), {"causal": True}, {"backward": "bf16"}, "softcap", "prequant"),
}


@pytest.mark.parametrize("name, launches", [(n, BACKWARD_CASES[n][4]) for n in sorted(BACKWARD_CASES)],
                         indirect=["launches"])
def test_backward_kernels_match_emulation(name, launches):
    """dQ, dK, dV and dsinks on the emulation's forward (so the backward is checked alone)."""
    shape, mask_kw, cfg_kw, mods, _ = BACKWARD_CASES[name]
    q, k, v, do, sinks = _inputs(*shape, seed=3)
    mask, config, m = _mask(**mask_kw), FP8AttentionConfig(**TILES, **cfg_kw), _mods(mods, sinks)
    scale = shape[-1] ** -0.5
    out, lse = reference.emulated_forward(q, k, v, scale=scale, mask=mask, config=config, **m)
    got = kernels.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config, **m)
    ref = reference.emulated_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config, **m)
    assert len(got) == len(ref) == (4 if "sinks" in m else 3)
    for label, x, r in zip(("dq", "dk", "dv", "dsinks"), got, ref):
        assert x.shape == r.shape and x.dtype == r.dtype, label
        assert torch.isfinite(x).all(), label
        assert _rel(x, r) <= KERNEL_VS_EMULATION, (label, _rel(x, r))
    if "cu" in mask_kw:
        assert not got[0][:, :, :10].any() and not got[0][:, :, 36:].any()  # keyless rows, tokens outside


def test_kernel_zero_row_sum_with_sinks_and_cap():
    """The kernels' own fp32 dS̃ with the sink's entry −P_sink D_i: the extended row sum vanishes to
    fp32 rounding when matched (test_backward_interpreter's bound 1e-5) and not with the stale delta."""
    shape, mask = (1, 1, 1, 32, 32, 64), _mask(causal=True)
    q, k, v, do, sinks = _inputs(*shape, seed=4)
    residual = {}
    for delta in ("matched", "stale"):
        config = FP8AttentionConfig(**TILES, delta=delta)
        out, lse = reference.emulated_forward(q, k, v, scale=0.125, mask=mask, config=config, softcap=SOFTCAP,
                                              sinks=sinks)
        *grads, ds_sum, pabs = kernels.triton_backward_row_sums(q, k, v, out, lse, do, scale=0.125, mask=mask,
                                                                config=config, softcap=SOFTCAP, sinks=sinks)
        assert len(grads) == 4 and (pabs > 0).all()
        residual[delta] = (ds_sum.abs() / pabs).max().item()
    assert residual["matched"] <= 1e-5, residual
    assert residual["stale"] >= 100 * residual["matched"], residual
