"""Several tiles per quantization program (``quantize.ROTATED_LAUNCH["tiles"]`` and
``QUANT_LAUNCH["tiles"]``), under the Triton interpreter: every copy the recipes make (rotated,
smoothed, per token or per head; channel scales per tile, per sequence or per head) comes out with
the same codes and scales, bit for bit, as with one tile per program, dense and packed (an empty
sequence, lengths that end inside a tile and inside a program's last tiles). The same for the
channel-wise copy's prefetched slices (the launch tables' ``col_prefetch``)."""
import pytest
import torch

from helpers import make_qkv
from hf_fp8_attention import RECIPES
from hf_fp8_attention.kernels import quantize
from hf_fp8_attention.kernels.forward import _quantizes_q_first
from hf_fp8_attention.kernels.operands import backward_kv_copies, backward_q_copies, copies_for, stats_for
from hf_fp8_attention.kernels.quantize import interpreting, quantize_operands

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")

BLOCK = 16  # tokens per tile: 33 tokens are 3 tiles (the last one of 1 token); packed: 9 and 24 tokens


def _launches(config):
    """Each quantization launch of a fwd+bwd: (role names, Copies per operand), as forward.py and
    backward.py issue them."""
    out = [(("k", "v"), (copies_for("k", config, row=True, col=False), copies_for("v", config, row=False, col=True))),
           (("q", "do"), (backward_q_copies(config), copies_for("do", config, row=True, col=True))),
           (("k", "v"), backward_kv_copies(config))]
    if _quantizes_q_first(config):
        out.append((("q",), (copies_for("q", config, row=True, col=False),)))
    return out


def _all_copies(tensors, config, cu, max_len, stats: list):
    """Every copy of :func:`_launches`, flattened; ``stats``: each launch's sequence statistics,
    computed on the first call (they do not depend on the quantization launch's table)."""
    results = []
    for i, (roles, copies) in enumerate(_launches(config)):
        xs = tuple(tensors[r] for r in roles)
        if len(stats) == i:
            stats.append(stats_for(xs, copies, cu, max_len))
        for out in quantize_operands(xs, copies, block=BLOCK, cu_seqlens=cu, max_seqlen=max_len, stats=stats[i]):
            results.extend(t for t in out if t is not None)
    return results


