"""The Gluon backward kernels on a Hopper GPU (the recipes of helpers.GLUON_RECIPES): the statistics
(kernels/backward_stats_gluon.py, matched delta only), dQ (kernels/backward_dq_gluon.py) and the
fused dK/dV (kernels/backward_dkdv_gluon.py).

Each test enables every kernel at every head dim it is built for (as the package does), and first
checks that each kernel whose scope the case is in ran (spies on their entry points), so none can
pass on the Triton launches alone.

- Against the emulation, with the bounds of tests/gpu/test_backward_kernel.py (GRAD_REL, BF16_REL:
  the code-flip noise of Hopper's FP8 accumulation on problems of hundreds of rows and keys),
  widened where the noise model (tests/noise_model.py, ``grad_bounds``) puts a problem's noise
  above them: ``fp8_delta`` on 256 queries over 512 keys measured a dQ error of 1.005e-2, where
  the model's bound is 1.76e-2.
- Against the Triton launch each replaces (its ``LAUNCH`` key set to ``()``), on the same inputs:
  the gradients the kernel's output does not reach must be bit-identical (every launch is
  deterministic); the ones it reaches come from the same FP8 codes multiplied in the same MMA shapes and tile order,
  so they may differ only where an fp32 per-element factor rounds differently (grouping, FMA
  contraction) by a few ulp before an FP8 cast: a code flips only within a few 2^-23 of a rounding
  boundary 2^-3 wide, a share of ~1e-5, and each flip moves its term by one FP8 step. ``AB_REL`` =
  1e-3 needs ~1e-4 of the terms to flip (sqrt(1/2) · 2^-3 · sqrt(share) = 1e-3), ten times that
  share, and is still ten times below GRAD_REL: a wrong scale, a lost tile or a wrong head shows as
  O(1).
- NaN in dO reaches the same gradient elements as through the Triton launches (nothing hidden).
- The persistent dQ and statistics kernels (their modules' ``PERSISTENT``) run each query block
  through the per-block kernels' code: the three gradients are the same bits, with more blocks than
  SMs too (several blocks per program).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import noise_model  # noqa: E402
from helpers import GLUON_RECIPES as RECIPES, chunk_every_call, count_calls, make_qkv, rel_err  # noqa: E402
from test_backward_kernel import BF16_REL, GRAD_REL  # noqa: E402

from hf_fp8_attention import FP8AttentionConfig  # noqa: E402
from hf_fp8_attention.config import DeltaMode  # noqa: E402
from hf_fp8_attention.kernels import (  # noqa: E402
    backward, backward_dkdv_gluon, backward_dq_gluon, backward_stats_gluon,
)
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from hf_fp8_attention.reference import emulated_backward, emulated_forward  # noqa: E402

pytestmark = pytest.mark.gpu

AB_REL = 1e-3  # see the module docstring
# LAUNCH key: (module, entry point, the gradients its output reaches: 0 dQ, 1 dK, 2 dV)
KERNELS = {"gluon_dq_stats": (backward_stats_gluon, "gluon_dq_stats", (0, 1, 2)),
           "gluon_dq": (backward_dq_gluon, "gluon_dq", (0, )),
           "gluon_dkdv": (backward_dkdv_gluon, "gluon_dkdv", (1, 2))}

# name: ((B, Hq, Hkv, Sq, Sk, D), causal)
SHAPES = {
    "causal_gqa_d128": ((1, 4, 2, 512, 512, 128), True),
    "dense_d128_sq_lt_sk": ((2, 2, 2, 256, 512, 128), False),
    "causal_g3_d128": ((1, 6, 2, 384, 384, 128), True),
    "causal_g3_d64": ((1, 6, 2, 384, 384, 64), True),  # dK/dV only (dQ is built for 128)
    "dense_mqa_d64": ((2, 4, 1, 256, 256, 64), False),
}
# More query blocks than an H100's or H200's 132 SMs: persistent programs run several.
MANY_BLOCKS = {
    "causal_many_blocks_d128": ((2, 16, 8, 2048, 2048, 128), True),  # 512 blocks
    "dense_many_blocks_d128": ((2, 16, 16, 1024, 1024, 128), False),  # 256 blocks
}


@pytest.fixture
def gluon_calls(monkeypatch):
    """Every kernel enabled at every head dim it is built for; returns their launch counts since the
    test began ({LAUNCH key: count})."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = backward_dkdv_gluon.unsupported_reason(torch.empty(1, 1, 128, 128, device="cuda"),
                                                    torch.empty(1, 1, 128, 128, device="cuda"),
                                                    MaskSpec(causal=True), RECIPES["fp8_delta_fast"], {})
    if reason is not None:
        pytest.skip(f"the Gluon backward kernels do not run here: {reason}")
    calls = dict.fromkeys(KERNELS, 0)
    for key, (module, entry, _) in KERNELS.items():
        monkeypatch.setitem(backward.LAUNCH, key, module.HEAD_DIMS)
        count_calls(monkeypatch, module, entry, calls, key)
    return calls


