"""K's and V's copies handed from the forward to the backward through autograd
(``forward.HAND_OVER_KV_COPIES``), under the Triton interpreter: the call then saves no 16-bit K and
V (K is kept with soft-cap or sinks, whose statistics read it), the gradients are the same bits as
without the hand-over, no copies are kept under saved-tensor hooks (activation checkpointing), and
the copies live as the call's saved tensors: a second backward (retain_graph) gives the same
gradients, and a backward that does not retain the graph frees them."""
import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers import make_qkv
from hf_fp8_attention import RECIPES, fp8_attention
from hf_fp8_attention.kernels.quantize import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The package's Triton kernels for CPU tensors (the interpreter), the hand-over switch settable."""
    from hf_fp8_attention import ops
    from hf_fp8_attention.config import Backend
    from hf_fp8_attention.kernels import forward

    monkeypatch.setattr(ops, "select_backend", lambda device, config: Backend.TRITON)
    return lambda on: monkeypatch.setattr(forward, "HAND_OVER_KV_COPIES", on)


def _inputs(seed: int = 7):
    """Leaf q, k, v (GQA: 2 query heads on 1 kv head, 40 tokens) and dO."""
    q, k, v, dout = make_qkv(1, 2, 1, 40, d=64, dtype=torch.float32, seed=seed, outliers=True)
    return (*(t.requires_grad_() for t in (q, k, v)), dout)


def _grads(q, k, v, dout, config, **kw):
    """(dq, dk, dv) of one fwd+bwd through autograd; k and v enter as non-leaf copies, as a model's
    projections give them, and the caller's references to those copies are dropped."""
    out = fp8_attention(q, k * 1, v * 1, causal=True, config=config, **kw)
    out.backward(dout)
    grads = tuple(t.grad.clone() for t in (q, k, v))
    for t in (q, k, v):
        t.grad = None
    return grads


@pytest.mark.parametrize("recipe, kw", [("fp8_delta", {}), ("fp8_delta_fast", {}), ("fp8_delta", {"softcap": 5.0})])
def test_handed_over_copies_give_the_same_gradients_through_autograd(triton_on_cpu, recipe, kw):
    """Dropped inputs are NaN stand-ins in the backward: a read of their values would show here."""
    config = RECIPES[recipe].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = _inputs()
    triton_on_cpu(False)
    want = _grads(q, k, v, dout, config, **kw)
    triton_on_cpu(True)
    got = _grads(q, k, v, dout, config, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all() and torch.equal(a, b), name


@pytest.mark.parametrize("softcap, k_kept", [(None, False), (5.0, True)])
def test_handed_over_copies_stand_in_for_saved_k_and_v(triton_on_cpu, softcap, k_kept):
    """Between the forward and the backward nothing holds the 16-bit K and V but their producers:
    V is never kept, K only where the soft-cap's statistics need it; without the hand-over both are."""
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=32, block_k=32)
    q, k0, v0, dout = _inputs()
    for on in (False, True):
        triton_on_cpu(on)
        k, v = k0 * 1, v0 * 1
        refs = weakref.ref(k), weakref.ref(v)
        out = fp8_attention(q, k, v, causal=True, config=config, softcap=softcap)
        del k, v
        gc.collect()
        alive = tuple(r() is not None for r in refs)
        assert alive == ((k_kept, False) if on else (True, True)), on
        out.backward(dout)


def test_no_copies_are_kept_under_saved_tensor_hooks(triton_on_cpu, monkeypatch):
    """Non-reentrant activation checkpointing packs what the call saves; copies kept beside would
    outlive that, so none are handed over there: K and V are saved (and packed) as without the
    switch, and the gradients are the same bits."""
    from hf_fp8_attention.kernels import forward

    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = _inputs()
    triton_on_cpu(False)
    want = _grads(q, k, v, dout, config)
    triton_on_cpu(True)
    asked = []
    takes = forward.takes_kv_copies
    monkeypatch.setattr(forward, "takes_kv_copies", lambda *a: asked.append(takes(*a)) or asked[-1])
    out = checkpoint(lambda q, k, v: fp8_attention(q, k * 1, v * 1, causal=True, config=config), q, k, v,
                     use_reentrant=False)
    assert asked == []  # under the checkpoint's hooks the forward does not hand copies over
    out.backward(dout)
    assert asked == []  # nor in the recomputed forward
    for name, a, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        assert torch.equal(a, b), name


def test_copies_live_as_saved_tensors(triton_on_cpu, monkeypatch):
    """retain_graph: a second backward takes the same copies and gives the same gradients; a
    backward that does not retain the graph frees them, though the call's output (and so its
    autograd node) is still referenced."""
    from hf_fp8_attention.kernels import forward

    made = []
    triton_forward = forward.triton_forward

    def keep_refs(*args, **kw):  # weak references to the copies the forward hands over
        result = triton_forward(*args, **kw)
        handed = (kw.get("for_backward") or {}).get("kv_copies")
        made.extend(weakref.ref(t) for copies in handed[0][:2] for t in copies if t is not None)
        return result

    monkeypatch.setattr(forward, "triton_forward", keep_refs)
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = _inputs()
    triton_on_cpu(True)
    out = fp8_attention(q, k * 1, v * 1, causal=True, config=config)
    grads = []
    for retain in (True, False):
        out.backward(dout, retain_graph=retain)
        grads.append(tuple(t.grad.clone() for t in (q, k, v)))
        for t in (q, k, v):
            t.grad = None
        gc.collect()
        assert len(made) >= 4 and all((r() is not None) is retain for r in made), retain
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.isfinite(a).all() and torch.equal(a, b), name
