"""The host side of the Triton path as it runs on a Hopper GPU, on a machine without one.

:func:`simulated_hopper` makes the package take, for CPU tensors, every decision it takes for CUDA
tensors on an H100 (132 multiprocessors, sm_90, TMA, the Gluon kernels, Triton compiled rather than
interpreted) and replaces each kernel launch with a record of it: the kernel's name, its grid, the
direct launch path's key of its arguments (:func:`..kernels.launch.arg_key`, computed as that path
computes it, so its host cost stays in what is timed) and its constexprs. Nothing runs on a device
and no output is written: the buffers are allocated, never filled. Device checks are answered
where the package asks them (``on_cuda``, ``has_tma``, ``sm_count``, ``device_reason``).

What it is for: the package's own Python per call (planning, allocation, autograd) and the list of
launches a call issues, timed and checked on any machine (``host_python.py --hopper``,
``tests/test_hopper_host_path.py``). What it leaves out: Triton's launcher (7-27 µs a launch on the
benchmark GPU's host) and the driver. The device queries it answers (capability, multiprocessors,
TMA) are the H100's; no stream is captured; the backward's memory rule (one pass or chunks) sees no
allocator counters and follows the size alone.

Gradients should be taken with ``torch.autograd.grad`` on non-leaf or contiguous inputs: the CPU
would otherwise copy a gradient into a leaf's layout (a device copy on a GPU, real work here).
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
from typing import Iterator, NamedTuple
from unittest import mock

from hf_fp8_attention import kernels, ops
from hf_fp8_attention.config import Backend
from hf_fp8_attention.kernels import autotune, backward, gluon_hopper, launch, quantize

# Every kernel module now, so that each name the simulation patches is found where it is used.
KERNEL_MODULES = [importlib.import_module(f"{kernels.__name__}.{m.name}")
                  for m in pkgutil.iter_modules(kernels.__path__)]

H100_SMS = 132


class Launch(NamedTuple):
    """One recorded launch: ``kernel`` name, ``grid`` (up to three ints), ``key`` (per positional
    argument its :func:`arg_key`) and ``meta`` (the keyword arguments: constexprs and options)."""

    kernel: str
    grid: tuple
    key: tuple
    meta: dict


def kernel_name(kernel) -> str:
    """The name of a launched kernel (a JIT or interpreted function: its Python function's)."""
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", type(kernel).__name__)


def _device_reason(q) -> str | None:
    """gluon_hopper.device_reason on an sm_90 CUDA device."""
    return None if gluon_hopper.gluon is not None else "Triton without Gluon"


@contextlib.contextmanager
def simulated_hopper() -> Iterator[list[Launch]]:
    """Within it, CPU tensors take the H100's Triton path with every launch recorded (see the
    module docstring); yields the list the launches are appended to. Every patched name is
    restored on exit."""
    launches: list[Launch] = []

    def record(kernel, grid, *args, **meta):
        key = tuple(map(launch.arg_key, args))  # the direct path's per-call cost
        launches.append(Launch(kernel_name(kernel), tuple(grid), key, meta))

    with contextlib.ExitStack() as patches:  # each patch undone on exit, or where a later one fails
        def patch(owner, name, value):
            patches.enter_context(mock.patch.object(owner, name, value))

        for module in KERNEL_MODULES:
            for attr, value in (("launch_kernel", record), ("sm_count", lambda index: H100_SMS),
                                ("has_tma", lambda index: True), ("device_reason", _device_reason),
                                ("on_cuda", lambda device: True)):
                if hasattr(module, attr):
                    patch(module, attr, value)
        patch(quantize, "_INTERPRETING", False)
        patch(ops, "select_backend",
              lambda device, config: Backend.EMULATION if config.backend is Backend.EMULATION else Backend.TRITON)
        patch(backward, "_check_limits", lambda q, config: None)
        # A new key's tuning times each candidate on the device; here the first candidate stands in.
        patch(autotune.LaunchTuner, "_tune", lambda self, key, run, candidates: tuple(candidates)[0])
        yield launches


__all__ = ["H100_SMS", "KERNEL_MODULES", "Launch", "kernel_name", "simulated_hopper"]
