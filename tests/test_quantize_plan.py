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