def _problem(shape: str, config: FP8AttentionConfig, seed: int = 3):
    """((q, k, v, dO) fp32 on the CPU, mask, softmax scale, {LAUNCH key: in the kernel's scope})."""
    (b, hq, hkv, sq, sk, d), causal = SHAPES[shape] if shape in SHAPES else MANY_BLOCKS[shape]
    mask = MaskSpec(causal=causal)
    scope = {key: module.scope_reason((b, hq, sq, d), (b, hkv, sk, d), mask, config, {}) is None
             for key, (module, _, _) in KERNELS.items()}
    return make_qkv(b, hq, hkv, sq, sk, d, dtype=torch.float32, seed=seed), mask, d**-0.5, scope


def _gpu_backward(tensors, mask, scale, config, dtype):
    """The Triton forward and the backward on the GPU: (dq, dk, dv)."""
    from hf_fp8_attention.kernels.forward import triton_forward

    q, k, v, do = (t.to("cuda", dtype) for t in tensors)
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config)
    return backward.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gluon_backward_matches_emulation(shape, recipe, dtype, gluon_calls):
    config = RECIPES[recipe]
    tensors, mask, scale, scope = _problem(shape, config)
    got = _gpu_backward(tensors, mask, scale, config, dtype)
    assert gluon_calls == {key: int(inside) for key, inside in scope.items()}
    q, k, v, do = (t.to(dtype).float() for t in tensors)  # the GPU's inputs, on the CPU
    out, lse = emulated_forward(q, k, v, scale=scale, mask=mask, config=config)
    ref = emulated_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    for label, x in zip(("dq", "dk", "dv"), got):
        assert torch.isfinite(x).all(), label
    errors = {label: rel_err(x.float().cpu(), r) for label, x, r in zip(("dq", "dk", "dv"), got, ref)}
    rounding = 0.0 if dtype == torch.float32 else BF16_REL - GRAD_REL  # the bf16 output's rounding
    bounds = noise_model.grad_bounds({n: e - rounding for n, e in errors.items()}, q, k, v, do, mask, config,
                                     scale=scale, grad_rel=GRAD_REL)
    for label, err in errors.items():
        assert err <= bounds[label] + rounding, (label, err, bounds[label] + rounding)


# the fast recipes with either delta, and the default one: Q's and dO's scales per token
AB_RECIPES = ("fp8_delta_fast", "fp8_stale_fast", "fp8_delta")


