"""Packed sequences' block offsets (``kernels.tiles.sequence_block_offsets``): their values, and
the cache that lets every layer of a model share one computation of them."""
import pytest
import torch

from hf_fp8_attention.kernels.tiles import sequence_block_offsets


def _expected(lengths, block):
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += -(-n // block)
    return out


@pytest.mark.parametrize("block", [64, 128, 256])
@pytest.mark.parametrize("lengths", [[1], [300, 0, 412, 64, 65], [0, 0], [128, 127, 129, 1000]])
def test_offsets_are_the_exclusive_sum_of_blocks_per_sequence(lengths, block):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    got = sequence_block_offsets(cu, block)
    assert got.dtype == torch.int32 and got.tolist() == _expected(lengths, block)


def test_offsets_are_reused_for_the_same_tensor_and_recomputed_after_a_write():
    cu = torch.tensor([0, 300, 700, 1024], dtype=torch.int32)
    first = sequence_block_offsets(cu, 128)
    assert sequence_block_offsets(cu, 128) is first  # every layer: one computation
    assert sequence_block_offsets(cu, 64).tolist() == _expected([300, 400, 324], 64)  # another block size
    cu[1] = 100  # in place: the version counter moves, the cache must not answer
    assert sequence_block_offsets(cu, 128).tolist() == _expected([100, 600, 324], 128)
    same_values = torch.tensor([0, 100, 700, 1024], dtype=torch.int32)
    assert sequence_block_offsets(same_values, 128).tolist() == _expected([100, 600, 324], 128)
