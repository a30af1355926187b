"""The backward reuses the sequence statistics its forward computed (``for_backward`` /
``kv_stats`` for K and V, ``q_stats`` for Q where the forward computes Q's anyway), and with
``forward.HAND_OVER_KV_COPIES`` K's and V's copies (``kv_copies``), under the Triton interpreter:
the same gradients bit for bit as when the backward computes them itself, the forward's outputs
unchanged, and fewer statistics reads and copies."""
import pytest
import torch

from helpers import make_qkv
from hf_fp8_attention import RECIPES, fp8_attention
from hf_fp8_attention.kernels import operands
from hf_fp8_attention.kernels.backward import triton_backward
from hf_fp8_attention.kernels.forward import triton_forward
from hf_fp8_attention.kernels.quantize import interpreting
from hf_fp8_attention.masking import MaskSpec

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")


def _mask(packed: bool) -> MaskSpec:
    if not packed:
        return MaskSpec(causal=True)
    cu = torch.tensor([0, 15, 15, 40], dtype=torch.int32)
    return MaskSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=25, max_seqlen_k=25)


# fp8_delta, packed (one sequence empty): K's channel amax joins the forward's K statistics; the
# fast recipe: K's and V's per-head amax as well (V's beside its channel amax).
@pytest.mark.parametrize("recipe, packed", [("fp8_delta", True), ("fp8_delta_fast", False), ("fp8_delta_fast", True)])
def test_reused_statistics_give_the_same_gradients(recipe, packed):
    config = RECIPES[recipe].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = make_qkv(1, 2, 1, 40, d=64, dtype=torch.float32, seed=5, outliers=True)
    mask, scale = _mask(packed), 0.125
    kept = {}
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16, for_backward=kept)
    out0, lse0 = triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)  # the extra statistics change no forward code
    # Q's statistics only where the forward computes them for its own copy (one Q scale per head)
    assert set(kept) == ({"kv_stats", "q_stats"} if "fast" in recipe else {"kv_stats"})
    assert any(st is not None for st in kept["kv_stats"])
    reused = triton_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config, kv_stats=kept["kv_stats"],
                             q_stats=kept.get("q_stats"))
    fresh = triton_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config)
    for name, a, b in zip(("dq", "dk", "dv"), reused, fresh):
        assert torch.equal(a, b), name


@pytest.fixture
def host_side_only(monkeypatch):
    """Every kernel launch stubbed (only the host side runs) and the ops on the Triton kernels for
    CPU tensors: what a call through autograd launches is counted without running it."""
    import triton.runtime.interpreter as interpreter

    from hf_fp8_attention import ops
    from hf_fp8_attention.config import Backend

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", lambda self, *a, grid=None, **kw: None)
    monkeypatch.setattr(ops, "select_backend", lambda device, config: Backend.TRITON)


def test_autograd_hands_the_statistics_over(host_side_only, monkeypatch):
    """Counted with every kernel stubbed (only the host side runs): the statistics calls of a
    fwd+bwd, and of a forward without gradients."""
    calls = []
    stats = operands.sequence_stats
    monkeypatch.setattr(operands, "sequence_stats", lambda xs, *a, **kw: calls.append(len(xs)) or stats(xs, *a, **kw))
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(make_qkv(1, 2, 2, 40, d=64, dtype=torch.float32)))
    out = fp8_attention(q, k, v, causal=True, config=config)
    assert calls == [2]  # (K, V) for the forward and the backward at once
    out.backward(dout)
    assert calls == [2, 2]  # the backward's (Q, dO) only
    with torch.no_grad():
        fp8_attention(q, k, v, causal=True, config=config)
    assert calls == [2, 2, 2]


@pytest.mark.parametrize("beside", [True, False], ids=["beside_kv", "own_launch"])
def test_autograd_hands_the_query_statistics_over(host_side_only, monkeypatch, beside):
    """The fast recipe (one Q scale per head): the forward's statistics read Q, in the K/V launch
    (``forward.Q_STATS_BESIDE_KV``) or in one of their own; the backward's read dO alone (kernels
    stubbed, as above)."""
    from hf_fp8_attention.kernels import forward

    monkeypatch.setattr(forward, "Q_STATS_BESIDE_KV", beside)
    calls = []
    stats = operands.sequence_stats
    monkeypatch.setattr(operands, "sequence_stats", lambda xs, *a, **kw: calls.append(xs) or stats(xs, *a, **kw))
    config = RECIPES["fp8_delta_fast"].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(make_qkv(1, 4, 2, 40, d=64, dtype=torch.float32)))
    out = fp8_attention(q, k, v, causal=True, config=config)
    if beside:
        assert [len(xs) for xs in calls] == [3] and calls[0][2] is q  # (K, V, Q) in one launch
    else:
        assert [len(xs) for xs in calls] == [2, 1] and calls[1][0] is q  # (K, V), then Q
    out.backward(dout)
    assert len(calls[-1]) == 1 and calls[-1][0] is dout


# Q's statistics beside K's and V's (forward.Q_STATS_BESIDE_KV) against a launch of their own: the
# same forward and gradients bit for bit, grouped-query heads, dense and packed (one sequence empty).
@pytest.mark.parametrize("recipe, packed", [("fp8_delta_fast", False), ("fp8_delta_fast", True),
                                            ("fp8_stale_fast", False)])
