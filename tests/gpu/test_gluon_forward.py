"""The Gluon forward (kernels/forward_gluon.py) on a Hopper GPU, for the recipes of helpers.GLUON_RECIPES.

Each test first checks, by a spy on its entry point, that the Gluon kernel ran where the case is in
its scope, so none can pass on the Triton kernel alone.

- Against the Triton kernel (``forward.GLUON_FORWARD`` set to ``()``), on the same inputs: both
  multiply the same FP8 codes in the same MMA shapes, with the same fp32 operations per score in
  the same order, so the P codes, the running maxima and the accumulators are the same; only the
  order of each tile's row sum of p may differ, a relative change of l (and so of O) below
  2^-24 · log2(128) ≈ 4e-7. So fp32 outputs are within ``F32_REL`` = 1e-6 of the Triton kernel's
  element by element, bf16 outputs within one bf16 step (2^-7 relative: the shared value may sit on
  a rounding boundary), and LSE within ``LSE_ABS`` = 1e-5 (|LSE| up to ~20 here, 1e-6 relative).
- Against the emulation, with tests/gpu/test_forward_kernel.py's bounds (the code-flip noise of
  Hopper's FP8 accumulation).
- FlashAttention-3's order within a warpgroup (``forward_gluon.PV_UNDER_SCORES``, a layout of
  ``LAYOUTS`` too): the merged loop's bits.
- Key tiles of 256 (a recipe with ``block_k=256``; ``forward_gluon.BLOCK_NS``), against the Triton
  kernel and the emulation at the same ``block_k``, with the same bounds.
- NaN in Q reaches the same outputs as through the Triton kernel (nothing hidden).
- The one-FMA exponent (``exponent.FMA_EXPONENT``, on by default; the tests start from the exact
  form and switch it on where they test it): against the emulation with the same bounds,
  and against the exact form, from which it moves p by ~1e-6 relative at these logits, so that a P
  code changes only where p sits that close to a rounding boundary (a few in a million on real
  activations, benchmarks/fma_exponent.py): O within ``FMA_O_REL`` = 1e-3 relative (norm) of the
  exact form's, ten times the largest per-head change on real activations and ten times below the
  emulation's bound; LSE within ``LSE_ABS``. Where a warpgroup's bound is exceeded (logits scaled
  up) the kernel takes the exact form: the same bits as with the switch off.
- Q's codes made by the kernel (``forward_gluon.QUANTIZE_Q``, on by default for 16-bit Q): the
  same 16-bit wgmma rotation, amax, division and conversion as the quantization launch's copy, so O
  and LSE are bit for bit those with the switch off (that launch), NaN included.
- The persistent kernel (``forward_gluon.PERSISTENT``, kernels/forward_persistent.py) runs each
  query block through the same consumer code as the per-block kernel, so O and LSE are its bits,
  with Q's codes made in the kernel (Q by TMA, head-major or token-major) or loaded, and with more
  blocks than SMs (several blocks per program); with the warpgroups' ping-pong (``PINGPONG``) too.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from helpers import GLUON_RECIPES as RECIPES, count_calls, make_qkv, rel_err  # noqa: E402
from test_forward_kernel import LSE_ABS as EMULATION_LSE_ABS, O_REL  # noqa: E402

from hf_fp8_attention import FP8AttentionConfig  # noqa: E402
from hf_fp8_attention.kernels import exponent, forward, forward_gluon, forward_persistent  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from hf_fp8_attention.reference import emulated_forward  # noqa: E402


def count_quantizations(monkeypatch, counts) -> None:
    """Count the forward's quantization launches in ``counts[0]``: K and V's (statistics and copies,
    in one launch or two: ``stats_then_copies``) and Q's (``quantize_operands``)."""
    count_calls(monkeypatch, forward, "stats_then_copies", counts, 0)
    count_calls(monkeypatch, forward, "quantize_operands", counts, 0)

pytestmark = pytest.mark.gpu

F32_REL, BF16_STEP, LSE_ABS, FMA_O_REL = 1e-6, 2.0**-7, 1e-5, 1e-3  # see the module docstring

