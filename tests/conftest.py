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
"""
import os

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def fp8_gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config, items):
    if fp8_gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with FP8 tensor cores (sm_89 or newer)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