def test_query_statistics_beside_kv_give_the_same_bits(recipe, packed, monkeypatch):
    from hf_fp8_attention.kernels import forward

    config = RECIPES[recipe].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = make_qkv(1, 4, 2, 40, d=64, dtype=torch.float32, seed=7, outliers=True)
    mask, scale = _mask(packed), 0.125
    assert forward.q_stats_beside_kv(q, k, mask)
    results = []
    for beside in (True, False):
        monkeypatch.setattr(forward, "Q_STATS_BESIDE_KV", beside)
        kept = {}
        out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16, for_backward=kept)
        grads = triton_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config,
                                kv_stats=kept["kv_stats"], q_stats=kept["q_stats"])
        results.append((out, lse, *kept["q_stats"], *grads))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_query_statistics_share_the_launch_only_on_one_token_axis():
    """Q beside K and V needs one token axis: not for a shorter Q (decoding), nor for packed
    batches whose Q and K offsets are different tensors (equal values would need a device read)."""
    from hf_fp8_attention.kernels.forward import q_stats_beside_kv

    q, k = torch.zeros(1, 4, 40, 64), torch.zeros(1, 2, 40, 64)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    assert q_stats_beside_kv(q, k, MaskSpec(causal=True))
    assert not q_stats_beside_kv(q[:, :, :1], k, MaskSpec(causal=True))
    assert not q_stats_beside_kv(q.half(), k, MaskSpec(causal=True))
    assert q_stats_beside_kv(q, k, MaskSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu))
    assert not q_stats_beside_kv(q, k, MaskSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu.clone()))


def _count_backward_prep(monkeypatch) -> list:
    """Patches the backward's quantization entry points to record the operands of each call."""
    from hf_fp8_attention.kernels import backward

    calls = []
    for name in ("quantize_operands", "stats_then_copies"):
        fn = getattr(backward, name)
        monkeypatch.setattr(backward, name, lambda xs, *a, _fn=fn, **kw: calls.append(xs) or _fn(xs, *a, **kw))
    return calls


# The backward's K/V copies made by the forward's launch (forward.HAND_OVER_KV_COPIES): K row-wise and
# channel-wise, V row-wise, from the same statistics; dense and packed (one sequence empty), GQA.
@pytest.mark.parametrize("recipe, packed", [("fp8_delta", True), ("fp8_delta_fast", False)])
def test_handed_over_copies_give_the_same_gradients(recipe, packed, monkeypatch):
    from hf_fp8_attention.kernels import forward

    config = RECIPES[recipe].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = make_qkv(1, 2, 1, 40, d=64, dtype=torch.float32, seed=5, outliers=True)
    mask, scale = _mask(packed), 0.125
    out0, lse0 = triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16)
    fresh = triton_backward(q, k, v, out0, lse0, dout, scale=scale, mask=mask, config=config)
    monkeypatch.setattr(forward, "HAND_OVER_KV_COPIES", True)
    kept = {}
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16, for_backward=kept)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)  # the extra copies change no forward code
    handed = kept["kv_copies"]
    assert len(handed) == 1
    calls = _count_backward_prep(monkeypatch)
    reused = triton_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config,
                             kv_stats=kept["kv_stats"], q_stats=kept.get("q_stats"), kv_copies=handed)
    assert handed == []  # taken out, so that each copy is freed after its last reader
    assert [len(xs) for xs in calls] == [2] and calls[0][0] is q  # Q and dO only: no K/V copies made here
    for name, a, b in zip(("dq", "dk", "dv"), reused, fresh):
        assert torch.equal(a, b), name


def test_no_copies_are_handed_over_to_a_chunked_backward(monkeypatch):
    """Chunks bound the backward's peak by keeping one chunk's copies live: the forward hands none
    over where the backward will be chunked; a backward given copies (its forward saw one pass) runs
    one pass on them whatever the chunk settings say now (its caller may have kept no K and V)."""
    from hf_fp8_attention.kernels import backward, forward

    monkeypatch.setattr(forward, "HAND_OVER_KV_COPIES", True)
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = make_qkv(2, 2, 1, 40, d=64, dtype=torch.float32, seed=6)
    mask, scale = MaskSpec(causal=True), 0.125
    kept = {}
    triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16, for_backward=kept)
    assert "kv_copies" in kept  # one pass: handed over
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks", 2)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunk_min_elements", 0)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks_below_peak", False)
    assert not backward.takes_kv_copies(q, k, mask, config)
    chunked = {}
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16, for_backward=chunked)
    assert "kv_copies" not in chunked
    handed = kept["kv_copies"]
    calls = _count_backward_prep(monkeypatch)
    one_pass = triton_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config,
                               kv_stats=kept["kv_stats"], kv_copies=handed)
    assert handed == []
    assert [len(xs) for xs in calls] == [2] and calls[0][0] is q  # one (Q, dO) launch: not chunked
    own = triton_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config)
    assert len(calls) == 1 + 2 * 2  # chunked: (Q, dO) and (K, V) per chunk
    for name, a, b in zip(("dq", "dk", "dv"), one_pass, own):
        assert torch.equal(a, b), name


def test_autograd_hands_the_copies_over(host_side_only, monkeypatch):
    """Through autograd (kernels stubbed, as above): with the switch on the backward makes copies of
    Q and dO only; a forward without gradients makes none for a backward."""
    from hf_fp8_attention.kernels import forward

    monkeypatch.setattr(forward, "HAND_OVER_KV_COPIES", True)
    handed = []
    hand_over = forward.takes_kv_copies
    monkeypatch.setattr(forward, "takes_kv_copies", lambda *a: handed.append(hand_over(*a)) or handed[-1])
    calls = _count_backward_prep(monkeypatch)
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(make_qkv(1, 2, 2, 40, d=64, dtype=torch.float32)))
    out = fp8_attention(q, k, v, causal=True, config=config)
    assert handed == [True]
    out.backward(dout)
    assert len(calls) == 1 and calls[0][0] is q  # (Q, dO); K and V came from the forward
    with torch.no_grad():
        fp8_attention(q, k, v, causal=True, config=config)
    assert handed == [True]  # no backward ahead: not even asked
