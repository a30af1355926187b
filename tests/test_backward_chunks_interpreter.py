"""The FP8 backward in chunks (``LAUNCH["backward_chunks"]``: batch rows, or kv heads with their
query heads when B = 1), under the Triton interpreter: every scale and statistic is per (sequence,
head), so the chunked gradients equal the one-pass ones bit for bit, with the forward's statistics
handed over, GQA, packed sequences, the stale delta and sinks."""
import pytest
import torch

from helpers import chunk_every_call, make_qkv
from hf_fp8_attention import RECIPES
from hf_fp8_attention.kernels import backward
from hf_fp8_attention.kernels.backward import triton_backward
from hf_fp8_attention.kernels.forward import triton_forward
from hf_fp8_attention.kernels.quantize import interpreting
from hf_fp8_attention.masking import MaskSpec

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")


def _packed() -> MaskSpec:
    cu = torch.tensor([0, 15, 15, 40], dtype=torch.int32)  # one sequence empty
    return MaskSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=25, max_seqlen_k=25)


# (recipe, batch rows, query heads, kv heads, packed, sinks, chunks, inputs in the (B, S, H, D)
# layout Transformers hands over, transposed): two batch-row chunks of unequal size; kv-head chunks
# with GQA and the forward's Q statistics (fast recipe); packed sequences with the stale delta
# (which reads O); sinks, whose gradient sums over batch rows and tokens, over batch-row and over
# kv-head chunks (packed); more chunks asked for than kv heads; strided inputs. As few heads as each
# case needs: the interpreter's time grows with the programs, and the equality with none of them.
CASES = [
    ("fp8_delta", 3, 2, 1, False, False, 2, False),
    ("fp8_delta_fast", 1, 6, 3, False, False, 2, False),
    ("fp8_stale", 1, 2, 2, True, False, 2, False),
    ("fp8_delta", 2, 2, 1, False, True, 2, False),
    ("fp8_delta", 1, 4, 2, True, True, 2, False),
    ("fp8_delta", 1, 2, 2, False, False, 4, False),
    ("fp8_delta_fast", 2, 4, 2, False, False, 2, True),
]


@pytest.mark.parametrize("recipe, b, hq, hkv, packed, with_sinks, chunks, transposed", CASES)
def test_chunked_backward_equals_one_pass(recipe, b, hq, hkv, packed, with_sinks, chunks, transposed, monkeypatch):
    config = RECIPES[recipe].replace(backend="triton", block_q=32, block_k=32)
    q, k, v, dout = make_qkv(b, hq, hkv, 40, d=64, dtype=torch.float32, seed=7, outliers=True)
    if transposed:  # the same values, strided as (B, S, H, D) memory seen as (B, H, S, D)
        q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
        assert not q.is_contiguous()
    mask, scale = (_packed() if packed else MaskSpec(causal=True)), 0.125
    sinks = torch.linspace(-1.0, 1.0, hq) if with_sinks else None
    kept = {}
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16, sinks=sinks,
                              for_backward=kept)
    kwargs = dict(scale=scale, mask=mask, config=config, sinks=sinks, kv_stats=kept.get("kv_stats"),
                  q_stats=kept.get("q_stats"))
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks", 1)
    one_pass = triton_backward(q, k, v, out, lse, dout, **kwargs)
    chunk_every_call(monkeypatch, chunks)
    n = len(backward._chunk_slices(q, k, mask, config))
    assert n == min(chunks, b if b > 1 and not packed else hkv)
    chunked = triton_backward(q, k, v, out, lse, dout, **kwargs)
    assert len(chunked) == len(one_pass)
    for name, a, c in zip(("dq", "dk", "dv", "dsinks"), chunked, one_pass):
        assert a.shape == c.shape and a.is_contiguous(), name
        assert torch.equal(a, c), name