@pytest.mark.parametrize("recipe", AB_RECIPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gluon_backward_matches_triton_launches(shape, recipe, gluon_calls, monkeypatch):
    config, dtype = RECIPES[recipe], torch.bfloat16
    tensors, mask, scale, scope = _problem(shape, config, seed=11)
    both = _gpu_backward(tensors, mask, scale, config, dtype)
    assert gluon_calls == {key: int(inside) for key, inside in scope.items()}
    for key, (_, _, reached) in KERNELS.items():
        if not scope[key]:
            continue
        with monkeypatch.context() as patch:
            patch.setitem(backward.LAUNCH, key, ())
            triton = _gpu_backward(tensors, mask, scale, config, dtype)
        for i, label in enumerate(("dq", "dk", "dv")):
            if i in reached:
                assert rel_err(both[i], triton[i]) <= AB_REL, (key, label, rel_err(both[i], triton[i]))
            else:
                assert torch.equal(both[i], triton[i]), (key, label, "not reached by the kernel: must be identical")


# (shape, LAUNCH key, layout, recipe): each alternative operand layout or schedule of the dK/dV, dQ
# and statistics kernels, on the shapes at head dims the kernel is built for, with the recipes in
# its scope (the statistics kernel's is the matched delta alone)
LAYOUT_CASES = [(shape, key, layout, recipe) for key in ("gluon_dkdv", "gluon_dq", "gluon_dq_stats")
                for layout in list(KERNELS[key][0].LAYOUTS)[1:]
                for shape, (dims, _) in SHAPES.items() if dims[-1] in KERNELS[key][0].HEAD_DIMS
                for recipe in list(RECIPES)[:2]
                if key != "gluon_dq_stats" or RECIPES[recipe].delta is DeltaMode.MATCHED]


@pytest.mark.parametrize("shape, key, layout, recipe", LAYOUT_CASES)
def test_gluon_layouts_match_the_default(shape, key, layout, recipe, gluon_calls, monkeypatch):
    """An alternative operand layout or schedule (dK/dV: K and V read from shared memory, 32- or
    64-query tiles; dQ: Q and dO from shared memory, 64- or 128-key tiles; statistics: each tile's
    products issued before the previous tile is folded) computes from the same codes with the same
    per-element operations as the default, so the gradients its kernel's output reaches are within
    AB_REL of the default's (only the MMAs' fp32 accumulation may group differently) and the others
    identical."""
    module, _, reached = KERNELS[key]
    config, dtype = RECIPES[recipe], torch.bfloat16
    tensors, mask, scale, _ = _problem(shape, config, seed=7)
    default = _gpu_backward(tensors, mask, scale, config, dtype)
    assert gluon_calls[key] == 1  # every shape here is in the kernel's scope
    for name, value in zip(module.LAYOUT_CONSTANTS, module.LAYOUTS[layout]):
        monkeypatch.setattr(module, name, value)
    got = _gpu_backward(tensors, mask, scale, config, dtype)
    assert gluon_calls[key] == 2, "the layout's kernel ran"
    for i, label in enumerate(("dq", "dk", "dv")):
        if i in reached:
            assert torch.isfinite(got[i]).all(), label
            assert rel_err(got[i], default[i]) <= AB_REL, (layout, label, rel_err(got[i], default[i]))
        else:
            assert torch.equal(got[i], default[i]), (label, "not reached by the kernel: must be identical")


def test_gluon_backward_gives_a_first_query_zero_dq(gluon_calls):
    """A causal sequence's first query sees one key: its matched D' equals its dP' exactly, so its dS
    and dQ are exactly 0 (as through the Triton launches, tests/gpu/test_extreme_inputs.py). Q is
    scaled up so that the logits, and the rounding of S = s · sq, are large."""
    config, dtype = RECIPES["fp8_delta_fast"], torch.bfloat16
    tensors, mask, scale, _ = _problem("causal_gqa_d128", config, seed=13)
    tensors[0].mul_(8.0)
    got = _gpu_backward(tensors, mask, scale, config, dtype)
    assert gluon_calls["gluon_dq_stats"] == 1 and gluon_calls["gluon_dq"] == 1
    first = got[0][:, :, 0]
    assert torch.equal(first, torch.zeros_like(first)), first.abs().max()
    assert got[0].abs().max() > 0  # the later queries have gradients


def test_gluon_backward_propagates_nan_as_the_triton_launches(gluon_calls, monkeypatch):
    config, dtype = RECIPES["fp8_delta_fast"], torch.bfloat16
    tensors, mask, scale, _ = _problem("causal_gqa_d128", config, seed=5)
    tensors[3][0, 1, 300, 7] = float("nan")  # one element of dO, query head 1 (kv head 0)
    got = _gpu_backward(tensors, mask, scale, config, dtype)
    assert gluon_calls == dict.fromkeys(KERNELS, 1)
    for key in KERNELS:
        monkeypatch.setitem(backward.LAUNCH, key, ())
    want = _gpu_backward(tensors, mask, scale, config, dtype)
    for label, x, r in zip(("dq", "dk", "dv"), got, want):
        assert torch.isnan(r).any(), f"{label}: the Triton launches show the NaN"
        assert torch.equal(torch.isnan(x), torch.isnan(r)), label


@pytest.mark.parametrize("recipe", ("fp8_delta", "fp8_delta_fast"))
@pytest.mark.parametrize("shape", ("causal_gqa_d128", "causal_g3_d128"))
def test_causal_dispatch_order_changes_no_bit(shape, recipe, gluon_calls, monkeypatch):
    """Causal Gluon programs run longest first ``gluon_hopper.DISPATCH["head_group"]`` (batch, head)
    rows at a time. Each program computes the same tiles whatever its place in the order, and the
    only cross-program step (the dS bound's atomic max) is order-free, so the forward's O and LSE and
    the three gradients are the same bits under every grouping: rows one after the other (1), groups
    that do not divide the rows (3, with 4 or 6 query rows and 2 kv rows), and one group over all
    rows (8). A mapping that skipped or repeated a (rank, row) would leave rows unwritten or wrong."""
    from hf_fp8_attention.kernels import forward, forward_gluon, gluon_hopper

    monkeypatch.setattr(forward, "GLUON_FORWARD", forward_gluon.HEAD_DIMS)
    forward_calls = [0]
    count_calls(monkeypatch, forward_gluon, "gluon_forward", forward_calls, 0)
    monkeypatch.setattr(gluon_hopper, "DISPATCH", dict(gluon_hopper.DISPATCH))
    config = RECIPES[recipe]
    tensors, mask, scale, _ = _problem(shape, config, seed=11)
    q, k, v, do = (t.to("cuda", torch.bfloat16) for t in tensors)

    def run(group):
        gluon_hopper.DISPATCH["head_group"] = group
        out, lse = forward.triton_forward(q, k, v, scale=scale, mask=mask, config=config)
        return (out, lse) + tuple(backward.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask,
                                                           config=config))

    want = run(4)
    assert forward_calls[0] == 1 and gluon_calls == dict.fromkeys(KERNELS, 1)
    for group in (1, 3, 8):
        got = run(group)
        for label, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert torch.equal(x, r), (group, label)
    assert forward_calls[0] == 4 and gluon_calls == dict.fromkeys(KERNELS, 4)
    assert all(torch.isfinite(x).all() for x in want)


