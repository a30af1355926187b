"""The backward's K/V copies made by the forward's quantization launch (``forward.HAND_OVER_KV_COPIES``)
on an FP8-capable GPU: the forward's outputs and the gradients the same bits as when the backward
makes its own copies, through the kernels' entry points and through autograd."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from helpers import make_qkv  # noqa: E402
from test_recipes_kernel import SHAPES, _mask  # noqa: E402

from hf_fp8_attention import RECIPES, fp8_attention  # noqa: E402
from hf_fp8_attention.kernels import forward  # noqa: E402
from hf_fp8_attention.kernels.backward import triton_backward  # noqa: E402

pytestmark = pytest.mark.gpu


def _inputs(shape: str):
    dims, causal, window, cu = SHAPES[shape]
    q, k, v, dout = (t.cuda() for t in make_qkv(*dims, dtype=torch.bfloat16, seed=3, outliers=True))
    return q, k, v, dout, _mask(causal, window, cu, "cuda"), dims[-1] ** -0.5


@pytest.mark.parametrize("shape", ["causal_gqa_d128", "dense_d64", "window_d96", "packed_d64", "causal_gqa_d256"])
@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast", "fp8_stale"])
def test_handed_over_copies_change_no_bit(recipe, shape, monkeypatch):
    config = RECIPES[recipe]
    q, k, v, dout, mask, scale = _inputs(shape)
    out0, lse0 = forward.triton_forward(q, k, v, scale=scale, mask=mask, config=config)
    own = triton_backward(q, k, v, out0, lse0, dout, scale=scale, mask=mask, config=config)
    monkeypatch.setattr(forward, "HAND_OVER_KV_COPIES", True)
    kept = {}
    out, lse = forward.triton_forward(q, k, v, scale=scale, mask=mask, config=config, for_backward=kept)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    handed = kept["kv_copies"]
    reused = triton_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config,
                             kv_stats=kept["kv_stats"], q_stats=kept.get("q_stats"), kv_copies=handed)
    assert handed == []
    for name, a, b in zip(("dq", "dk", "dv"), reused, own):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast"])
def test_autograd_with_handed_over_copies_changes_no_bit(recipe, monkeypatch):
    q, k, v, dout, mask, scale = _inputs("causal_gqa_d128")
    config = RECIPES[recipe]

    def grads():
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        out = fp8_attention(qs, ks, vs, causal=True, config=config)
        out.backward(dout)
        return out.detach(), qs.grad, ks.grad, vs.grad
    off = grads()
    monkeypatch.setattr(forward, "HAND_OVER_KV_COPIES", True)
    handed = []
    takes = forward.takes_kv_copies
    monkeypatch.setattr(forward, "takes_kv_copies", lambda *a: handed.append(takes(*a)) or handed[-1])
    on = grads()
    assert handed == [True]
    for name, a, b in zip(("out", "dq", "dk", "dv"), on, off):
        assert torch.equal(a, b), name


def test_handed_over_copies_stand_in_for_saved_k_and_v(monkeypatch):
    """Between the forward and the backward the call keeps K's and V's FP8 copies (3 bytes per
    (K, V) element pair, plus ~3% of scales) instead of the 16-bit K and V (4): with k and v produced
    for the call alone, as a model's projections give them, ~0.9 byte per pair less is allocated
    (asserted: more than half of that); gradients the same bits."""
    q, k0, v0, dout = (t.cuda() for t in make_qkv(1, 16, 8, 4096, d=128, dtype=torch.bfloat16, seed=4,
                                                  outliers=True))
    q.requires_grad_()
    k0.requires_grad_()
    v0.requires_grad_()
    config = RECIPES["fp8_delta"]
    held, grads = {}, {}
    for on in (False, True):
        monkeypatch.setattr(forward, "HAND_OVER_KV_COPIES", on)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fp8_attention(q, k0 * 1, v0 * 1, causal=True, config=config)
        torch.cuda.synchronize()
        held[on] = torch.cuda.memory_allocated() - before
        out.backward(dout)
        grads[on] = tuple(t.grad.clone() for t in (q, k0, v0))
        for t in (q, k0, v0):
            t.grad = None
        del out
    assert held[False] - held[True] > 0.5 * k0.numel(), held
    for name, a, b in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        assert torch.equal(a, b), name
