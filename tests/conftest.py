"""Shared test setup.

- The `gpu` marker skips cleanly where no FP8-capable CUDA GPU is present.
- Without a CUDA GPU, the Triton kernels run under the interpreter: Triton reads TRITON_INTERPRET
  when a kernel is decorated (at the first import of a kernels module, wherever a test module is
  collected), so it is set here, before any test module is imported.
- fp32 matrix products on the CPU run in MKL's conditional-numerical-reproducibility mode
  (``MKL_CBWR=COMPATIBLE``, read when MKL starts, so set before torch is imported): otherwise MKL
  picks its kernels, and with them the summation order, by the CPU it runs on. The CPU tests
  compare FP8 paths whose codes must agree up to a rare flip at a rounding tie (e.g. kernels under
  the interpreter against the emulation, a padded batch against its rows run alone); on a Xeon with
  AVX-512 and AMX, MKL's own kernels flipped enough codes to move two of those comparisons by 2.7e-4
  and 1.6e-3 against bounds of 1e-4, which they meet in the reproducible mode. A caller's own
  MKL_CBWR is kept.
- Under pytest-xdist (the README's ``-n auto``) each worker gets its share of the cores as torch
  threads: the suite is mostly one thread of Python (the interpreter, subprocesses), so workers
  side by side are what uses the cores, and torch's default of one thread per core in every worker
  would oversubscribe them.
"""
import os

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def fp8_gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config, items):
    if fp8_gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with FP8 tensor cores (sm_89 or newer)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
