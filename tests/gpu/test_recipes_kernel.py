"""Every recipe's Triton kernels on an FP8-capable GPU: against the emulation (same config), on
packed sequences of very different magnitudes, and on real activations (tests/data).

Bounds are those of test_forward_kernel.py (O_REL, LSE_ABS) and test_backward_kernel.py
(GRAD_REL, BF16_REL), with the same reasoning: Hopper's FP8 MMA keeps ~14 mantissa bits, so logits
and dP carry ~2^-14 relative noise that flips P and dS codes at rounding boundaries. The gradients'
bound is widened where the noise model puts a problem's noise above it (tests/noise_model.py,
``grad_bounds``): dS in E5M2 with one scale per head at d = 256 measured a dQ error of 1.05e-2,
where the model's bound is 1.64e-2. The rotation
adds one more such source (the kernel's ±1 Hadamard product sums in another order than the
emulation's fp32 matmul; its codes flip at ties only), far inside the same bounds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import noise_model  # noqa: E402
from helpers import make_qkv, rel_err  # noqa: E402
from recipe_names import recipe_config  # noqa: E402
from test_forward_kernel import _pinned_launch, lse_bound  # noqa: E402,F401  (autouse fixture)

from hf_fp8_attention import RECIPES  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from hf_fp8_attention.reference import emulated_backward, emulated_forward  # noqa: E402

pytestmark = pytest.mark.gpu

O_REL, GRAD_REL = 1e-2, 1e-2  # LSE: test_forward_kernel.lse_bound
# "name+flag": the recipe with a boolean option switched on (benchmarks/recipe_names.py;
# dq_in_stats: dQ in the statistics sweep).
KERNEL_RECIPES = ("fp8_delta", "fp8_stale", "fp8_delta_fast", "fp8_stale_fast", "fp8_delta_tile", "fp8_delta_token",
                  "hybrid_delta", "fp8_delta_fast+dq_in_stats")

SHAPES = {
    # name: ((B, Hq, Hkv, Sq, Sk, D), causal, window, packed cu_seqlens or None)
    "causal_gqa_d128": ((1, 4, 2, 1000, 1000, 128), True, None, None),
    "dense_d64": ((2, 4, 4, 300, 300, 64), False, None, None),
    "window_d96": ((1, 2, 1, 700, 700, 96), True, 200, None),
    "decode_q_short": ((1, 4, 2, 129, 700, 128), True, None, None),
    "packed_d64": ((1, 4, 2, 600, 600, 64), True, None, [0, 130, 130, 517, 600]),
    # Head dim 256 (Gemma 2/3): its own forward launches and the backward's 128-channel blocks.
    "causal_gqa_d256": ((1, 4, 2, 700, 700, 256), True, None, None),
    "packed_window_d256": ((1, 4, 2, 600, 600, 256), True, 150, [0, 130, 130, 517, 600]),
}


def _mask(causal, window, cu, device):
    if cu is None:
        return MaskSpec(causal=causal, window=window)
    t = torch.tensor(cu, dtype=torch.int32, device=device)
    lens = [b - a for a, b in zip(cu, cu[1:])]
    return MaskSpec(causal=causal, window=window, cu_seqlens_q=t, cu_seqlens_k=t,
                    max_seqlen_q=max(lens), max_seqlen_k=max(lens))


# Head dim 256 is new to the kernels: there every recipe of RECIPES runs (the others differ from
# KERNEL_RECIPES only in formats and scale rounding, already covered at d <= 128 by the backward tests).
CASES = [(r, s) for r in KERNEL_RECIPES for s in SHAPES] + [
    (r, s) for r in sorted(set(RECIPES) - set(KERNEL_RECIPES)) for s in SHAPES if s.endswith("_d256")]


@pytest.mark.parametrize("recipe, shape", CASES)
def test_kernels_match_emulation(recipe, shape):
    from hf_fp8_attention.kernels.backward import triton_backward
    from hf_fp8_attention.kernels.forward import triton_forward

    dims, causal, window, cu = SHAPES[shape]
    config = recipe_config(recipe)
    q, k, v, do = make_qkv(*dims, dtype=torch.float32, seed=7)
    scale = dims[-1] ** -0.5
    mask_cpu, mask_gpu = _mask(causal, window, cu, "cpu"), _mask(causal, window, cu, "cuda")
    ref_out, ref_lse = emulated_forward(q, k, v, scale=scale, mask=mask_cpu, config=config)
    ref_grads = emulated_backward(q, k, v, ref_out, ref_lse, do, scale=scale, mask=mask_cpu, config=config)
    qg, kg, vg, dog = (t.cuda() for t in (q, k, v, do))
    out, lse = triton_forward(qg, kg, vg, scale=scale, mask=mask_gpu, config=config)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    assert (lse.cpu()[fin] - ref_lse[fin]).abs().max().item() <= lse_bound(dims[-1])
    assert rel_err(out.cpu(), ref_out) <= O_REL, rel_err(out.cpu(), ref_out)
    # The backward on the emulation's forward, so it is checked alone.
    grads = triton_backward(qg, kg, vg, ref_out.cuda(), ref_lse.cuda(), dog, scale=scale, mask=mask_gpu, config=config)
    errors = {name: rel_err(g.cpu(), r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)}
    bounds = noise_model.grad_bounds(errors, q, k, v, do, mask_cpu, config, scale=scale, grad_rel=GRAD_REL)
    for name, err in errors.items():
        assert err <= bounds[name], (name, err, bounds[name])


@pytest.mark.parametrize("recipe, shape", [(r, s) for r in ("fp8_delta", "fp8_delta_fast", "fp8_stale")
                                           for s in ("causal_gqa_d128", "packed_d64", "window_d96")])
def test_row_form_rotation_matches_emulation(recipe, shape, monkeypatch):
    # The rotating statistics launch as xH (sequence_stats.TRANSPOSED_ROTATION off; the default is
    # Hᵀxᵀ): its shift rounds differently from the transposed form's, so codes may flip at ties; the
    # emulation's bounds hold for both.
    from hf_fp8_attention.kernels import sequence_stats

    monkeypatch.setattr(sequence_stats, "TRANSPOSED_ROTATION", False)
    test_kernels_match_emulation(recipe, shape)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast", "fp8_delta_fast+dq_in_stats"])
def test_packed_sequences_keep_their_own_scales(recipe, d):
    """A sequence 1000x larger packed after a small one: the small one's outputs and gradients
    are those it gets alone (scales crossing the boundary would flush it to zero codes)."""
    from hf_fp8_attention import fp8_attention

    config = recipe_config(recipe)
    small = [t.cuda() for t in make_qkv(hq=4, hkv=2, sq=300, d=d, dtype=torch.bfloat16, seed=1)]
    large = [t.cuda() * (1000 if i < 3 else 1)
             for i, t in enumerate(make_qkv(hq=4, hkv=2, sq=500, d=d, dtype=torch.bfloat16, seed=2))]

    def run(q, k, v, do, **kw):
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = fp8_attention(q, k, v, causal=True, scale=0.125, config=config, **kw)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    cu = torch.tensor([0, 300, 800], dtype=torch.int32, device="cuda")
    packed = run(*(torch.cat([a, b], dim=2) for a, b in zip(small, large)), cu_seqlens_q=cu, cu_seqlens_k=cu)
    alone = run(*small)
    for name, x, ref in zip(("out", "dq", "dk", "dv"), packed, alone):
        assert rel_err(x[:, :, :300], ref) <= GRAD_REL + 2.0**-8, (name, rel_err(x[:, :, :300], ref))


def test_fixture_errors_of_the_kernels_match_the_emulation():
    """On real activations the kernels' errors against float64 are within 5% of the emulation's."""
    from recipe_errors import DEFAULT_FIXTURE, SCALE, load_layers, recipe_errors

    from hf_fp8_attention.exact import exact_attention_grads

    for layer, tensors in load_layers(DEFAULT_FIXTURE, 1024).items():
        exact = exact_attention_grads(*tensors[:3], tensors[3], scale=SCALE, mask=MaskSpec(causal=True))
        for name in ("fp8_delta", "fp8_delta_fast", "fp8_delta_fast+dq_in_stats"):
            emu = recipe_errors(*tensors, recipe_config(name).replace(backend="emulation"), exact)
            gpu = recipe_errors(*(t.cuda() for t in tensors), recipe_config(name), tuple(t.cuda() for t in exact))
            for key in ("O", "dQ", "dK", "dV"):
                assert abs(gpu[key] - emu[key]) <= 0.05 * emu[key], (layer, name, key, gpu[key], emu[key])