@pytest.mark.parametrize("recipe", ("fp8_delta", "fp8_delta_fast", "fp8_stale_fast"))
@pytest.mark.parametrize("shape", ("causal_gqa_d128", "dense_d128_sq_lt_sk", "causal_g3_d128", *MANY_BLOCKS))
def test_persistent_backward_kernels_change_no_bit(shape, recipe, gluon_calls, monkeypatch):
    """``PERSISTENT`` in backward_dq_gluon and backward_stats_gluon: dQ, dK and dV bit for bit those of
    the per-block kernels (the stale recipe runs no statistics launch: its dQ alone)."""
    from hf_fp8_attention.kernels.forward import triton_forward

    config = RECIPES[recipe]
    tensors, mask, scale, scope = _problem(shape, config, seed=29)
    q, k, v, do = (t.to("cuda", torch.bfloat16) for t in tensors)
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config)
    want = backward.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    assert gluon_calls == {key: int(inside) for key, inside in scope.items()}
    persistent = {"dq": 0, "stats": 0}
    for module, key in ((backward_dq_gluon, "dq"), (backward_stats_gluon, "stats")):
        monkeypatch.setattr(module, "PERSISTENT", True)
        count_calls(monkeypatch, module, "launch_table", persistent, key)
    got = backward.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    assert persistent == {"dq": 1, "stats": int(scope["gluon_dq_stats"])} and scope["gluon_dq"]
    for label, x, r in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(r).all() and torch.equal(x, r), label


