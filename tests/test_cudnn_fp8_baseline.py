"""The cuDNN FP8 SDPA baseline of ``bench_attention.py`` (``--sdpa cudnn_fp8``) without a GPU: its scale
rule, its refusal where cuDNN's FP8 attention cannot run, and the table section that reports what it
computed. Its graphs run in the GPU benchmark only."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
bench_attention = pytest.importorskip("bench_attention")
cudnn_fp8_sdpa = pytest.importorskip("cudnn_fp8_sdpa")

ENV = {"gpu": "GPU", "capability": "sm_90", "torch": "t", "triton": "tr", "cuda": "c", "cudnn": 1,
       "python": "p", "date_utc": "d", "fp8_backward_kernel": "available"}


def test_scales_are_powers_of_two_that_leave_headroom():
    # cudnn-frontend's tests' rule: the amax rounded up to a power of two maps to 32 (E4M3's max is 448).
    assert cudnn_fp8_sdpa.fp8_scale(1.0) == 32.0
    assert cudnn_fp8_sdpa.fp8_scale(3.0) == 8.0  # 3 -> 4 -> 128 / 4 / 4
    assert cudnn_fp8_sdpa.fp8_scale(0.001) == 512.0  # floored at amax 1/16
    for amax in (0.07, 0.5, 1.5, 7.0, 300.0):
        assert amax * cudnn_fp8_sdpa.fp8_scale(amax) <= 32.0


def test_available_names_what_is_missing():
    ok, why = cudnn_fp8_sdpa.available()
    if not ok:  # a CPU machine: cudnn-frontend missing, or no Hopper GPU
        assert why and ("cudnn-frontend" in why or "GPU" in why or "cuDNN" in why)
        x = torch.zeros(1, 1, 16, 64)
        with pytest.raises(RuntimeError, match="cuDNN's FP8 SDPA cannot run here: "):
            cudnn_fp8_sdpa.CudnnFp8Attention(x, x, x, True, x)


def test_cudnn_fp8_is_a_baseline_and_unknown_ones_are_refused(capsys):
    args = bench_attention.parse_args(["--sdpa", "cudnn,cudnn_fp8", "--configs", "fp8_delta"])
    assert args.sdpa == ["cudnn", "cudnn_fp8"]
    assert isinstance(bench_attention._sdpa_fn("cudnn_fp8", True), bench_attention._CudnnFp8)
    with pytest.raises(SystemExit):
        bench_attention.parse_args(["--sdpa", "cudnn,te_fp8"])
    assert "unknown SDPA backends ['te_fp8']" in capsys.readouterr().err


def test_render_gives_ratios_to_cudnn_fp8_and_its_check():
    args = bench_attention.parse_args(["--seqlens", "8192", "--heads", "16", "--dims", "128", "--causal", "1",
                                       "--configs", "fp8_delta", "--sdpa", "cudnn,cudnn_fp8", "--passes", "1",
                                       "--modes", "fwdbwd"])
    row = {"B": 2, "H": 16, "S": 8192, "D": 128, "causal": True,
           "sdpa_cudnn/fwdbwd": {"ms": 4.0, "tflops": 1.0, "ms_passes": [4.0]},
           "sdpa_cudnn_fp8/fwdbwd": {"ms": 5.0, "tflops": 0.8, "ms_passes": [5.0]},
           "fp8_delta/fwdbwd": {"ms": 4.0, "tflops": 1.0, "ms_passes": [4.0]},
           "sdpa_cudnn_fp8/check": {"o_dtype": "float8_e4m3fn", "o_rel_err": 0.0312, "dq_rel_err": 0.0871,
                                    "dk_rel_err": 0.0654, "dv_rel_err": 0.0432}}
    failed = dict(row, **{"S": 16384, "B": 1, "sdpa_cudnn_fp8/check": {"error": "RuntimeError: no graph"}})
    text = bench_attention.render(ENV, [row, failed], args)
    assert "| causal | H | D | S | B | sdpa_cudnn | sdpa_cudnn_fp8 | fp8_delta | x cudnn | x cudnn_fp8 |" in text
    assert "| True | 16 | 128 | 8192 | 2 | 1 | 1 | 1 | 1.00 | 1.25 |" in text, text
    assert "| True | 16 | 128 | 8192 | 2 | float8_e4m3fn | 0.0312 | 0.0871 | 0.0654 | 0.0432 |" in text, text
    assert "| True | 16 | 128 | 16384 | 1 | RuntimeError: no graph |  |  |  |  |" in text, text


def test_recipe_errors_takes_cudnn_fp8_on_the_gpu_backend_only(capsys):
    """``recipe_errors.py --recipes ... cudnn_fp8`` (cuDNN's FP8 attention on the fixture) needs the
    CUDA backend; an unknown name is refused with the choices."""
    recipe_errors = pytest.importorskip("recipe_errors")
    with pytest.raises(SystemExit):
        recipe_errors.main(["--recipes", "fp8_delta", "cudnn_fp8"])
    assert "cudnn_fp8 runs cuDNN's kernels: it needs --backend triton" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recipe_errors.main(["--recipes", "fp8_dleta"])
    assert "unknown recipes ['fp8_dleta']" in capsys.readouterr().err


def test_recipe_errors_reports_a_cudnn_refusal_once_and_goes_on(monkeypatch, capsys, tmp_path):
    """Where cuDNN builds no FP8 graph for the fixture's shape (Hopper: head_dim 128 only, the fixture's
    is 64), ``cudnn_fp8`` gets one row saying so, in the table and the JSON, and is not asked again."""
    recipe_errors = pytest.importorskip("recipe_errors")
    calls = []

    def refuse(q, *rest):
        calls.append(tuple(q.shape))
        raise recipe_errors.CudnnFp8Refused("cuDNN builds no FP8 SDPA for (B, H, Hkv, S, D) = ...: hidden_dim 128")

    monkeypatch.setattr(recipe_errors, "cudnn_fp8_errors", refuse)
    monkeypatch.setitem(recipe_errors.BACKEND_DEVICE, "triton", "cpu")  # no kernels run: cuDNN's row only
    out_json = tmp_path / "errors.json"
    assert recipe_errors.main(["--backend", "triton", "--recipes", "cudnn_fp8", "--tokens", "64",
                               "--json", str(out_json)]) == 0
    assert len(calls) == 1 and len(recipe_errors.load_layers(recipe_errors.DEFAULT_FIXTURE, 64)) > 1
    assert "cudnn_fp8        refused, every layer: cuDNN builds no FP8 SDPA" in capsys.readouterr().out
    assert "hidden_dim 128" in json.loads(out_json.read_text())["cudnn_fp8"]["refused"]
