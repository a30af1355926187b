"""The quantization launch's plan (host side only): where the channel-wise copies divide by FMAs."""
import pytest
import torch

from hf_fp8_attention.config import RECIPES
from hf_fp8_attention.kernels import operands
from hf_fp8_attention.kernels import quantize
from hf_fp8_attention.kernels.sequence_stats import SequenceStats


def _stats(n_seq: int, heads: int, dp: int) -> SequenceStats:
    """Statistics of the right shapes (the plan only passes them on)."""
    return SequenceStats(torch.zeros(n_seq, heads, dp), torch.ones(n_seq, heads), torch.ones(n_seq, heads, dp))


@pytest.mark.parametrize("switch", [True, False])
def test_channel_copies_divide_by_fmas_in_dense_batches_only(monkeypatch, switch):
    """``COL_FMA_DIVISION`` reaches the dense launches; packed ones keep ``div.rn`` (the FMA form
    spilled there under the launch's register cap)."""
    monkeypatch.setattr(quantize, "COL_FMA_DIVISION", switch)
    config = RECIPES["fp8_delta"]
    copies = operands.backward_kv_copies(config)
    k, v = torch.randn(1, 2, 96, 64), torch.randn(1, 2, 96, 64)
    dense = quantize.plan_quantize((k, v), copies, block=config.block_k, stats=(_stats(1, 2, 64), ) * 2)
    packed = quantize.plan_quantize((k, v), copies, block=config.block_k, stats=(_stats(2, 2, 64), ) * 2,
                                    cu_seqlens=torch.tensor([0, 40, 96], dtype=torch.int32), max_seqlen=56)
    assert dense.meta["COL_FMA"] is switch
    assert packed.meta["COL_FMA"] is False


def test_tiles_per_program_keep_every_multiprocessor_busy(monkeypatch):
    """Several tiles a program only where each SM still gets ``TILES_MIN_PROGRAMS_PER_SM`` programs;
    off CUDA (the interpreter) the table's value."""
    monkeypatch.setattr(quantize, "sm_count", lambda index: 132)
    need = quantize.TILES_MIN_PROGRAMS_PER_SM * 132
    cuda = torch.device("cuda", 0)
    # 2 x 16 heads x 8k tokens, K and V: 64 tiles a row, 64 rows -> 2048 programs of 2 tiles
    assert 32 * 64 >= need and quantize.tiles_per_program(2, 64, 64, cuda) == 2
    # a small call: 16 tiles a row, 9 rows -> 72 programs of 2 tiles
    assert quantize.tiles_per_program(2, 16, 9, cuda) == 1
    # just at and just under the threshold
    assert quantize.tiles_per_program(2, 2, need, cuda) == 2
    assert quantize.tiles_per_program(2, 2, need - 1, cuda) == 1
    assert quantize.tiles_per_program(1, 64, 64, cuda) == 1
    assert quantize.tiles_per_program(2, 16, 9, torch.device("cpu")) == 2
    k = torch.randn(1, 2, 96, 64)  # 3 tiles of 32 tokens a row
    plain = quantize.plan_quantize((k,), (quantize.Copies(True, False),), block=32)
    rotated = quantize.plan_quantize((k,), (quantize.Copies(True, False, rotate=True),), block=32)
    assert (plain.meta["TILES"], plain.grid) == (1, (3, 2, 1))
    assert (rotated.meta["TILES"], rotated.grid) == (2, (2, 2, 1))
