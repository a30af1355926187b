"""Shared test setup: the `gpu` marker skips cleanly where no FP8-capable CUDA GPU is present."""
import pytest
import torch


def fp8_gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config, items):
    if fp8_gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with FP8 tensor cores (sm_89 or newer)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