@pytest.mark.parametrize("recipe", ("fp8_delta", "fp8_delta_fast"))
@pytest.mark.parametrize("shape", ("causal_gqa_d128", "causal_g3_d128", "causal_g3_d64", "causal_many_blocks_d128"))
def test_dkdv_products_under_exponentials_change_no_bit(shape, recipe, gluon_calls, monkeypatch):
    """``backward_dkdv_gluon.PRODUCTS_UNDER_EXPS`` (causal calls): each tile's dV and dK products run
    under the next tile's exponentials, the same operations on the same values, so dK and dV come out
    bit for bit those of the default schedule (merged waits; with GQA waited in turn), dQ untouched."""
    from hf_fp8_attention.kernels.forward import triton_forward

    config = RECIPES[recipe]
    tensors, mask, scale, scope = _problem(shape, config, seed=31)
    q, k, v, do = (t.to("cuda", torch.bfloat16) for t in tensors)
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config)
    want = backward.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    assert scope["gluon_dkdv"] and gluon_calls["gluon_dkdv"] == 1
    modes, merged_mode = [], backward_dkdv_gluon.merged_mode
    monkeypatch.setattr(backward_dkdv_gluon, "PRODUCTS_UNDER_EXPS", True)
    monkeypatch.setattr(backward_dkdv_gluon, "merged_mode",
                        lambda groups, causal: modes.append(merged_mode(groups, causal)) or modes[-1])
    got = backward.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    assert modes == [2] and gluon_calls["gluon_dkdv"] == 2
    for label, x, r in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(r).all() and torch.equal(x, r), label


def test_backward_chunks_only_where_one_pass_raises_the_peak(monkeypatch):
    """``LAUNCH["backward_chunks_below_peak"]`` against the real allocator: a large call from a
    fresh memory peak runs in chunks; after a larger allocation has raised the peak (as a training
    step's saved activations do) the same call runs one pass, with the same gradient bits."""
    from hf_fp8_attention import RECIPES as ALL_RECIPES, fp8_attention

    monkeypatch.setitem(backward.LAUNCH, "backward_chunks", 2)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunk_min_elements", 1 << 22)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks_below_peak", True)
    counts = []
    chunk_slices = backward._chunk_slices

    def counted(*args):
        chunks = chunk_slices(*args)
        counts.append(len(chunks))
        return chunks

    monkeypatch.setattr(backward, "_chunk_slices", counted)
    q, k, v, do = (t.cuda() for t in make_qkv(1, 8, 4, 4096, 4096, 128, torch.bfloat16, seed=3))  # 2^22 elements

    def grads():
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = fp8_attention(qg, kg, vg, causal=True, config=ALL_RECIPES["fp8_delta"])
        return torch.autograd.grad(out, (qg, kg, vg), do)

    grads()  # compiles (and autotunes) first: a benchmark's buffers would raise the peak mid-call
    counts.clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    chunked = grads()
    peak = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # a 1 GiB peak, freed at once
    del peak
    one_pass = grads()
    assert counts == [2, 1], counts
    for label, a, b in zip(("dq", "dk", "dv"), chunked, one_pass):
        assert torch.equal(a, b), label


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast"])
@pytest.mark.parametrize("shape", ["causal_gqa_d128", "dense_d128_sq_lt_sk"])
def test_gluon_backward_in_chunks_equals_one_pass(shape, recipe, gluon_calls, monkeypatch):
    """``LAUNCH["backward_chunks"] = 2``: kv-head chunks (one batch row) or batch-row chunks, each
    chunk's Gluon launches writing their slice of the whole gradients: the same bits as one pass."""
    config, dtype = RECIPES[recipe], torch.bfloat16
    tensors, mask, scale, scope = _problem(shape, config, seed=13)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks", 1)
    one_pass = _gpu_backward(tensors, mask, scale, config, dtype)
    once = dict(gluon_calls)
    chunk_every_call(monkeypatch, 2)
    chunked = _gpu_backward(tensors, mask, scale, config, dtype)
    assert {key: gluon_calls[key] - once[key] for key in KERNELS} == {key: 2 * int(inside)
                                                                       for key, inside in scope.items()}
    for label, a, b in zip(("dq", "dk", "dv"), chunked, one_pass):
        assert torch.equal(a, b), label
