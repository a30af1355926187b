"""``bench_attention.py``'s table over several passes: each cell the median over the passes after the
first, each ratio the median of the per-pass ratios (a drift common to both sides cancels)."""
from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench_attention = pytest.importorskip("bench_attention")


def test_reported_passes_drop_the_first_unless_it_is_the_only_one():
    assert bench_attention.reported_passes([9.0]) == [9.0]
    assert bench_attention.reported_passes([9.0, 2.0, 3.0]) == [2.0, 3.0]


def test_paired_ratio_cancels_a_drift_both_sides_share():
    # Pass 1 (cold) is ignored; pass 3 runs 20% slower on both sides: each pass's ratio is 1.25.
    ours, ref = [5.0, 1.0, 1.2], [9.0, 1.25, 1.5]
    assert bench_attention.paired_ratio(ours, ref) == pytest.approx(1.25)
    # Unpaired medians of each side would give a different number here: the pairing is what matters.
    ours, ref = [1.0, 1.0, 2.0, 2.0], [1.0, 1.5, 1.5, 4.0]
    assert bench_attention.paired_ratio(ours, ref) == pytest.approx(1.5)


def test_paired_ratio_refuses_unequal_pass_counts():
    with pytest.raises(ValueError, match="2 passes of ours against 3 of the reference"):
        bench_attention.paired_ratio([1.0, 1.0], [1.0, 1.0, 1.0])


def test_paired_ratio_skips_passes_where_a_side_failed():
    # Pass 2 of ours failed (None): the ratio comes from pass 3 alone; no pass with both: NaN.
    assert bench_attention.paired_ratio([2.0, None, 1.0], [3.0, 1.5, 1.5]) == pytest.approx(1.5)
    assert math.isnan(bench_attention.paired_ratio([2.0, None, 1.0], [3.0, 1.5, None]))


def test_render_reports_median_cells_and_paired_ratios():
    args = bench_attention.parse_args(["--seqlens", "8192", "--heads", "16", "--dims", "128", "--causal", "1",
                                       "--configs", "fp8_delta", "--sdpa", "cudnn", "--passes", "3"])
    env = {"gpu": "GPU", "capability": "sm_90", "torch": "t", "triton": "tr", "cuda": "c", "cudnn": 1,
           "python": "p", "date_utc": "d", "fp8_backward_kernel": "available"}
    flop = bench_attention.flops("fwd", 2, 16, 8192, 128, True)

    def cell(passes):  # what run() stores for one implementation
        ms = statistics.median(bench_attention.reported_passes(passes))
        return {"ms": ms, "tflops": flop / ms * 1e-9, "ms_passes": passes}

    # cuDNN slows by 10% in pass 3, and ours with it: the ratio stays 1.20 in each pass.
    row = {"B": 2, "H": 16, "S": 8192, "D": 128, "causal": True,
           "sdpa_cudnn/fwd": cell([3.0, 1.2, 1.32]), "fp8_delta/fwd": cell([2.0, 1.0, 1.1])}
    text = bench_attention.render(env, [row], args)
    assert "each cell the median of passes 2-3 of 3" in text
    assert "| True | 16 | 128 | 8192 | 2 |" in text and "| 1.20 |" in text


def test_gqa_shapes_get_a_kv_head_column_and_bad_groups_are_refused(capsys):
    """``--gqa 2``: the tables name the kv heads; a group that does not divide the heads is an error."""
    args = bench_attention.parse_args(["--seqlens", "8192", "--heads", "16", "--dims", "128", "--causal", "1",
                                       "--configs", "fp8_delta", "--sdpa", "cudnn", "--passes", "1", "--gqa", "2",
                                       "--memory", "--modes", "fwdbwd"])
    env = {"gpu": "GPU", "capability": "sm_90", "torch": "t", "triton": "tr", "cuda": "c", "cudnn": 1,
           "python": "p", "date_utc": "d", "fp8_backward_kernel": "available"}
    row = {"B": 1, "H": 16, "Hkv": 8, "S": 8192, "D": 128, "causal": True,
           "sdpa_cudnn/fwdbwd": {"ms": 2.0, "tflops": 1.0, "ms_passes": [2.0]},
           "fp8_delta/fwdbwd": {"ms": 2.5, "tflops": 0.8, "ms_passes": [2.5]},
           "sdpa_cudnn/peak_mib": 387.0, "fp8_delta/peak_mib": 375.0}
    text = bench_attention.render(env, [row], args)
    assert text.count("| causal | H | Hkv | D | S | B |") == 2, text  # the timing and the memory table
    assert "| True | 16 | 8 | 128 | 8192 | 1 | 1 | 1 | 0.80 |" in text, text
    assert "| True | 16 | 8 | 128 | 8192 | 1 | 387 | 375 |" in text, text
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--heads", "16,12", "--gqa", "8"])
    assert "--gqa must be at least 1 and divide every --heads value" in capsys.readouterr().err


def test_graph_timer_replays_cuda_graphs_and_says_so(monkeypatch, capsys):
    """``--timer graph`` times with do_bench_cudagraph (the GPU's time, no host) and the table says
    which timer ran; the cudnn_fp8 baseline, which times its own graphs, is refused with it."""
    import triton.testing

    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: calls.append(("eager", kw)) or 1.0)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: calls.append(("graph", kw)) or 2.0)
    grads = [object()]
    assert bench_attention._median_ms(lambda: None, 25, 60, "graph", grads) == 2.0
    assert bench_attention._median_ms(lambda: None, 25, 60, "eager") == 1.0
    assert calls == [("graph", {"rep": 60, "grad_to_none": grads, "return_mode": "median"}),
                     ("eager", {"warmup": 25, "rep": 60, "grad_to_none": None, "return_mode": "median"})]
    args = bench_attention.parse_args(["--seqlens", "8192", "--heads", "16", "--dims", "128", "--causal", "1",
                                       "--configs", "fp8_delta", "--sdpa", "cudnn", "--passes", "1",
                                       "--timer", "graph"])
    env = {"gpu": "GPU", "capability": "sm_90", "torch": "t", "triton": "tr", "cuda": "c", "cudnn": 1,
           "python": "p", "date_utc": "d", "fp8_backward_kernel": "available"}
    row = {"B": 2, "H": 16, "S": 8192, "D": 128, "causal": True,
           "sdpa_cudnn/fwd": {"ms": 1.0, "tflops": 1.0, "ms_passes": [1.0]},
           "fp8_delta/fwd": {"ms": 0.8, "tflops": 1.25, "ms_passes": [0.8]}}
    assert "Medians of do_bench_cudagraph (100 ms of CUDA-graph replays" in bench_attention.render(env, [row], args)
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--timer", "graph", "--sdpa", "cudnn,cudnn_fp8"])
    assert "--timer graph: the cudnn_fp8 baseline times its own graphs" in capsys.readouterr().err
