"""The direct launch path on the GPU: the same outputs and gradients, bit for bit, as Triton's own
launch path, with the direct path taken (``hf_fp8_attention.kernels.launch``; its keys and
argument order are checked without a GPU in tests/test_launch.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import make_qkv  # noqa: E402

from hf_fp8_attention import RECIPES, fp8_attention  # noqa: E402
from hf_fp8_attention.kernels import launch as launch_mod  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = {
    # name: (B, Hq, Hkv, S, D), causal, packed cu_seqlens or None
    "causal_gqa_d128": ((1, 4, 2, 1000, 128), True, None),
    "gluon_scope_d128": ((1, 4, 2, 1024, 128), True, None),  # where Hopper runs the Gluon kernels
    "dense_d64": ((2, 4, 4, 300, 64), False, None),
    "packed_d64": ((1, 4, 2, 600, 64), True, [0, 130, 130, 517, 600]),
}


def _fwd_bwd(recipe: str, case: str):
    (b, hq, hkv, s, d), causal, cu = CASES[case]
    q, k, v, dout = (t.cuda() for t in make_qkv(b, hq, hkv, s, d=d, seed=3, outliers=True))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    packed = {}
    if cu is not None:
        t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        n = max(y - x for x, y in zip(cu, cu[1:]))
        packed = dict(cu_seqlens_q=t, cu_seqlens_k=t, max_seqlen_q=n, max_seqlen_k=n)
    out = fp8_attention(q, k, v, causal=causal, config=RECIPES[recipe], **packed)
    out.backward(dout)
    torch.cuda.synchronize()
    return out.detach(), q.grad, k.grad, v.grad


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast", "fp8_stale", "fp8_delta_tile", "hybrid_delta"])
def test_direct_launches_match_tritons_bit_for_bit(monkeypatch, recipe, case):
    monkeypatch.setenv(launch_mod.DIRECT_LAUNCH_ENV, "0")  # Triton's binding on every launch
    reference = _fwd_bwd(recipe, case)
    monkeypatch.setenv(launch_mod.DIRECT_LAUNCH_ENV, "1")
    _fwd_bwd(recipe, case)  # binds and compiles each key once
    before = {id(d): (d.direct, d.bound) for d in launch_mod._LAUNCHERS.values()}
    direct = _fwd_bwd(recipe, case)
    counts = [(d.kernel.is_gluon(), d.direct - before.get(id(d), (0, 0))[0], d.bound - before.get(id(d), (0, 0))[1])
              for d in launch_mod._LAUNCHERS.values()]
    taken = sum(n for _, n, _ in counts)
    assert taken >= 4, f"only {taken} launches took the direct path"
    gluon_bound = sum(n for gluon, _, n in counts if gluon)
    assert gluon_bound == 0, f"{gluon_bound} Gluon launches took Triton's path on a known key"
    if case == "gluon_scope_d128" and recipe in ("fp8_delta", "fp8_delta_fast") and _hopper():
        # the forward, dQ and dK/dV at least (the statistics launch is Gluon for some recipes only)
        assert sum(n for gluon, n, _ in counts if gluon) >= 3, "the Gluon kernels did not take the direct path"
    for name, a, b in zip(("out", "dq", "dk", "dv"), direct, reference):
        assert torch.equal(a, b), f"{name} differs: max |diff| {(a.float() - b.float()).abs().max().item()}"