def test_chunks_apply_to_the_pre_quantized_fp8_backward_only(monkeypatch):
    chunk_every_call(monkeypatch, 2)
    q, k, _, _ = make_qkv(2, 4, 2, 32, d=64, dtype=torch.float32)
    mask = MaskSpec(causal=True)
    assert len(backward._chunk_slices(q, k, mask, RECIPES["fp8_delta"])) == 2
    assert len(backward._chunk_slices(q, k, mask, RECIPES["hybrid_delta"])) == 1  # no FP8 copies to shrink
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks", 1)
    assert len(backward._chunk_slices(q, k, mask, RECIPES["fp8_delta"])) == 1


def test_even_ranges_cover_every_row_once():
    assert backward._even_ranges(3, 2) == [(0, 1), (1, 3)]
    assert backward._even_ranges(2, 4) == [(0, 1), (1, 2)]
    assert backward._even_ranges(16, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_chunks_only_from_the_size_threshold_on(monkeypatch):
    """The default table chunks large calls only: one pass below ``backward_chunk_min_elements``
    query elements, ``backward_chunks`` from it on (shapes only: meta tensors, no kernel runs)."""
    monkeypatch.setitem(backward.LAUNCH, "backward_chunk_min_elements", 1 << 24)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks", 2)
    config, mask = RECIPES["fp8_delta"], MaskSpec(causal=True)

    def chunks(b, hq, hkv, s, d=128):
        q = torch.empty(b, hq, s, d, device="meta")
        k = torch.empty(b, hkv, s, d, device="meta")
        return len(backward._chunk_slices(q, k, mask, config))

    assert chunks(1, 16, 8, 8192 - 128) == 1  # just below 2^24 query elements
    assert chunks(1, 16, 8, 8192) == 2  # kv-head chunks
    assert chunks(2, 16, 16, 8192) == 2  # batch-row chunks
    assert chunks(8, 32, 8, 256) == 1  # many short rows: below the threshold


class _CudaShaped:
    """Shape, size and a CUDA device, without a GPU: what ``_chunk_slices`` reads of a tensor."""

    def __init__(self, *shape, itemsize=2):
        self.shape, self.device, self._itemsize = torch.Size(shape), torch.device("cuda", 0), itemsize

    def numel(self):
        return self.shape.numel()

    def element_size(self):
        return self._itemsize


def test_chunks_only_where_one_pass_would_raise_the_peak(monkeypatch):
    """With ``backward_chunks_below_peak`` a large CUDA call runs one pass when its FP8 copies and
    gradients (4·|Q| + 3·|K| bytes, and |Q| + 2·|K| bf16 elements) fit under the peak of allocated
    memory so far, and in chunks when they would raise it (allocator counters stubbed)."""
    monkeypatch.setitem(backward.LAUNCH, "backward_chunk_min_elements", 1 << 24)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks", 2)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks_below_peak", True)
    config, mask = RECIPES["fp8_delta"], MaskSpec(causal=True)
    q, k = _CudaShaped(1, 16, 8192, 128), _CudaShaped(1, 8, 8192, 128)
    one_pass = 4 * (1 << 24) + 3 * (1 << 23) + 2 * (1 << 24) + 2 * 2 * (1 << 23)
    allocated = 1 << 30

    def counters(current, peak):  # the allocator's nested statistics, as torch.cuda returns them
        return lambda device=None: {"allocated_bytes": {"all": {"current": current, "peak": peak}}}

    for peak, expected in ((allocated + one_pass, 1), (allocated + one_pass - 1, 2)):
        monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", counters(allocated, peak))
        assert len(backward._chunk_slices(q, k, mask, config)) == expected, peak
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks_below_peak", False)  # by size alone
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", counters(allocated, 1 << 40))
    assert len(backward._chunk_slices(q, k, mask, config)) == 2
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks_below_peak", True)

    def no_stats(device=None):  # what a pluggable allocator without statistics does
        raise RuntimeError("the allocator does not yet support getDeviceStats")

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", no_stats)
    assert len(backward._chunk_slices(q, k, mask, config)) == 2  # by size, no error
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {})  # CUDA not initialised
    assert len(backward._chunk_slices(q, k, mask, config)) == 2  # by size, no error
