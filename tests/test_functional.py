"""fp8_attention's input checks: every bad input names what is wrong."""
import pytest
import torch

from hf_fp8_attention import FP8AttentionConfig, fp8_attention

from helpers import make_qkv


def _qkv(**kwargs):
    return make_qkv(sq=16, **kwargs)[:3]


def test_output_layout_dtype_and_default_scale():
    q, k, v = _qkv(hq=4, hkv=1)
    out = fp8_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out, fp8_attention(q, k, v, scale=64**-0.5))
    assert not torch.equal(out, fp8_attention(q, k, v, scale=0.5))


def test_autocast_casts_inputs_like_sdpa():
    """Under autocast (fp32 q/k after RoPE, bf16 v) the op runs in the autocast dtype and the
    gradients flow back to the inputs in their own dtypes."""
    q, k, v = (t.float() for t in _qkv(hq=4, hkv=2))
    q.requires_grad_(True)
    v_bf16 = v.bfloat16().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fp8_attention(q, k, v_bf16, causal=True)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v_bf16.repeat_interleave(2, 1), is_causal=True)
    assert out.dtype == sdpa.dtype == torch.bfloat16
    assert torch.equal(out, fp8_attention(q.bfloat16(), k.bfloat16(), v_bf16, causal=True))
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and v_bf16.grad.dtype == torch.bfloat16
    assert torch.isfinite(q.grad).all() and torch.isfinite(v_bf16.grad).all()
    # A backward called inside the autocast region computes the same gradients.
    grads = q.grad.clone(), v_bf16.grad.clone()
    q.grad = v_bf16.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp8_attention(q, k, v_bf16, causal=True).float().sum().backward()
    assert torch.equal(q.grad, grads[0]) and torch.equal(v_bf16.grad, grads[1])


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda q, k, v: (q.float(), k, v), TypeError, "q, k, v must share a dtype"),
        (lambda q, k, v: (q.to(torch.int32), k, v), TypeError, "q has dtype torch.int32"),
        (lambda q, k, v: (q, k.double(), v.double()), TypeError, "k has dtype torch.float64"),
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q, k, v[:, :, :8]), ValueError, "k and v must have the same shape"),
        (lambda q, k, v: (q, k[:, :, :, :32], v[:, :, :, :32]), ValueError, "head dims differ"),
        (lambda q, k, v: (q.expand(2, -1, -1, -1), k, v), ValueError, "batch sizes differ"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), ValueError, "head_dim 32 is not supported"),
        (lambda q, k, v: (q, k, "v"), TypeError, "v must be a torch.Tensor"),
    ],
)
def test_bad_tensors(mutate, error, message):
    with pytest.raises(error, match=message):
        fp8_attention(*mutate(*_qkv()))


def test_devices_must_match():
    q, k, v = _qkv()
    meta_k = k.to("meta")
    with pytest.raises(ValueError, match="must be on one device"):
        fp8_attention(q, meta_k, v)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"scale": -1.0}, ValueError, "scale must be a positive finite number"),
        ({"scale": float("nan")}, ValueError, "scale must be a positive finite number"),
        ({"window": 0}, ValueError, "window must be a positive int"),
        ({"window": 2.5}, ValueError, "window must be a positive int"),
        ({"config": {"delta": "matched"}}, TypeError, "config must be an FP8AttentionConfig"),
    ],
)
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        fp8_attention(*_qkv(), **kwargs)


def test_causal_needs_q_len_at_most_kv_len():
    q, k, v, _ = make_qkv(sq=20, sk=10)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        fp8_attention(q, k, v, causal=True)
    assert fp8_attention(q, k, v).shape == q.shape  # non-causal cross attention is fine


