"""benchmarks/quantize_q_ab.py on a machine without a GPU: it refuses with a clear message and leaves
the switch it times as it found it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_needs_a_gpu(capsys):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    import quantize_q_ab
    from hf_fp8_attention.kernels import forward_gluon

    before = forward_gluon.QUANTIZE_Q
    with pytest.raises(SystemExit) as stop:
        quantize_q_ab.main(["--seqlens", "256"])
    assert stop.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert forward_gluon.QUANTIZE_Q is before
