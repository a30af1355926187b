"""``benchmarks/step_profile.py``'s trace arithmetic, without a GPU: which kernels count as the
package's attention, the GPU's busy time as a union of intervals, the idle time and the table."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_profile  # noqa: E402


def _event(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_package_kernel_names_hold_every_launched_kernel():
    names = step_profile.package_kernel_names()
    launched = {"_fwd_kernel", "_dq_kernel", "_dkdv_kernel", "_stats_kernel", "_partials_kernel",
                "quantize_kernel", "bwd_dq_fp8_kernel", "bwd_dkdv_fp8_kernel"}
    assert launched <= names
    assert "triton_poi_fused_add_0" not in names  # an inductor kernel is not the package's


@pytest.mark.parametrize("name, cat, expected", [
    ("_fwd_kernel", "kernel", "attention (package)"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "kernel", "attention (sdpa)"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7", "kernel", "attention (sdpa)"),
    ("nvjet_tst_192x192_64x4_1x2_h_bz_coopB_TNT", "kernel", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "kernel", "gemm"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "kernel",
     "optimizer"),
    ("void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>", "kernel", "other"),
    ("Memset (Device)", "gpu_memset", "memcpy / memset"),
])
def test_categorize(name, cat, expected):
    assert step_profile.categorize(name, cat, frozenset({"_fwd_kernel"})) == expected


def test_busy_time_is_the_union_of_overlapping_intervals():
    events = [_event("a", 0, 10), _event("b", 5, 10), _event("c", 20, 5), _event("d", 21, 2)]
    assert step_profile.busy_us(events) == 15 + 5


def test_summary_per_step_and_idle_time():
    trace = {"traceEvents": [
        _event("_fwd_kernel", 0, 40), _event("nvjet_gemm", 50, 30), _event("Memset", 80, 5, cat="gpu_memset"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # host events are left out
        _event("_fwd_kernel", 100, 40), _event("elementwise_kernel", 150, 50),
    ]}
    got = step_profile.summarize(step_profile.gpu_events(trace), steps=2, package=frozenset({"_fwd_kernel"}))
    assert got["wall_us"] == 100.0
    cats = got["categories"]
    assert cats["attention (package)"] == 40 and cats["gemm"] == 15 and cats["memcpy / memset"] == 2.5
    assert cats["other"] == 25
    assert cats["idle"] == pytest.approx(100 - 165 / 2)  # 200 µs of window, 165 busy, over 2 steps
    assert got["kernels"]["_fwd_kernel"] == ["attention (package)", 40.0]
    # idle intervals 40-50 (before a GEMM), 85-100 (before the package's kernel), 140-150 (before "other")
    assert got["idle_before"] == {"gemm": 5.0, "attention (package)": 7.5, "other": 5.0}
    assert got["gaps"][0] == [15, "Memset", "_fwd_kernel"]
    # of the idle intervals, the one before the package's kernel, by name: 15 µs in 2 steps
    assert got["idle_before_package"] == {"_fwd_kernel": [7.5, 0.5]}


def test_idle_before_package_kernels_by_name():
    package = frozenset({"_fwd_kernel", "quantize_kernel"})
    events = [_event("quantize_kernel", 0, 10), _event("_fwd_kernel", 30, 10), _event("gemm", 45, 10),
              _event("long", 60, 100), _event("quantize_kernel", 70, 5),  # covered by "long": no wait
              _event("quantize_kernel", 170, 5), _event("_fwd_kernel", 175, 5)]  # back to back: no wait
    assert step_profile.idle_before_package(events, package) == {"_fwd_kernel": [20, 1], "quantize_kernel": [10, 1]}


def test_idle_gaps_skip_intervals_covered_by_another_stream():
    events = [_event("long", 0, 100), _event("inside", 10, 5), _event("after", 120, 10)]
    by_next, gaps = step_profile.idle_gaps(events, frozenset())
    assert by_next == {"other": 20} and gaps == [[20, "long", "after"]]


def test_summary_of_a_trace_without_gpu_events_says_so():
    with pytest.raises(ValueError, match="no GPU events"):
        step_profile.summarize([], steps=1, package=frozenset())


def test_table_gives_differences_to_sdpa():
    def result(attn_us, copy_us):
        kernels = {"flash_fwd" if attn_us == 100 else "_fwd_kernel": ["attention (sdpa)" if attn_us == 100
                                                                      else "attention (package)", attn_us],
                   "direct_copy_kernel": ["other", copy_us]}
        cats = dict.fromkeys(step_profile.CATEGORIES, 0.0)
        cats.update({"attention (sdpa)" if attn_us == 100 else "attention (package)": attn_us, "other": copy_us})
        return {"wall_us": attn_us + copy_us, "host_ms": (attn_us + copy_us) / 1e3, "categories": cats,
                "kernels": kernels, "idle_before": {"gemm": copy_us * 10}, "gaps": [[copy_us, "a", "b"]]}

    args = argparse.Namespace(model="llama0.9b", context=8192, steps=2, diff_us=50.0)
    text = step_profile.render({"gpu": "test"}, args, {"sdpa": result(100, 0), "fp8_delta": result(90, 200)})
    assert "| other | 0.00 | 0.20 | +0.20 |" in text
    assert "- +200 µs (other) `direct_copy_kernel`" in text
    assert "- 90 `_fwd_kernel`" in text
    assert "| gemm | 0.00 | 2.00 |" in text and "- 200: `a` → `b`" in text
    waiting = result(90, 200)
    waiting["idle_before_package"] = {"quantize_kernel": [300.0, 2.0]}
    text = step_profile.render({"gpu": "test"}, args, {"sdpa": result(100, 0), "fp8_delta": waiting})
    assert "| `quantize_kernel` | 300 | 2.0 | 150 |" in text


def _marker(ts):
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": 2,
            "args": {"bytes": step_profile.MARKER_BYTES}}


def test_phases_split_at_the_markers_with_their_idle_time():
    # one step: forward 0-100 (kernels 10-40 and 60-100), backward 100-300 (100-250, idle 250-300
    # before nothing: the optimizer's marker at 300), optimizer 300-360 (idle 300-320, kernel 320-360)
    events = [_marker(0), _event("_fwd_kernel", 10, 30), _event("nvjet_gemm", 60, 40), _marker(100),
              _event("_dkdv_kernel", 102, 148), _marker(300), _event("multi_tensor_apply_kernel", 320, 40),
              _event("Memcpy HtoD (Pinned -> Device)", 50, 1, cat="gpu_memcpy")]  # another copy: not a marker
    got = step_profile.summarize(events, steps=1, package=frozenset({"_fwd_kernel", "_dkdv_kernel"}))
    phases = got["phases"]
    assert [phases[p]["span"] for p in step_profile.PHASES] == [100, 200, 60]
    # forward: 0-10 before the package's kernel, 40-50 before the other copy, 51-60 before the GEMM
    assert phases["forward"]["idle"] == 29
    assert phases["forward"]["idle_before"] == {"attention (package)": 10, "memcpy / memset": 10, "gemm": 9}
    assert phases["backward"]["idle"] == 2 + 50  # before the dK/dV kernel, then after it to the marker
    assert phases["backward"]["idle_before"] == {"attention (package)": 2}
    assert phases["optimizer"]["idle"] == 20 and phases["optimizer"]["idle_before"] == {"optimizer": 20}
    # the markers are left out of everything else
    assert got["categories"]["memcpy / memset"] == 1 and got["wall_us"] == 360 - 10
    copy = "Memcpy HtoD (Pinned -> Device)"
    assert got["gaps"] == [[70, "_dkdv_kernel", "multi_tensor_apply_kernel"], [10, "_fwd_kernel", copy],
                           [9, copy, "nvjet_gemm"], [2, "nvjet_gemm", "_dkdv_kernel"]]
    args = argparse.Namespace(model="llama0.9b", context=8192, steps=1, diff_us=50.0)
    text = step_profile.render({"gpu": "test"}, args, {"fp8_delta": {**got, "host_ms": 0.4}})
    assert "| backward | 0.20 | 0.05 | - |" in text
    assert "| forward | 0.10 | 0.03 | attention (package) 0.01, memcpy / memset 0.01 |" in text


def test_phases_of_several_steps_are_per_step_means_and_clip_events_at_the_markers():
    events = [_marker(0), _event("k", 0, 150), _marker(100), _marker(200),  # k runs into the backward
              _marker(300), _event("k", 300, 50), _marker(400), _marker(450)]
    phases = step_profile.summarize(events, steps=2, package=frozenset())["phases"]
    # forward: 0-100 all busy (k clipped at the marker), then 300-400 with 50 idle after k
    assert phases["forward"] == {"span": 100, "idle": 25.0, "idle_before": {}}
    assert phases["backward"]["span"] == (100 + 50) / 2 and phases["backward"]["idle"] == (50 + 50) / 2
    # the last step's optimizer ends with the last event: its own marker (450-452)
    assert phases["optimizer"]["span"] == (100 + 2) / 2


def test_a_trace_without_markers_is_not_split_and_the_table_says_so():
    got = step_profile.summarize([_event("k", 0, 10)], steps=1, package=frozenset())
    assert got["phases"] is None
    args = argparse.Namespace(model="llama0.9b", context=8192, steps=1, diff_us=50.0)
    text = step_profile.render({"gpu": "test"}, args, {"sdpa": {**got, "host_ms": 0.01}})
    assert f"By phase: not split (no marker copies of {step_profile.MARKER_BYTES} bytes in the trace of sdpa)" in text


def test_table_names_the_launch_schedule_set_for_the_run():
    got = step_profile.summarize([_event("k", 0, 10)], steps=1, package=frozenset())
    args = argparse.Namespace(model="llama0.9b", context=8192, steps=1, diff_us=50.0, schedule="TOKEN_MAJOR_OUT=False")
    text = step_profile.render({"gpu": "test"}, args, {"sdpa": {**got, "host_ms": 0.01}})
    assert "--steps 1` (launch schedule set for this run: TOKEN_MAJOR_OUT=False); ms per step" in text
