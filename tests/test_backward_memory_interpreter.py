"""What the FP8 backward holds in memory at each gradient launch (host side only: every kernel is
stubbed, and each stubbed launch takes stock of the live tensors). Each gradient is allocated just
before the launch that writes it and each FP8 copy freed after its last reader. Where LSE', D' and
the dS bound have a launch of their own (the matched delta, and per-head dS scales), dK/dV runs
next beside all seven copies and dQ last beside five (Q's and dO's channel-wise copies freed);
where dQ's launch forms them, dQ runs first beside seven and dK/dV beside six (K's channel-wise
copy freed)."""
import gc

import pytest
import torch

from helpers import chunk_every_call, make_qkv
from hf_fp8_attention import RECIPES
from hf_fp8_attention.kernels.backward import triton_backward
from hf_fp8_attention.kernels.quantize import interpreting
from hf_fp8_attention.masking import MaskSpec

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _live(q_shape, kv_shape) -> tuple[int, int, int]:
    """(bytes of the live FP8 storages, numbers of live fp32 tensors shaped like ``q_shape`` and like
    ``kv_shape``)."""
    storages, q_like, kv_like = {}, 0, 0
    for obj in gc.get_objects():
        if type(obj) is not torch.Tensor:  # no isinstance: some tracked objects warn when asked
            continue
        if obj.dtype in FP8:
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif obj.dtype == torch.float32:
            q_like += obj.shape == q_shape
            kv_like += obj.shape == kv_shape
    return sum(storages.values()), q_like, kv_like


def _stock(recipe, monkeypatch, **overrides) -> tuple[list, int, int]:
    """``(launches, bytes of one FP8 copy of Q, of K)``: per gradient launch (name, writes dQ, FP8
    bytes, dQ-shaped and dK-shaped fp32 tensors live beyond what the call started with)."""
    import triton.runtime.interpreter as interpreter

    b, hq, hkv, s, d = 1, 4, 2, 64, 64  # GQA: K's shape is not Q's
    q, k, v, dout = make_qkv(b, hq, hkv, s, d=d, dtype=torch.float32)
    config = RECIPES[recipe].replace(backend="triton", block_q=32, block_k=32, **overrides)
    out, lse = q.clone(), torch.zeros(b, hq, s)
    gc.collect()
    base_fp8, base_q, base_kv = _live(q.shape, k.shape)  # what other tests left alive counts as zero
    launches = []

    def take_stock(self, *args, grid=None, **kwargs):
        name = self.fn.__name__
        if name in ("bwd_dq_fp8_kernel", "bwd_dkdv_fp8_kernel"):
            fp8_bytes, q_like, kv_like = _live(q.shape, k.shape)
            launches.append((name, bool(kwargs.get("GRADS")), fp8_bytes - base_fp8, q_like - base_q,
                             kv_like - base_kv))

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", take_stock)
    triton_backward(q, k, v, out, lse, dout, scale=0.125, mask=MaskSpec(causal=True), config=config)
    return launches, b * hq * s * d, b * hkv * s * d  # S and D need no padding


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast", "fp8_delta_token", "fp8_stale"])
def test_dkdv_then_dq_after_a_statistics_launch(recipe, monkeypatch):
    launches, q_copy, k_copy = _stock(recipe, monkeypatch)
    seven = 4 * q_copy + 3 * k_copy  # Q, dO: row- and channel-wise; K: row- and channel-wise; V: row-wise
    assert [(name, grads) for name, grads, *_ in launches][0] == ("bwd_dq_fp8_kernel", False), launches
    assert launches[-1][:2] == ("bwd_dq_fp8_kernel", True), launches
    stats, dkdv, dq = launches[0], launches[1:-1], launches[-1]
    assert stats[2:] == (seven, 0, 0)  # no gradient allocated yet
    assert dkdv and all(x[0] == "bwd_dkdv_fp8_kernel" and x[2:] == (seven, 0, 2) for x in dkdv), launches
    assert dq[2:] == (seven - 2 * q_copy, 1, 2)  # Q's and dO's channel-wise copies freed; dQ beside dK, dV


@pytest.mark.parametrize("recipe, overrides", [("fp8_stale_token", {}), ("fp8_delta_fast", {"dq_in_stats": True})])
def test_dq_first_where_its_launch_forms_the_statistics(recipe, overrides, monkeypatch):
    launches, q_copy, k_copy = _stock(recipe, monkeypatch, **overrides)
    seven = 4 * q_copy + 3 * k_copy
    dq = [x for x in launches if x[0] == "bwd_dq_fp8_kernel"]
    dkdv = [x for x in launches if x[0] == "bwd_dkdv_fp8_kernel"]
    assert launches == dq + dkdv and len(dq) == 1 and dkdv, launches
    assert dq[0][1:] == (True, seven, 1, 0)  # dK and dV not allocated yet
    assert all(x[2:] == (seven - k_copy, 1, 2) for x in dkdv)  # K's channel-wise copy freed


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_stale_token"])
def test_chunks_hold_one_chunks_copies_beside_the_whole_gradients(recipe, monkeypatch):
    """``LAUNCH["backward_chunks"] = 2`` on one batch row: two chunks of one kv head each. The three
    gradients are allocated whole before the first launch; every launch holds half the copies."""
    chunk_every_call(monkeypatch, 2)
    launches, q_copy, k_copy = _stock(recipe, monkeypatch)
    seven = 4 * q_copy + 3 * k_copy
    grads = [x for x in launches if x[1] or x[0] == "bwd_dkdv_fp8_kernel"]
    assert len(grads) >= 4, launches  # dQ and dK/dV launches of both chunks
    assert max(x[2] for x in launches) == seven // 2, launches  # one chunk's copies at a time
    # dQ whole from the first launch on (a chunk's query slice of 2 heads has K's shape, so the
    # dK-shaped count also holds views and only bounds dK and dV from below)
    assert all(x[3] == 1 and x[4] >= 2 for x in launches), launches
