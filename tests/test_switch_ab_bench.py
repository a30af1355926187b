"""benchmarks/switch_ab.py on a machine without a GPU: it names the switches it flips and fixes as
modules' booleans, refuses anything else by name, and refuses to run without a GPU, leaving every
switch as it found it; persistent_backward_bits.py refuses the same way."""
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
    import switch_ab
    from hf_fp8_attention.kernels import backward_dq_gluon, forward_gluon

    before = forward_gluon.PERSISTENT, backward_dq_gluon.PERSISTENT
    with pytest.raises(SystemExit) as stop:
        switch_ab.main(["--switch", "forward_gluon.PERSISTENT+backward_dq_gluon.PERSISTENT", "--seqlens", "256"])
    assert stop.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert (forward_gluon.PERSISTENT, backward_dq_gluon.PERSISTENT) == before


def test_switches_are_booleans_of_kernel_modules():
    pytest.importorskip("triton")
    import switch_ab
    from hf_fp8_attention.kernels import backward_stats_gluon, forward_gluon

    assert switch_ab.switches("forward_gluon.PERSISTENT+backward_stats_gluon.PERSISTENT") == [
        (forward_gluon, "PERSISTENT"), (backward_stats_gluon, "PERSISTENT")]
    assert switch_ab.fixed("forward_gluon.QUANTIZE_Q_NONCAUSAL=1,forward_gluon.QUANTIZE_Q=0") == {
        (forward_gluon, "QUANTIZE_Q_NONCAUSAL"): True, (forward_gluon, "QUANTIZE_Q"): False}
    for bad in ("forward_gluon.STAGES", "no_such_module.PERSISTENT", "forward_gluon.NO_SUCH"):
        with pytest.raises(SystemExit, match=bad):
            switch_ab.switches(bad)
    with pytest.raises(SystemExit, match="QUANTIZE_Q=yes"):
        switch_ab.fixed("forward_gluon.QUANTIZE_Q=yes")


def test_persistent_backward_bits_needs_a_gpu(capsys):
    """benchmarks/persistent_backward_bits.py refuses without a GPU, leaving the switches it sets."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    import persistent_backward_bits
    from hf_fp8_attention.kernels import backward_stats_gluon

    before = backward_stats_gluon.PERSISTENT
    assert persistent_backward_bits.main() == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert backward_stats_gluon.PERSISTENT is before


def test_fwdbwd_saved_is_the_autograd_path():
    """``--op fwdbwd_saved`` calls ops.run_forward / run_backward with the forward's hand-over (here
    on the emulation, where nothing is handed over): the same outputs and gradients."""
    pytest.importorskip("triton")
    import switch_ab
    from helpers import make_qkv
    from hf_fp8_attention import RECIPES, ops
    from hf_fp8_attention.masking import MaskSpec

    q, k, v, do = make_qkv(1, 2, 1, 48, d=32, dtype=torch.float32, seed=2)
    config = RECIPES["fp8_delta"].replace(backend="emulation")
    got = switch_ab._op("fwdbwd_saved", q, k, v, do, True, config)()
    mask, scale = MaskSpec(causal=True), 32 ** -0.5
    out, lse = ops.run_forward(q, k, v, scale, mask, config)
    want = (out, lse) + tuple(ops.run_backward(q, k, v, out, lse, do, scale, mask, config))
    assert len(got) == 5 and all(torch.equal(a, b) for a, b in zip(got, want))
