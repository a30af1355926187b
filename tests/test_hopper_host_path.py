"""The host path an H100 takes, run without one (``benchmarks/hopper_host_sim.py``): the launches
of a fwd+bwd in order, every launch's arguments keyed by the direct launch path, every recipe and
mask kind planned without error, and the simulation's patches undone on exit."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from hopper_host_sim import simulated_hopper  # noqa: E402

from hf_fp8_attention import RECIPES, fp8_attention, ops  # noqa: E402
from hf_fp8_attention.kernels import quantize, tiles  # noqa: E402

# What one fwd+bwd launches on an H100 for a dense causal call, as the statistics, copies, forward
# and backward kernels stand: a launch more or fewer is a change of host time (tens of µs each on
# the benchmark machine's host, benchmarks/NOTES.md, "Host time") and should be a deliberate one.
DENSE_D128 = ["_partials_kernel", "quantize_kernel", "_fwd_persistent_kernel",  # Q's codes made in the forward
              "_partials_kernel", "quantize_kernel", "quantize_kernel", "_stats_kernel", "_dkdv_kernel", "_dq_kernel"]
SMOLLM2_D64 = ["_partials_kernel", "quantize_kernel", "quantize_kernel", "_fwd_kernel",  # no Gluon forward at 64
               "_partials_kernel", "quantize_kernel", "quantize_kernel", "bwd_dq_fp8_kernel", "_dkdv_kernel",
               "bwd_dq_fp8_kernel"]


def fwd_bwd(recipe: str, seq: int, heads: int, kv_heads: int, dim: int, **kwargs):
    """``(launch names, out, grads)`` of one simulated fwd+bwd on token-major bf16 inputs."""
    q, k, v = (torch.randn(1, seq, h, dim, dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
               for h in (heads, kv_heads, kv_heads))
    sinks = kwargs.get("sinks")
    with simulated_hopper() as launches:
        out = fp8_attention(q, k, v, config=RECIPES[recipe], **kwargs)
        grads = torch.autograd.grad(out, [t for t in (q, k, v, sinks) if t is not None], torch.randn_like(out))
    return [launch.kernel for launch in launches], out, grads


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast"])
def test_dense_causal_d128_launches_the_gluon_kernels(recipe):
    names, out, grads = fwd_bwd(recipe, 1024, 8, 4, 128, causal=True)
    assert names == DENSE_D128
    assert out.shape == (1, 8, 1024, 128) and [g.shape[1] for g in grads] == [8, 4, 4]


def test_smollm2_layer_launches():
    names, _, _ = fwd_bwd("fp8_delta_fast", 2048, 9, 3, 64, causal=True)
    assert names == SMOLLM2_D64


MASKS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window": dict(causal=True, window=64),
    "packed": dict(causal=True, cu_seqlens_q=torch.tensor([0, 100, 384], dtype=torch.int32),
                   cu_seqlens_k=torch.tensor([0, 100, 384], dtype=torch.int32), max_seqlen_q=284, max_seqlen_k=284),
    "softcap": dict(causal=True, softcap=30.0),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_every_recipe_and_mask_plans_its_launches(recipe, mask):
    """Every launch's arguments get a direct-path key (``arg_key`` raises on one it cannot key:
    that call would take Triton's slower binding on the GPU), and the outputs have q's, k's and v's
    shapes and dtype."""
    names, out, grads = fwd_bwd(recipe, 384, 4, 2, 128 if mask != "full" else 64, **MASKS[mask])
    assert names and all(isinstance(n, str) for n in names)
    assert out.shape[:3] == (1, 4, 384) and out.dtype == torch.bfloat16
    assert [tuple(g.shape[1:3]) for g in grads] == [(4, 384), (2, 384), (2, 384)]


def test_sinks_get_a_gradient():
    sinks = torch.zeros(4, requires_grad=True)
    names, _, grads = fwd_bwd("fp8_delta_fast", 256, 4, 2, 64, causal=True, sinks=sinks)
    assert len(grads) == 4 and grads[3].shape == (4,) and names


def test_patches_are_undone():
    before = (ops.select_backend, quantize._INTERPRETING, quantize.on_cuda, tiles.on_cuda, tiles.sm_count)
    with simulated_hopper():
        assert quantize.on_cuda(torch.device("cpu")) and tiles.sm_count(None) == 132
    assert (ops.select_backend, quantize._INTERPRETING, quantize.on_cuda, tiles.on_cuda, tiles.sm_count) == before