def _valid(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bytes where an FP8 copy (one byte per element) is compared."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


# The rotated recipes' statistics take most of the interpreter's time: their packed batches, which
# also cover a program's second tile past a sequence's end, and the tile recipe's dense one.
@pytest.mark.parametrize("recipe, packed", [("fp8_delta", True), ("fp8_delta_fast", True), ("fp8_delta_tile", False)])
def test_tiles_per_program_change_no_bit(recipe, packed, monkeypatch):
    """Two tiles per program over three tiles (dense: the second program's second tile is past the
    end) or over sequences of one and two tiles (packed, every token in a sequence)."""
    config = RECIPES[recipe].replace(backend="triton", block_q=BLOCK, block_k=BLOCK)
    q, k, v, dout = make_qkv(1, 1, 1, 33, d=64, dtype=torch.bfloat16, seed=3, outliers=True)
    tensors = {"q": q, "k": k, "v": v, "do": dout}
    cu = torch.tensor([0, 9, 9, 33], dtype=torch.int32) if packed else None
    max_len = 24 if packed else None
    stats = []
    for table in ("ROTATED_LAUNCH", "QUANT_LAUNCH"):
        monkeypatch.setattr(quantize, table, {**getattr(quantize, table), "tiles": None})
    want = _all_copies(tensors, config, cu, max_len, stats)
    for table in ("ROTATED_LAUNCH", "QUANT_LAUNCH"):
        monkeypatch.setattr(quantize, table, {**getattr(quantize, table), "tiles": 2})
    grids = []
    launch = quantize.launch_kernel

    def spy(kernel, grid, *args, **kwargs):
        grids.append((grid[0], kwargs["TILES"]))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(quantize, "launch_kernel", spy)
    got = _all_copies(tensors, config, cu, max_len, stats)
    assert grids and all(g == (1 if packed else 2, 2) for g in grids)  # 2 tiles a program: 2 (or 1) programs
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(_valid(a), _valid(b)), i


@pytest.mark.parametrize("recipe, tiles", [("fp8_delta", 2), ("fp8_delta_fast", 1), ("fp8_delta_tile", 2)])
def test_prefetched_channel_slices_change_no_bit(recipe, tiles, monkeypatch):
    """``col_prefetch``: each channel-wise slice loaded before the previous one is stored, over a
    program's tiles (channel scales per sequence, per head and per tile by the three recipes; 33
    tokens: the last program's second tile is past the end), gives the plain loop's codes and
    scales. Packed batches keep the plain loop (the prefetch spills there)."""
    config = RECIPES[recipe].replace(backend="triton", block_q=BLOCK, block_k=BLOCK)
    q, k, v, dout = make_qkv(1, 1, 1, 33, d=64, dtype=torch.bfloat16, seed=5, outliers=True)
    tensors = {"q": q, "k": k, "v": v, "do": dout}
    stats, flags = [], []
    launch = quantize.launch_kernel

    def spy(kernel, grid, *args, **kwargs):
        flags.append(kwargs["COL_PREFETCH"])
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(quantize, "launch_kernel", spy)
    for prefetch in (None, True):
        for table in ("ROTATED_LAUNCH", "QUANT_LAUNCH"):
            monkeypatch.setattr(quantize, table, {**getattr(quantize, table), "tiles": tiles,
                                                  "col_prefetch": prefetch})
        got = _all_copies(tensors, config, None, None, stats)
        if prefetch is None:
            want = got
    assert flags and not any(flags[:len(flags) // 2]) and all(flags[len(flags) // 2:])
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(_valid(a), _valid(b)), i
    packed = quantize.plan_quantize((v,), (quantize.Copies(row=False, col=True),), block=BLOCK,
                                    cu_seqlens=torch.tensor([0, 9, 33], dtype=torch.int32), max_seqlen=24)
    assert packed.meta["COL_PREFETCH"] is False


def _pv_positions(n: int) -> torch.Tensor:
    """Position of each of ``n`` tokens in the P·V order, derived from the two wgmma layouts: in
    each aligned 16 the accumulator gives thread q of a quad the columns 8i + 2q + b, and an FP8 A
    operand takes the columns 4q + 2i + b."""
    pos = torch.empty(n, dtype=torch.long)
    for g in range(n // 16):
        for i in range(2):
            for q in range(4):
                for b in range(2):
                    pos[16 * g + 8 * i + 2 * q + b] = 16 * g + 4 * q + 2 * i + b
    return pos


@pytest.mark.parametrize("prefetch", [None, True])
def test_pv_order_moves_tokens_only(prefetch, monkeypatch):
    """``Copies.col_pv``: the channel-wise copy holds each token's codes at its P·V position (two
    tiles of 16 in one program, the last program's second tile past the end; the plain and the
    prefetched loop), the scales unchanged; the row-wise copy beside it is untouched."""
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=BLOCK, block_k=BLOCK)
    _, k, v, _ = make_qkv(1, 1, 1, 48, d=64, dtype=torch.bfloat16, seed=7, outliers=True)
    monkeypatch.setattr(quantize, "ROTATED_LAUNCH", {**quantize.ROTATED_LAUNCH, "tiles": 2, "col_prefetch": prefetch})
    monkeypatch.setattr(quantize, "QUANT_LAUNCH", {**quantize.QUANT_LAUNCH, "tiles": 2, "col_prefetch": prefetch})
    plain = (copies_for("k", config, row=True, col=False), copies_for("v", config, row=True, col=True))
    ordered = (plain[0], plain[1]._replace(col_pv=True))
    stats = stats_for((k, v), plain, None, None)
    want = quantize_operands((k, v), plain, block=BLOCK, stats=stats)
    got = quantize_operands((k, v), ordered, block=BLOCK, stats=stats)
    for a, b in zip(got[0][:4] + got[1][:2] + got[1][3:4], want[0][:4] + want[1][:2] + want[1][3:4]):
        assert (a is None and b is None) or torch.equal(_valid(a), _valid(b))
    natural, moved = _valid(want[1][2]), _valid(got[1][2])  # (1, 1, 64, 48)
    assert not torch.equal(moved, natural)
    assert torch.equal(moved[..., _pv_positions(48)], natural)


def test_pv_order_refuses_packed_and_ragged_lengths():
    """The P·V order permutes aligned groups of 16 tokens: a packed batch, or a length that ends
    inside a group, is refused with a message naming the option."""
    col = quantize.Copies(row=False, col=True, col_pv=True)
    _, _, v, _ = make_qkv(1, 1, 1, 33, d=64, dtype=torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="col_pv.*33 tokens"):
        quantize.plan_quantize((v,), (col,), block=BLOCK)
    with pytest.raises(ValueError, match="col_pv.*packed batch"):
        quantize.plan_quantize((v[:, :, :32],), (col,), block=BLOCK,
                               cu_seqlens=torch.tensor([0, 16, 32], dtype=torch.int32), max_seqlen=16)
