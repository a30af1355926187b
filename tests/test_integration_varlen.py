"""The padded/packed -> varlen planning behind the Transformers backend (integration/varlen.py).

Checked in float64 with the exact reference: attention computed on the packed varlen batch and
scattered back must equal attention on the padded batch with the per-position mask Transformers
would build (causal, padding, packed segments), for every valid query. Float64 on both sides, so
the only differences are summation order: 1e-10 is far above that (~1e-15) and far below any
masking mistake (which changes outputs at O(1)).
"""
import pytest
import torch

from hf_fp8_attention.exact import exact_attention
from hf_fp8_attention.integration.varlen import pack, plan_varlen, unpack
from hf_fp8_attention.masking import MaskSpec

TOL = 1e-10


def _dense_reference(q, k, v, valid, segments, window=None):
    """Padded-layout attention with Transformers' per-position rules; (B, Sq, H, D), 0 for padded queries."""
    b, h, sq, d = q.shape
    sk = k.shape[2]
    pos_q = torch.arange(sq)[:, None] + (sk - sq)
    pos_k = torch.arange(sk)[None, :]
    out = torch.zeros(b, sq, h, d, dtype=torch.float64)
    for r in range(b):
        allowed = (pos_k <= pos_q) & valid[r][None, :] & valid[r][pos_q]
        allowed &= segments[r][None, :] == segments[r][pos_q]
        if window is not None:
            allowed &= (pos_q - pos_k) < window
        logits = (q[r] @ k[r].transpose(-1, -2)) * d**-0.5
        logits = logits.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no key (padded queries) -> 0
        out[r] = (p @ v[r]).transpose(0, 1)
    return out


def _varlen(q, k, v, valid, segments, window=None):
    plan = plan_varlen(valid, q.shape[2], segments)
    mask = MaskSpec(causal=True, window=window, cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k)
    out = exact_attention(pack(q, plan.idx_q), pack(k, plan.idx_k), pack(v, plan.idx_k), mask=mask)
    return unpack(out, plan.idx_q, q.shape[0], q.shape[2]), plan


def _qkv(b, sq, sk, h=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, sk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, sk, d, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize(
    "rows",
    [
        ["1111100", "1111111"],  # right padding
        ["0011111", "1111111"],  # left padding
        ["0000000", "0111110"],  # a fully padded row and padding on both sides
        ["1101101", "1111111"],  # holes (a custom 2D mask): causal order still holds
    ],
)
def test_padding_matches_dense_masking(rows):
    valid = torch.tensor([[c == "1" for c in r] for r in rows])
    q, k, v = _qkv(len(rows), 7, 7)
    segments = torch.zeros(valid.shape, dtype=torch.long)
    got, plan = _varlen(q, k, v, valid, segments)
    want = _dense_reference(q, k, v, valid, segments)
    assert torch.allclose(got, want, atol=TOL, rtol=0)
    assert plan.has_holes == any("10" in r.strip("0") for r in rows)
    assert not got[~valid].any(), "padded queries must output exactly 0"


@pytest.mark.parametrize("q_len", [1, 3])
def test_decode_with_left_padding(q_len):
    """KV-cache decode: queries are the last q_len positions; causal alignment per row holds."""
    valid = torch.tensor([[c == "1" for c in r] for r in ["000111111", "111111111", "001111111"]])
    q, k, v = _qkv(3, q_len, 9)
    segments = torch.zeros(valid.shape, dtype=torch.long)
    got, _ = _varlen(q, k, v, valid, segments)
    assert torch.allclose(got, _dense_reference(q, k, v, valid, segments), atol=TOL, rtol=0)


def test_packed_segments_and_window():
    """Two rows, each packing several sequences (segment ids as Transformers derives them), plus padding."""
    valid = torch.tensor([[True] * 10, [True] * 8 + [False] * 2])
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 2, 3]])
    q, k, v = _qkv(2, 10, 10, seed=1)
    for window in (None, 2):
        got, plan = _varlen(q, k, v, valid, segments, window)
        assert torch.allclose(got, _dense_reference(q, k, v, valid, segments, window), atol=TOL, rtol=0)
    assert plan.cu_seqlens_q.tolist() == [0, 3, 7, 10, 15, 18]
    assert plan.cu_seqlens_q.dtype == torch.int32


def test_unpack_gradient_reaches_valid_tokens_only():
    valid = torch.tensor([[False, True, True], [True, True, False]])
    plan = plan_varlen(valid, 3)
    x = torch.randn(2, 2, 3, 4, requires_grad=True)
    y = unpack(pack(x, plan.idx_q), plan.idx_q, 2, 3)  # (B, S, H, D)
    assert torch.equal(y.transpose(1, 2)[valid[:, None, :].expand(-1, 2, -1)], x.detach()[valid[:, None, :].expand(-1, 2, -1)])
    y.sum().backward()
    assert torch.equal(x.grad.transpose(1, 2)[~valid], torch.zeros(2, 2, 4))
    assert torch.equal(x.grad.transpose(1, 2)[valid], torch.ones(4, 2, 4))


def test_bad_arguments():
    with pytest.raises(ValueError, match="bool"):
        plan_varlen(torch.ones(2, 3), 3)
    with pytest.raises(ValueError, match="q_len"):
        plan_varlen(torch.ones(2, 3, dtype=torch.bool), 4)


def _bools(*rows):
    return torch.tensor([[c == "1" for c in r] for r in rows])


@pytest.mark.parametrize("positions", [
    [[0, 1, 2, 3, 4, 5]],                      # one sequence, broadcast over the batch below
    [[0, 1, 2, 0, 1, 0]],                      # packed, broadcast
    [[0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 2, 3]],  # one row packed
    [[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]],  # offsets without a restart
])
def test_segments_of_an_unmasked_batch_read_the_device_once(positions):
    """With every token valid (no padding mask) the check takes the tokens' indices without
    ``nonzero``: one host read (``.any()``) instead of two, and the same segments as an all-True mask."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_fp8_attention.integration.varlen import segments_from_positions

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.nonzero.default, torch.ops.aten._local_scalar_dense.default):
                self.ops.append(func)
            return func(*args, **(kwargs or {}))

    pos, batch = torch.tensor(positions), 2
    want = segments_from_positions(pos, torch.ones(batch, pos.shape[1], dtype=torch.bool))
    with HostReads() as reads:
        got = segments_from_positions(pos, None, batch=batch)
    assert reads.ops == [torch.ops.aten._local_scalar_dense.default]
    assert (got is None) == (want is None)
    if got is not None:
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="give valid, or batch"):
        segments_from_positions(pos, None)


def test_segments_ignore_padding_positions():
    from hf_fp8_attention.integration.varlen import segments_from_positions

    # Left padding as generate() builds it (padding at position 1), and a hole the positions skip.
    assert segments_from_positions(torch.tensor([[1, 1, 0, 1, 2]]), _bools("00111")) is None
    assert segments_from_positions(torch.tensor([[0, 1, 1, 2]]), _bools("1101")) is None
    # Arange positions broadcast over a batch: one sequence per row.
    assert segments_from_positions(torch.arange(6)[None], _bools("111111", "111100")) is None
    # Packed + right padding: restarts among valid tokens split; the padding does not matter.
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 3, 4, 5, 6]])
    valid = _bools("1111100", "1111111")
    segments = segments_from_positions(pos, valid)
    plan = plan_varlen(valid, 7, segments)
    assert plan.cu_seqlens_q.tolist() == plan.cu_seqlens_k.tolist() == [0, 3, 5, 12]
