"""What the FP8 backward holds in memory at each gradient launch (host side only: every kernel is
stubbed, and each stubbed launch takes stock of the live tensors). Its peak is the dK/dV launch,
beside all three gradients: there it must hold the six FP8 copies that launch reads, not K's
channel-wise copy, which only dQ reads, and dK and dV must not exist yet during the dQ launches."""
import gc

import pytest
import torch

from helpers import make_qkv
from hf_fp8_attention import RECIPES
from hf_fp8_attention.kernels.backward import triton_backward
from hf_fp8_attention.kernels.quantize import interpreting
from hf_fp8_attention.masking import MaskSpec

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _live(kv_shape) -> tuple[int, int]:
    """(bytes of the live FP8 storages, number of live fp32 tensors shaped like ``kv_shape``)."""
    storages, kv_like = {}, 0
    for obj in gc.get_objects():
        if type(obj) is not torch.Tensor:  # no isinstance: some tracked objects warn when asked
            continue
        if obj.dtype in FP8:
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif obj.shape == kv_shape and obj.dtype == torch.float32:
            kv_like += 1
    return sum(storages.values()), kv_like


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast", "fp8_delta_token"])
def test_dk_dv_never_sit_beside_the_channel_copy_of_k(recipe, monkeypatch):
    import triton.runtime.interpreter as interpreter

    b, hq, hkv, s, d = 1, 4, 2, 64, 64  # GQA: K's shape is not Q's
    q, k, v, dout = make_qkv(b, hq, hkv, s, d=d, dtype=torch.float32)
    config = RECIPES[recipe].replace(backend="triton", block_q=32, block_k=32)
    out, lse = q.clone(), torch.zeros(b, hq, s)
    gc.collect()
    base_fp8, base_kv = _live(k.shape)  # what other tests left alive counts as zero
    launches = []

    def take_stock(self, *args, grid=None, **kwargs):
        fp8_bytes, kv_like = _live(k.shape)
        launches.append((self.fn.__name__, fp8_bytes - base_fp8, kv_like - base_kv))

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", take_stock)
    triton_backward(q, k, v, out, lse, dout, scale=0.125, mask=MaskSpec(causal=True), config=config)

    q_copy, k_copy = b * hq * s * d, b * hkv * s * d  # bytes of one FP8 copy (S and D need no padding)
    dq_launches = [x for x in launches if x[0] == "bwd_dq_fp8_kernel"]
    dkdv_launches = [x for x in launches if x[0] == "bwd_dkdv_fp8_kernel"]
    assert dq_launches and dkdv_launches, launches
    for _, fp8_bytes, kv_like in dq_launches:
        # Q, dO: row-wise and channel-wise; K: row-wise and channel-wise; V: row-wise
        assert fp8_bytes == 4 * q_copy + 3 * k_copy
        assert kv_like == 0  # dK and dV are not allocated yet
    for _, fp8_bytes, kv_like in dkdv_launches:
        assert fp8_bytes == 4 * q_copy + 2 * k_copy  # K's channel-wise copy freed
        assert kv_like == 2  # dK and dV
