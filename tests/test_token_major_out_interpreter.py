"""O laid out as a token-major q is (``kernels.forward.output_buffer``), under the Triton
interpreter: where an attention layer hands q as a ``(B, S, H, D)`` tensor transposed, the eager
op writes O so that the layer's transpose back to ``(B, S, H, D)`` is contiguous with no copy, with
the same values and gradients bit for bit as from contiguous inputs."""
import pytest
import torch

from helpers import make_qkv
from hf_fp8_attention import RECIPES, fp8_attention
from hf_fp8_attention.kernels.forward import output_buffer, triton_forward
from hf_fp8_attention.kernels.quantize import interpreting
from hf_fp8_attention.masking import MaskSpec

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """``x (B, H, S, D)`` with the same values, as a ``(B, S, H, D)`` tensor transposed."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("zeros", [False, True])
def test_output_buffer_follows_a_token_major_query(zeros):
    q = torch.randn(2, 3, 5, 8)
    for layout, want in ((_token_major(q), True), (q, False)):
        out = output_buffer(layout, zeros=zeros)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert out.transpose(1, 2).is_contiguous() is want and out.is_contiguous() is not want
        if zeros:
            assert not out.any()
    assert output_buffer(_token_major(q), zeros=False, token_major=False).is_contiguous()
    # one head: both layouts are one, the buffer is contiguous
    assert output_buffer(torch.randn(2, 5, 1, 8).transpose(1, 2), zeros=False).is_contiguous()


@pytest.mark.parametrize("recipe, packed", [("fp8_delta", False), ("fp8_delta_fast", True)])
def test_token_major_forward_writes_the_same_values(recipe, packed):
    config = RECIPES[recipe].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, _ = make_qkv(1, 4, 2, 40, d=64, dtype=torch.float32, seed=3, outliers=True)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    mask = (MaskSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=25, max_seqlen_k=25) if packed
            else MaskSpec(causal=True))
    qt = _token_major(q)
    out, lse = triton_forward(qt, k, v, scale=0.125, mask=mask, config=config, block_m=16, token_major_out=True)
    ref, ref_lse = triton_forward(q, k, v, scale=0.125, mask=mask, config=config, block_m=16)
    assert ref.is_contiguous() and out.transpose(1, 2).is_contiguous()
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    # without the flag the contract stays contiguous, whatever q's layout
    assert triton_forward(qt, k, v, scale=0.125, mask=mask, config=config, block_m=16)[0].is_contiguous()


def test_eager_op_output_transposes_back_without_a_copy(monkeypatch):
    from hf_fp8_attention import ops
    from hf_fp8_attention.config import Backend

    monkeypatch.setattr(ops, "select_backend", lambda device, config: Backend.TRITON)  # CPU tensors, interpreted
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = make_qkv(1, 4, 2, 32, d=64, dtype=torch.float32, seed=7)
    grads = []
    for inputs in ((q, k, v), (_token_major(q), _token_major(k), _token_major(v))):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = fp8_attention(*leaves, causal=True, config=config)
        layer_out = out.transpose(1, 2).contiguous()  # what an attention layer does with the result
        if leaves[0].is_contiguous():
            assert out.is_contiguous()
        else:
            assert layer_out.data_ptr() == out.data_ptr()  # the transpose back needed no copy
        layer_out.backward(dout.transpose(1, 2))
        grads.append((out.detach(), *(x.grad for x in leaves)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), name


def test_switched_off_the_triton_forward_writes_o_contiguous(monkeypatch):
    from hf_fp8_attention.kernels import forward

    monkeypatch.setattr(forward, "TOKEN_MAJOR_OUT", False)
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, _ = make_qkv(1, 4, 2, 32, d=64, dtype=torch.float32, seed=1)
    out, _ = triton_forward(_token_major(q), k, v, scale=0.125, mask=MaskSpec(causal=True), config=config,
                            block_m=16, token_major_out=True)
    assert out.is_contiguous()
