"""Shared test setup.

- The `gpu` marker skips cleanly where no FP8-capable CUDA GPU is present.
- Without a CUDA GPU, the Triton kernels run under the interpreter: Triton reads TRITON_INTERPRET
  when a kernel is decorated (at the first import of a kernels module, wherever a test module is
  collected), so it is set here, before any test module is imported.
"""
import os

import pytest
import torch

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