@pytest.mark.parametrize(
    "cu_q, cu_k, message",
    [
        ([0, 8, 16], None, "pass both cu_seqlens_q and cu_seqlens_k"),
        ([1, 8, 16], [0, 8, 16], "cu_seqlens_q must start at 0"),
        ([0, 9, 8], [0, 8, 16], "non-decreasing"),
        ([0, 8, 17], [0, 8, 16], "end at most at the token count 16"),
        ([0, 16], [0, 8, 16], "same number of sequences"),
        ([0], [0], "needs at least 2 entries"),
    ],
)
def test_bad_cu_seqlens(cu_q, cu_k, message):
    q, k, v = _qkv()
    as_t = lambda c: None if c is None else torch.tensor(c, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=message):
        fp8_attention(q, k, v, cu_seqlens_q=as_t(cu_q), cu_seqlens_k=as_t(cu_k))


def test_cu_seqlens_checked_again_after_an_in_place_write():
    # The checks of a pair of cu_seqlens tensors are cached on their identity (once per model
    # forward); writing into them must trigger the checks again.
    q, k, v = _qkv()
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    fp8_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    cu[1] = 17
    with pytest.raises(ValueError, match="non-decreasing"):
        fp8_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_varlen_max_lengths_read_or_given():
    from hf_fp8_attention.masking import MaskSpec, varlen_max_lengths

    cu_q, cu_k = torch.tensor([0, 3, 3, 10]), torch.tensor([0, 5, 6, 9])
    assert varlen_max_lengths(MaskSpec(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)) == (7, 5)
    given = MaskSpec(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=5)
    assert varlen_max_lengths(given) == (7, 5)
    empty = torch.tensor([0])
    assert varlen_max_lengths(MaskSpec(cu_seqlens_q=empty, cu_seqlens_k=empty)) == (0, 0)


def test_cu_seqlens_need_int_tensors_and_batch_one():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-D int32/int64 tensor"):
        fp8_attention(q, k, v, cu_seqlens_q=torch.tensor([0.0, 16.0]), cu_seqlens_k=torch.tensor([0, 16]))
    q2, k2, v2 = make_qkv(b=2, sq=16)[:3]
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="batch size 1"):
        fp8_attention(q2, k2, v2, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_forced_triton_backend_on_cpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="sdpa"):
        fp8_attention(*_qkv(), config=FP8AttentionConfig(backend="triton"))


def test_varlen_compiles_without_graph_breaks():
    # The host-side value checks of cu_seqlens run in eager calls only; a compiled call must trace
    # through to the custom op (fullgraph=True fails on any graph break) and give the same result.
    q, k, v, dout = make_qkv(sq=40, dtype=torch.float32, seed=21)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)

    def attend(q, k, v, cu):
        return fp8_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)

    compiled = torch.compile(attend, fullgraph=True)
    assert torch.equal(compiled(q, k, v, cu), attend(q, k, v, cu))


def test_compiled_call_carries_the_given_max_lengths(monkeypatch):
    # Under torch.compile the host cannot read cu_seqlens; lengths the caller passes reach the
    # implementation through the custom op's max_seqlen_q / max_seqlen_k arguments.
    from hf_fp8_attention import ops

    q, k, v, _ = make_qkv(sq=40, dtype=torch.float32, seed=22)
    cu = torch.tensor([0, 15, 40], dtype=torch.int64)  # cast to int32 once, by fp8_attention
    seen = []
    run_forward = ops.run_forward

    def spy(q, k, v, scale, mask, config, *mods, **kwargs):
        seen.append((mask.max_seqlen_q, mask.max_seqlen_k, mask.cu_seqlens_q.dtype))
        return run_forward(q, k, v, scale, mask, config, *mods, **kwargs)

    monkeypatch.setattr(ops, "run_forward", spy)

    def attend(q, k, v, cu):
        return fp8_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=25, max_seqlen_k=25)

    compiled = torch.compile(attend, fullgraph=True)
    out = compiled(q, k, v, cu)
    assert seen[-1] == (25, 25, torch.int32)
    assert torch.equal(out, attend(q, k, v, cu))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fp8_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=-2)