# name: ((B, Hq, Hkv, Sq, Sk, D), causal)
SHAPES = {
    "causal_gqa": ((1, 4, 2, 512, 512, 128), True),
    "dense_sq_lt_sk": ((2, 2, 2, 256, 512, 128), False),
    "causal_g3": ((1, 6, 2, 384, 384, 128), True),
    "dense_mqa": ((2, 4, 1, 256, 256, 128), False),
    "causal_long": ((1, 2, 1, 2048, 2048, 128), True),
    "out_of_scope_length": ((1, 2, 2, 200, 200, 128), True),  # the Triton kernel runs
    # head dim 64 (forward_gluon.HEAD_DIMS; the package runs it where forward.GLUON_FORWARD says)
    "causal_gqa_d64": ((1, 9, 3, 512, 512, 64), True),  # SmolLM2-135M's heads
    "dense_d64": ((2, 2, 2, 256, 512, 64), False),
}
# More query blocks than an H100's or H200's 132 SMs: programs of the persistent kernel run several.
MANY_BLOCKS = {
    "causal_many_blocks": ((2, 16, 8, 2048, 2048, 128), True),  # 512 blocks
    "dense_many_blocks": ((2, 16, 16, 1024, 1024, 128), False),  # 256 blocks
}


@pytest.fixture
def gluon_calls(monkeypatch):
    """The Gluon forward enabled, in its exact exponent form (the comparisons with the Triton kernel
    are of the exact forms; the FMA tests switch ``exponent.FMA_EXPONENT``, on by default, back on);
    returns a one-entry list counting its launches."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = forward_gluon.unsupported_reason(torch.empty(1, 1, 128, 128, device="cuda"),
                                              torch.empty(1, 1, 128, 128, device="cuda"), MaskSpec(causal=True),
                                              RECIPES["fp8_delta_fast"], {})
    if reason is not None:
        pytest.skip(f"the Gluon forward does not run here: {reason}")
    monkeypatch.setattr(forward, "GLUON_FORWARD", forward_gluon.HEAD_DIMS)
    monkeypatch.setattr(exponent, "FMA_EXPONENT", False)
    calls = [0]
    count_calls(monkeypatch, forward_gluon, "gluon_forward", calls, 0)
    return calls


def _problem(shape: str, config: FP8AttentionConfig, dtype: torch.dtype, seed: int = 3):
    """((q, k, v) on the GPU in ``dtype``, mask, softmax scale, whether the case is in the kernel's scope)."""
    (b, hq, hkv, sq, sk, d), causal = SHAPES[shape] if shape in SHAPES else MANY_BLOCKS[shape]
    mask = MaskSpec(causal=causal)
    inside = forward_gluon.scope_reason((b, hq, sq, d), (b, hkv, sk, d), mask, config, {}) is None
    q, k, v, _ = make_qkv(b, hq, hkv, sq, sk, d, dtype=torch.float32, seed=seed)
    return tuple(t.to("cuda", dtype) for t in (q, k, v)), mask, d**-0.5, inside


def _forward(qkv, mask, scale, config):
    return forward.triton_forward(*qkv, scale=scale, mask=mask, config=config)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gluon_forward_matches_the_triton_kernel(shape, recipe, dtype, gluon_calls, monkeypatch):
    config = RECIPES[recipe]
    qkv, mask, scale, inside = _problem(shape, config, dtype)
    out, lse = _forward(qkv, mask, scale, config)
    assert gluon_calls[0] == int(inside)
    monkeypatch.setattr(forward, "GLUON_FORWARD", ())
    want, want_lse = _forward(qkv, mask, scale, config)
    assert gluon_calls[0] == int(inside), "the Triton kernel ran"
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    step = F32_REL if dtype == torch.float32 else BF16_STEP
    diff = (out.float() - want.float()).abs()
    assert (diff <= step * want.float().abs()).all(), diff.max().item()
    assert (lse - want_lse).abs().max().item() <= LSE_ABS


@pytest.mark.parametrize("fma", (False, True), ids=("exact", "fma"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("recipe", list(RECIPES)[::2])
@pytest.mark.parametrize("shape", list(SHAPES)[:3] + ["causal_gqa_d64"])
def test_gluon_forward_matches_emulation(shape, recipe, dtype, fma, gluon_calls, monkeypatch):
    monkeypatch.setattr(exponent, "FMA_EXPONENT", fma)
    config = RECIPES[recipe]
    qkv, mask, scale, inside = _problem(shape, config, dtype, seed=5)
    out, lse = _forward(qkv, mask, scale, config)
    assert gluon_calls[0] == 1 and inside
    ref, ref_lse = emulated_forward(*(t.float().cpu() for t in qkv), scale=scale, mask=mask, config=config)
    assert rel_err(out.float().cpu(), ref) <= O_REL, rel_err(out.float().cpu(), ref)
    assert (lse.cpu() - ref_lse).abs().max().item() <= EMULATION_LSE_ABS


@pytest.mark.parametrize("persistent", (True, False), ids=("persistent", "per_block"))
@pytest.mark.parametrize("shape", ["causal_gqa", "dense_sq_lt_sk", "causal_many_blocks"])
def test_gluon_forward_256_key_tiles_match_the_triton_kernel(shape, persistent, gluon_calls, monkeypatch):
    """A recipe with 256-key tiles (``block_k=256``, forward_gluon.BLOCK_NS): the kernel's tiles are
    the recipe's, so its outputs are the Triton kernel's at the same block_k, to the bounds above."""
    monkeypatch.setattr(forward_gluon, "PERSISTENT", persistent)
    config = RECIPES["fp8_delta_fast"].replace(block_k=256)
    qkv, mask, scale, inside = _problem(shape, config, torch.bfloat16)
    out, lse = _forward(qkv, mask, scale, config)
    assert inside and gluon_calls[0] == 1
    monkeypatch.setattr(forward, "GLUON_FORWARD", ())
    want, want_lse = _forward(qkv, mask, scale, config)
    assert gluon_calls[0] == 1, "the Triton kernel ran"
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    diff = (out.float() - want.float()).abs()
    assert (diff <= BF16_STEP * want.float().abs()).all(), diff.max().item()
    assert (lse - want_lse).abs().max().item() <= LSE_ABS


@pytest.mark.parametrize("fma", (False, True), ids=("exact", "fma"))
@pytest.mark.parametrize("recipe", ["fp8_delta_fast", "fp8_delta", "fp8_stale_fast"])
@pytest.mark.parametrize("shape", ["causal_gqa", "dense_sq_lt_sk", "causal_long"])
def test_gluon_forward_256_key_tiles_match_emulation(shape, recipe, fma, gluon_calls, monkeypatch):
    """256-key tiles against the emulation at the same block_k, with the 128-key kernel's bounds;
    a causal block's last tile then holds its diagonal and, for every other block, keys past it."""
    monkeypatch.setattr(exponent, "FMA_EXPONENT", fma)
    config = RECIPES[recipe].replace(block_k=256)
    qkv, mask, scale, inside = _problem(shape, config, torch.bfloat16, seed=5)
    out, lse = _forward(qkv, mask, scale, config)
    assert inside and gluon_calls[0] == 1
    ref, ref_lse = emulated_forward(*(t.float().cpu() for t in qkv), scale=scale, mask=mask, config=config)
    assert rel_err(out.float().cpu(), ref) <= O_REL, rel_err(out.float().cpu(), ref)
    assert (lse.cpu() - ref_lse).abs().max().item() <= EMULATION_LSE_ABS


@pytest.mark.parametrize("fma", (False, True), ids=("exact", "fma"))
@pytest.mark.parametrize("shape", list(SHAPES)[:2])
def test_gluon_forward_layouts_are_identical(shape, fma, gluon_calls, monkeypatch):
    """Q read by the S MMA from registers or from shared memory, one wait or two per key tile (in
    either order), a ring of 2 or 3 slots: the same products, bit for bit (either exponent form)."""
    monkeypatch.setattr(exponent, "FMA_EXPONENT", fma)
    config = RECIPES["fp8_delta_fast"]
    qkv, mask, scale, _ = _problem(shape, config, torch.bfloat16, seed=7)
    default = _forward(qkv, mask, scale, config)
    for layout in list(forward_gluon.LAYOUTS)[1:]:
        for name, value in zip(forward_gluon.LAYOUT_CONSTANTS, forward_gluon.LAYOUTS[layout]):
            monkeypatch.setattr(forward_gluon, name, value)
        got = _forward(qkv, mask, scale, config)
        assert all(torch.equal(g, d) for g, d in zip(got, default)), layout
    assert gluon_calls[0] == len(forward_gluon.LAYOUTS)


@pytest.mark.parametrize("fma", (False, True), ids=("exact", "fma"))
@pytest.mark.parametrize("persistent", (True, False), ids=("persistent", "per_block"))
@pytest.mark.parametrize("shape", ["causal_long", "causal_many_blocks", "dense_many_blocks", "causal_gqa_d64"])
def test_gluon_forward_pv_under_scores_keeps_the_bits(shape, persistent, fma, gluon_calls, monkeypatch):
    """FlashAttention-3's order within a warpgroup (``forward_gluon.PV_UNDER_SCORES``) runs the merged
    loop's operations on the same values in another order: the same bits, for blocks of one key tile
    (the loop's prologue alone), two (its peeled last step alone) and many, with several blocks per
    persistent program, at both head dims."""
    monkeypatch.setattr(exponent, "FMA_EXPONENT", fma)
    monkeypatch.setattr(forward_gluon, "PERSISTENT", persistent)
    config = RECIPES["fp8_delta_fast"]
    qkv, mask, scale, inside = _problem(shape, config, torch.bfloat16, seed=17)
    default = _forward(qkv, mask, scale, config)
    monkeypatch.setattr(forward_gluon, "PV_UNDER_SCORES", True)
    got = _forward(qkv, mask, scale, config)
    assert inside and gluon_calls[0] == 2
    assert torch.isfinite(got[0]).all()
    assert all(torch.equal(g, d) for g, d in zip(got, default))


def test_gluon_forward_propagates_nan_as_the_triton_kernel(gluon_calls, monkeypatch):
    config = RECIPES["fp8_delta_fast"]
    qkv, mask, scale, _ = _problem("causal_gqa", config, torch.bfloat16, seed=9)
    qkv[0][0, 1, 300, 7] = float("nan")  # one element of Q: its head's scale, so that whole head
    qkv[2][0, 0, 100, 3] = float("nan")  # one element of V: its kv head's channel scales
    out, lse = _forward(qkv, mask, scale, config)
    assert gluon_calls[0] == 1
    monkeypatch.setattr(forward, "GLUON_FORWARD", ())
    want, want_lse = _forward(qkv, mask, scale, config)
    assert torch.isnan(want).any(), "the Triton kernel shows the NaN"
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    assert torch.equal(torch.isnan(lse), torch.isnan(want_lse))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", list(SHAPES)[:5])
def test_gluon_forward_fma_exponent_keeps_the_exact_forms_outputs(shape, recipe, dtype, gluon_calls, monkeypatch):
    config = RECIPES[recipe]
    qkv, mask, scale, inside = _problem(shape, config, dtype, seed=11)
    want, want_lse = _forward(qkv, mask, scale, config)
    monkeypatch.setattr(exponent, "FMA_EXPONENT", True)
    out, lse = _forward(qkv, mask, scale, config)
    assert inside and gluon_calls[0] == 2
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_err(out.float(), want.float()) <= FMA_O_REL, rel_err(out.float(), want.float())
    assert (lse - want_lse).abs().max().item() <= LSE_ABS


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast"])
def test_gluon_forward_fma_guard_takes_the_exact_form_at_huge_logits(recipe, gluon_calls, monkeypatch):
    """q and k scaled by 30: every warpgroup's bound (about 0.13 · amax(QH) · amax(KH) here, ~2e5)
    is over FMA_EXPONENT_BOUND, so the kernel runs the exact form: bit for bit the switch-off result."""
    config = RECIPES[recipe]
    (q, k, v), mask, scale, _ = _problem("causal_long", config, torch.bfloat16, seed=13)
    qkv = (q * 30, k * 30, v)
    want = _forward(qkv, mask, scale, config)
    monkeypatch.setattr(exponent, "FMA_EXPONENT", True)
    got = _forward(qkv, mask, scale, config)
    assert gluon_calls[0] == 2
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("shape", ["causal_gqa", "dense_sq_lt_sk", "dense_mqa"])
def test_gluon_forward_writes_a_token_major_output(shape, gluon_calls, monkeypatch):
    """With ``TOKEN_MAJOR_OUT`` (the default) a token-major q (an attention layer's (B, S, H, D)
    transposed) gets O in its layout and a contiguous q a contiguous O, bit for bit the values of the
    kernel's contiguous store (the switch off)."""
    config = RECIPES["fp8_delta"]
    (q, k, v), mask, scale, inside = _problem(shape, config, torch.bfloat16)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    monkeypatch.setattr(forward_gluon, "TOKEN_MAJOR_OUT", False)
    want, want_lse = _forward((q, k, v), mask, scale, config)
    off, _ = forward.triton_forward(qt, k, v, scale=scale, mask=mask, config=config, token_major_out=True)
    assert off.is_contiguous() and torch.equal(off, want)
    monkeypatch.setattr(forward_gluon, "TOKEN_MAJOR_OUT", True)
    strided, strided_lse = _forward((q, k, v), mask, scale, config)  # a contiguous buffer, strided store
    assert strided.is_contiguous() and torch.equal(strided, want) and torch.equal(strided_lse, want_lse)
    out, lse = forward.triton_forward(qt, k, v, scale=scale, mask=mask, config=config, token_major_out=True)
    assert inside and gluon_calls[0] == 4
    assert out.transpose(1, 2).is_contiguous()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("nan", (False, True), ids=("finite", "nan"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", ["causal_gqa", "dense_sq_lt_sk", "causal_long"])
def test_gluon_forward_quantizes_q_as_the_quantization_launch(shape, recipe, dtype, nan, gluon_calls, monkeypatch):
    """``QUANTIZE_Q``: the kernel's codes and scales of the rotated Q are the quantization launch's,
    so O and LSE are bit for bit those with the switch off, for a contiguous and a token-major q;
    and the forward launches one quantization (K and V) instead of two. Non-causal calls take it
    only with ``QUANTIZE_Q_NONCAUSAL`` (off by default), switched on here."""
    config = RECIPES[recipe]
    (q, k, v), mask, scale, inside = _problem(shape, config, dtype, seed=17)
    if nan:  # one element of Q: its token's scale (per token) or its head's (per head) is NaN
        q[0, 1, 100, 7] = float("nan")
    quantizations = [0]
    count_quantizations(monkeypatch, quantizations)
    monkeypatch.setattr(forward_gluon, "QUANTIZE_Q", False)
    want = _forward((q, k, v), mask, scale, config)
    assert quantizations[0] == 2
    monkeypatch.setattr(forward_gluon, "QUANTIZE_Q", True)
    extra = 0 if mask.causal else 1  # by default a non-causal call keeps the launch
    if extra:
        assert _same_bits(_forward((q, k, v), mask, scale, config), want) and quantizations[0] == 4
    monkeypatch.setattr(forward_gluon, "QUANTIZE_Q_NONCAUSAL", True)  # the kernel's non-causal form too
    assert forward_gluon.q_quantization_reason(q, config, mask.causal) is None
    got = _forward((q, k, v), mask, scale, config)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # an attention layer's token-major q
    got_t = _forward((qt, k, v), mask, scale, config)
    assert inside and gluon_calls[0] == 3 + extra and quantizations[0] == 4 + 2 * extra
    assert torch.isnan(want[0]).any() == nan
    assert _same_bits(got, want) and _same_bits(got_t, want)


@pytest.mark.parametrize("q_codes", ("in_kernel", "launch"))
@pytest.mark.parametrize("layout", ("head_major", "token_major", "strided"))
@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast", "fp8_delta_fast+pow2"])
@pytest.mark.parametrize("shape", ["causal_gqa", "dense_sq_lt_sk", "causal_long", *MANY_BLOCKS])
def test_persistent_forward_is_the_per_block_kernel(shape, recipe, layout, q_codes, gluon_calls, monkeypatch):
    """``PERSISTENT``: O and LSE bit for bit the per-block kernel's, in the one-FMA exponent form (the
    default), with Q's codes made in the kernel (non-causal too) or by the launch; a q whose tokens
    are neither head-major nor token-major (``strided``) keeps the launch, and the persistent kernel
    loads its codes."""
    config = RECIPES[recipe]
    monkeypatch.setattr(exponent, "FMA_EXPONENT", True)
    monkeypatch.setattr(forward_gluon, "QUANTIZE_Q", q_codes == "in_kernel")
    monkeypatch.setattr(forward_gluon, "QUANTIZE_Q_NONCAUSAL", True)
    (q, k, v), mask, scale, inside = _problem(shape, config, torch.bfloat16, seed=23)
    if layout == "token_major":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout == "strided":  # every token's channels followed by as many unused ones
        wide = torch.zeros(q.shape[0], q.shape[2], q.shape[1], 2 * q.shape[3], dtype=q.dtype, device=q.device)
        wide[..., :q.shape[3]] = q.transpose(1, 2)
        q = wide[..., :q.shape[3]].transpose(1, 2)
    monkeypatch.setattr(forward_gluon, "PERSISTENT", False)
    want = _forward((q, k, v), mask, scale, config)
    persistent, quantizations = [0], [0]
    count_calls(monkeypatch, forward_persistent, "launch", persistent, 0)
    count_quantizations(monkeypatch, quantizations)
    monkeypatch.setattr(forward_gluon, "PERSISTENT", True)
    got = _forward((q, k, v), mask, scale, config)
    assert inside and gluon_calls[0] == 2 and persistent[0] == 1
    q_launch = q_codes == "launch" or layout == "strided"
    assert quantizations[0] == (2 if q_launch else 1)
    assert (forward_gluon.q_quantization_reason(q, config, mask.causal) is None) == (not q_launch)
    assert _same_bits(got, want)


@pytest.mark.parametrize("tree", (False, True), ids=("chain", "tree"))
@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast"])
@pytest.mark.parametrize("shape", ["causal_gqa", "causal_long", *MANY_BLOCKS])
def test_persistent_pingpong_is_the_per_block_kernel(shape, recipe, tree, gluon_calls, monkeypatch):
    """``PINGPONG`` in the persistent kernel: the warpgroups' turns run on across a program's blocks
    (each block t_hi + 1 issues), and only the issue order changes, so O and LSE are the per-block
    kernel's bits without ping-pong (row reductions as chains or as trees, ``TREE_REDUCTIONS``, on
    both sides), with several blocks per program (``MANY_BLOCKS``) too. A wrong turn count
    deadlocks the kernel (the GPU scripts' time limit ends the run) rather than passing."""
    config = RECIPES[recipe]
    monkeypatch.setattr(exponent, "FMA_EXPONENT", True)
    monkeypatch.setattr(forward_gluon, "TREE_REDUCTIONS", tree)
    qkv, mask, scale, inside = _problem(shape, config, torch.bfloat16, seed=29)
    monkeypatch.setattr(forward_gluon, "PERSISTENT", False)
    want = _forward(qkv, mask, scale, config)
    persistent = [0]
    count_calls(monkeypatch, forward_persistent, "launch", persistent, 0)
    monkeypatch.setattr(forward_gluon, "PERSISTENT", True)
    monkeypatch.setattr(forward_gluon, "PINGPONG", True)
    got = _forward(qkv, mask, scale, config)
    assert inside and gluon_calls[0] == 2 and persistent[0] == 1
    assert _same_bits(got, want)


def _same_bits(got: tuple, want: tuple) -> bool:
    """Whether (O, LSE) pairs are equal element by element, NaN where NaN."""
    return all(torch.equal(torch.isnan(g), torch.isnan(w)) and torch.equal(torch.nan_to_num(g), torch.nan_to_num(w))
               for g, w in zip(got, want))
