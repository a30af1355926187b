"""ops.py on the CPU: backend selection rules and torch.compile over the custom ops (emulation)."""
from __future__ import annotations

import pytest
import torch

from hf_fp8_attention import RECIPES, FP8AttentionConfig, fp8_attention
from hf_fp8_attention.config import Backend
from hf_fp8_attention.ops import config_key, select_backend


def test_select_backend_rules_on_cpu():
    assert select_backend("cpu", FP8AttentionConfig()) is Backend.EMULATION
    assert select_backend("cpu", FP8AttentionConfig(backend="emulation")) is Backend.EMULATION
    with pytest.raises(RuntimeError, match="emulation"):
        select_backend("cpu", FP8AttentionConfig(backend="triton"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_select_backend_on_this_gpu():
    cfg = FP8AttentionConfig()
    if torch.cuda.get_device_capability() >= (8, 9):
        assert select_backend("cuda", cfg) is Backend.TRITON
    else:
        with pytest.raises(RuntimeError, match="sdpa"):
            select_backend("cuda", cfg)
    assert select_backend("cuda", cfg.replace(backend="emulation")) is Backend.EMULATION


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_config_key_round_trips(name):
    from hf_fp8_attention.ops import _config_from_key

    assert _config_from_key(config_key(RECIPES[name])) == RECIPES[name]


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_stale"])
def test_torch_compile_fullgraph_on_cpu(recipe):
    # fullgraph=True fails on any graph break, so this proves the attention call (forward and the
    # autograd backward) is traced as the custom ops. aot_eager: no C++ toolchain needed.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 64, generator=gen).requires_grad_() for h in (4, 2, 2))
    cfg = RECIPES[recipe]

    def loss(q, k, v):
        return fp8_attention(q, k, v, causal=True, window=17, config=cfg).square().sum()

    l_c = torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v)
    g_c = torch.autograd.grad(l_c, (q, k, v))
    l_e = loss(q, k, v)
    g_e = torch.autograd.grad(l_e, (q, k, v))
    assert torch.equal(l_c, l_e)
    for a, b in zip(g_c, g_e):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_eager_path_equals_the_custom_op(recipe):
    # Eager calls run the op bodies through a plain autograd Function (no custom-op dispatch); the
    # custom op (what torch.compile traces) must give the same output and gradients, bit for bit.
    from hf_fp8_attention.masking import MaskSpec
    from hf_fp8_attention.ops import FP8AttentionFunction, _flat_mask

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 45, 64, generator=gen).requires_grad_() for h in (4, 2, 2))
    do = torch.randn(1, 4, 45, 64, generator=gen)
    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    mask = MaskSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    cfg = RECIPES[recipe]

    class Recorder(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    ops = []
    with Recorder():
        out_e = FP8AttentionFunction.apply(q, k, v, 0.125, mask, cfg)
    assert not any("hf_fp8_attention" in name for name in ops), "eager call went through the custom op"
    grads_e = torch.autograd.grad(out_e, (q, k, v), do)
    out_o, _ = torch.ops.hf_fp8_attention.forward(q, k, v, 0.125, *_flat_mask(mask), config_key(cfg))
    grads_o = torch.autograd.grad(out_o, (q, k, v), do)
    assert torch.equal(out_e, out_o)
    for a, b in zip(grads_e, grads_o):
        assert torch.equal(a, b)


def test_flat_mask_round_trip_keeps_window_and_max_lengths():
    from hf_fp8_attention.masking import MaskSpec
    from hf_fp8_attention.ops import _flat_mask, _mask_spec

    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    for mask in (MaskSpec(), MaskSpec(causal=True, window=4),
                 MaskSpec(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6),
                 MaskSpec(cu_seqlens_q=cu, cu_seqlens_k=cu)):
        assert _mask_spec(*_flat_mask(mask)) == mask
