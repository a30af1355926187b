"""Input makers and assertions shared by the numerics tests.

The FP8 error budget (``FP8_ERROR_BUDGET``, relative error against float64 attention) is defined
and justified once, in :mod:`hf_fp8_attention.diagnostics`; ``check``'s self-test uses it too.
A broken tile, scale or mask gives O(1) errors, far outside it; exact agreement with the kernels is
checked separately (same quantization, tight bounds).
"""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hf_fp8_attention.config import FP8AttentionConfig
from hf_fp8_attention.diagnostics import FP8_ERROR_BUDGET as BUDGET
from hf_fp8_attention.diagnostics import HYBRID_MATCHED_GRAD_BUDGET  # noqa: F401 (re-exported for tests)

# The recipes the Gluon kernels run (tests/gpu/test_gluon_*.py): the fast ones with either delta, the
# matched one with power-of-two scales, and the default ones (Q and dO per token) with either delta.
GLUON_RECIPES = {
    "fp8_delta_fast": FP8AttentionConfig.from_recipe("fp8_delta_fast"),
    "fp8_stale_fast": FP8AttentionConfig.from_recipe("fp8_stale_fast"),
    "fp8_delta_fast+pow2": FP8AttentionConfig.from_recipe("fp8_delta_fast", pow2_scales=True),
    "fp8_delta": FP8AttentionConfig.from_recipe("fp8_delta"),
    "fp8_stale": FP8AttentionConfig.from_recipe("fp8_stale"),
}


def recipe_overrides(name: str) -> dict:
    """The fields in which ``RECIPES[name]`` differs from ``FP8AttentionConfig()``, as keywords, for
    tests that build a recipe with their own tile sizes and per-case changes on top."""
    from hf_fp8_attention import RECIPES

    recipe, base = RECIPES[name], FP8AttentionConfig()
    return {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)
            if getattr(recipe, f.name) != getattr(base, f.name)}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.detach().double() - ref.detach().double()).norm() / ref.detach().double().norm())


def assert_within_budget(results, reference, budget=BUDGET):
    """``results``/``reference``: (out, dq, dk, dv). An exactly-zero reference demands exact zeros
    (e.g. dq = dk = 0 when every query sees a single key: the softmax is constant)."""
    for name, x, ref in zip(("out", "dq", "dk", "dv"), results, reference):
        if ref.norm() == 0:
            assert not x.any(), f"{name} must be exactly zero"
        else:
            assert rel_err(x, ref) <= budget[name], (name, rel_err(x, ref), budget[name])


def make_qkv(b=1, hq=4, hkv=2, sq=128, sk=None, d=64, dtype=torch.bfloat16, seed=0, outliers=False):
    """Random q ``(b, hq, sq, d)``, k/v ``(b, hkv, sk, d)``, dout like q.

    ``outliers`` adds what trained LLMs show: a few large channels in q/k, a key bias along one
    channel, and an attention-sink key (position 0) aligned with the mean query.
    """
    g = torch.Generator().manual_seed(seed)
    sk = sq if sk is None else sk
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, sk, d, generator=g)
    v = torch.randn(b, hkv, sk, d, generator=g)
    dout = torch.randn(b, hq, sq, d, generator=g)
    if outliers:
        q[..., :2] *= 4.0
        k[..., :2] *= 4.0
        k[..., 3] += 8.0
        k[:, :, 0, :] = 3.0 * q.mean(dim=(1, 2))[:, None, :]
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def count_calls(monkeypatch, module, name: str, counts, key) -> None:
    """Replace ``module.name`` (for the test) by a spy that adds 1 to ``counts[key]`` per call and
    then calls the original: how the GPU tests check that a kernel's entry point ran."""
    run = getattr(module, name)

    def spy(*args, **kwargs):
        counts[key] += 1
        return run(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)


def chunk_every_call(monkeypatch, chunks: int) -> None:
    """The FP8 backward in ``chunks`` chunks for calls of any size and memory state: the tests'
    problems are far below the default ``LAUNCH["backward_chunk_min_elements"]``, and on a GPU the
    earlier tests' peak would make them one pass (``backward_chunks_below_peak``, kernels/backward.py)."""
    from hf_fp8_attention.kernels import backward

    monkeypatch.setitem(backward.LAUNCH, "backward_chunks", chunks)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunk_min_elements", 0)
    monkeypatch.setitem(backward.LAUNCH, "backward_chunks_below_peak", False)


def interpreter_results(script, parts: int | None = None, timeout: float = 600) -> dict:
    """Run ``python script PART PARTS`` for every part under the Triton interpreter, side by side, and
    merge the JSON dicts each prints on its last line. The interpreter is single-threaded, so the
    parts (the script's checks split by index modulo PARTS) default to one per CPU core."""
    root = Path(__file__).resolve().parents[1]
    parts = parts or max(1, min(4, os.cpu_count() or 1))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(script), str(part), str(parts)], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for part in range(parts)]
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-4000:]
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results
