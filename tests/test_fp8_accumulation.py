"""``--promote-accumulation``: the kernels compiled with Hopper's FP8 MMA accumulation promoted to
FP32 (``benchmarks/fp8_accumulation.py``). On CPU: the compile option it sets for an sm_90 target,
its validation, and the scripts' flags."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
compiler = pytest.importorskip("triton.backends.nvidia.compiler")
from triton.backends.compiler import GPUTarget  # noqa: E402

import fp8_accumulation  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


@pytest.fixture
def backend(monkeypatch):
    """The CUDA backend with its option parser put back after the test (the promotion is process-wide)."""
    monkeypatch.setattr(compiler.CUDABackend, "parse_options", compiler.CUDABackend.parse_options)
    return compiler.CUDABackend


def test_promotion_sets_the_sm90_compile_option(backend):
    assert backend(HOPPER).parse_options({}).max_num_imprecise_acc_default == 2**30  # Triton's: never
    fp8_accumulation.promote_fp8_accumulation(64)
    options = backend(HOPPER).parse_options({"num_warps": 8})
    assert options.max_num_imprecise_acc_default == 64 and options.num_warps == 8
    fp8_accumulation.promote_fp8_accumulation(64)  # the same again: nothing changes
    with pytest.raises(RuntimeError, match="already promoted every 64"):
        fp8_accumulation.promote_fp8_accumulation(32)


@pytest.mark.parametrize("every", [0, 16, 48, -32])
def test_promotion_interval_must_be_a_multiple_of_one_instruction(backend, every):
    with pytest.raises(ValueError, match="positive multiple of 32"):
        fp8_accumulation.promote_fp8_accumulation(every)
    assert backend(HOPPER).parse_options({}).max_num_imprecise_acc_default == 2**30


def test_bench_attention_flag_sets_it_and_says_so(backend, capsys):
    bench_attention = pytest.importorskip("bench_attention")
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--promote-accumulation", "40"])
    assert "--promote-accumulation: promotion interval must be a positive multiple of 32" in capsys.readouterr().err
    args = bench_attention.parse_args(["--seqlens", "8192", "--heads", "16", "--dims", "128", "--causal", "1",
                                       "--configs", "fp8_delta", "--sdpa", "cudnn", "--promote-accumulation", "32"])
    assert backend(HOPPER).parse_options({}).max_num_imprecise_acc_default == 32
    env = {"gpu": "GPU", "capability": "sm_90", "torch": "t", "triton": "tr", "cuda": "c", "cudnn": 1,
           "python": "p", "date_utc": "d", "fp8_backward_kernel": "available"}
    text = bench_attention.render(env, [], args)
    assert "Kernels compiled with FP8 accumulation promoted to FP32 every 32 k-elements" in text, text


def test_recipe_errors_takes_the_flag_for_the_kernels_only(backend, capsys):
    recipe_errors = pytest.importorskip("recipe_errors")
    with pytest.raises(SystemExit):
        recipe_errors.main(["--promote-accumulation", "32"])
    assert "--promote-accumulation sets how the kernels compile: it needs --backend triton" in capsys.readouterr().err
    assert backend(HOPPER).parse_options({}).max_num_imprecise_acc_default == 2**30
