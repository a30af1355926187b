"""``benchmarks/host_breakdown.py``'s instrumentation, without a GPU: every launch path it times
(Triton's launch helper, each Gluon launch function) is counted per kernel, and the package's
modules get their own functions back after the test."""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_breakdown  # noqa: E402
from hf_fp8_attention import ops  # noqa: E402
from hf_fp8_attention.integration import transformers_backend  # noqa: E402
from hf_fp8_attention.kernels import (  # noqa: E402
    backward, backward_dkdv_gluon, backward_dq_gluon, backward_stats_gluon, forward, forward_gluon, quantize,
    sequence_stats,
)

_PATCHED = [(transformers_backend, "fp8_attention_forward"), (ops, "run_forward"), (ops, "run_backward"),
            (forward_gluon, "gluon_forward"), (backward_stats_gluon, "gluon_dq_stats"),
            (backward_dq_gluon, "gluon_dq"), (backward_dkdv_gluon, "gluon_dkdv")]
_LAUNCHERS = (backward, forward, quantize, sequence_stats)


def test_launches_are_timed_per_kernel(monkeypatch):
    calls = []
    for module, name in _PATCHED:  # stubs in place of the real functions (and restored afterwards)
        monkeypatch.setattr(module, name, lambda *a, name=name, **k: calls.append(name))
    for module in _LAUNCHERS:
        monkeypatch.setattr(module, "launch_kernel", module.launch_kernel)
    monkeypatch.setattr(host_breakdown.launch, "launch", lambda kernel, grid, *a, **k: calls.append("launch"))
    for table, kind in (("_TOTALS", float), ("_COUNTS", int), ("_KERNELS", float), ("_KERNEL_COUNTS", int)):
        monkeypatch.setattr(host_breakdown, table, defaultdict(kind))
    host_breakdown.instrument()

    def quantize_kernel():
        pass

    class Kernel:  # a Triton JIT handle: the Python function under ``fn``
        fn = quantize_kernel

    forward.launch_kernel(Kernel(), (1,), 0)
    quantize.launch_kernel(Kernel(), (1,), 0)
    forward_gluon.gluon_forward(0)
    backward_dkdv_gluon.gluon_dkdv(0)
    backward_dkdv_gluon.gluon_dkdv(0)
    assert calls == ["launch", "launch", "gluon_forward", "gluon_dkdv", "gluon_dkdv"]
    assert dict(host_breakdown._KERNEL_COUNTS) == {"launch:quantize_kernel": 2, "gluon:gluon_forward": 1,
                                                   "gluon:gluon_dkdv": 2}
    assert host_breakdown._COUNTS["launch"] == 2 and host_breakdown._COUNTS["gluon"] == 3
    assert all(t >= 0 for t in host_breakdown._KERNELS.values())


def test_phase_times_pair_each_phase_with_its_events(monkeypatch):
    """Fake CUDA events that stamp a counter: each phase's GPU time runs from its own event to the
    next phase's (the last to the closing event); its host time is the callable's own."""
    import torch

    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def phase(gpu_ms):
        def run():
            clock[0] += gpu_ms
        return run

    got = host_breakdown.phase_times([("forward", phase(3.0)), ("backward", phase(5.0)), ("optimizer", phase(1.0))],
                                     steps=3)
    assert list(got) == ["forward", "backward", "optimizer"]
    assert [g for _, g in got.values()] == [3.0, 5.0, 1.0]
    assert all(0 <= h < 100 for h, _ in got.values())
