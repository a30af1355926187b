"""Where the Gluon kernels run (CPU; their numerics are checked on a Hopper GPU by
tests/gpu/test_gluon_backward.py and tests/gpu/test_gluon_forward.py), and that they build for sm_90a
with this machine's Triton."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch
import triton

from hf_fp8_attention import FP8AttentionConfig
from hf_fp8_attention.config import FP8Format
from hf_fp8_attention.kernels import (
    backward, backward_dkdv_gluon, backward_dq_gluon, backward_stats_gluon, forward, forward_gluon, gluon_hopper,
    launch,
)
from hf_fp8_attention.masking import MaskSpec

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

FAST = FP8AttentionConfig.from_recipe("fp8_delta_fast")
CAUSAL = MaskSpec(causal=True)


def _reason(shape_q=(2, 4, 512, 128), shape_k=(2, 2, 512, 128), mask=CAUSAL, config=FAST, mods=None,
            module=backward_dkdv_gluon):
    return module.scope_reason(shape_q, shape_k, mask, config, mods or {})


MODULES = (backward_dkdv_gluon, backward_dq_gluon, backward_stats_gluon, forward_gluon)
LAYERED = {"fwd": forward_gluon, "dkdv": backward_dkdv_gluon, "dq": backward_dq_gluon,
           "stats": backward_stats_gluon}  # kernels with LAYOUTS


@pytest.mark.parametrize("module", MODULES)
def test_in_scope(module):
    assert _reason(module=module) is None
    # the default recipe: Q's and dO's scales per token (per-row factors in every kernel)
    assert _reason(config=FP8AttentionConfig.from_recipe("fp8_delta"), module=module) is None
    # Sq < Sk without a causal mask
    assert _reason(shape_q=(1, 2, 128, 128), shape_k=(1, 2, 256, 128), mask=MaskSpec(), module=module) is None


def test_the_statistics_kernel_runs_the_matched_delta_without_sinks():
    stale = FP8AttentionConfig.from_recipe("fp8_stale_fast")
    assert _reason(config=stale) is None and _reason(config=stale, module=backward_dq_gluon) is None
    assert _reason(config=stale, module=forward_gluon) is None
    assert "stale" in _reason(config=stale, module=backward_stats_gluon)
    assert _reason(mods={"SINK": True}) is None
    for module in (backward_stats_gluon, forward_gluon):
        assert "sinks" in _reason(mods={"SINK": True}, module=module)


def test_the_forward_kernel_needs_the_recipes_key_tile():
    """The codes of P are relative to each key tile's own maximum (forward.py), so the kernel's
    key tiles (128 or 256: forward_gluon.BLOCK_NS) must be the recipe's, and whole."""
    assert "key tiles of 64 (built for 128 and 256)" in _reason(config=FAST.replace(block_k=64), module=forward_gluon)
    assert "need multiples of 128 / 128" in _reason(shape_q=(1, 2, 64, 128), shape_k=(1, 2, 256, 128),
                                                    mask=MaskSpec(), module=forward_gluon)
    tiles_256 = FAST.replace(block_k=256)
    assert _reason(config=tiles_256, module=forward_gluon) is None
    assert "need multiples of 128 / 256" in _reason(shape_q=(1, 2, 384, 128), shape_k=(1, 2, 384, 128),
                                                    config=tiles_256, module=forward_gluon)
    assert forward_gluon.ring_stages(128) == forward_gluon.STAGES
    assert forward_gluon.ring_stages(256) == min(forward_gluon.STAGES, forward_gluon.STAGES_256)


def test_scopes_differ_in_head_dims_and_lengths():
    assert _reason(shape_q=(1, 9, 256, 64), shape_k=(1, 3, 256, 64)) is None  # GQA, head dim 64
    assert "head dim 64" in _reason(shape_q=(1, 9, 256, 64), shape_k=(1, 3, 256, 64), module=backward_dq_gluon)
    assert _reason(shape_q=(1, 2, 64, 128), shape_k=(1, 2, 256, 128), mask=MaskSpec()) is None
    assert "sequence lengths" in _reason(shape_q=(1, 2, 64, 128), shape_k=(1, 2, 256, 128), mask=MaskSpec(),
                                         module=backward_dq_gluon)
    assert "sequence lengths" in _reason(shape_q=(1, 2, 96, 128), shape_k=(1, 2, 256, 128), mask=MaskSpec())
    assert "sequence lengths" in _reason(shape_q=(1, 2, 128, 128), shape_k=(1, 2, 192, 128), mask=MaskSpec())
    assert _reason(shape_q=(1, 2, 128, 128), shape_k=(1, 2, 192, 128), mask=MaskSpec(),
                   module=backward_dq_gluon) is None


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("change, words", [
    (dict(config=FP8AttentionConfig.from_recipe("fp8_delta_token")), "recipe with kv_scales='token'"),
    (dict(config=FP8AttentionConfig.from_recipe("fp8_delta_tile")), "channel_scales='tile'"),
    (dict(config=FP8AttentionConfig.from_recipe("fp8_delta", ds_scales="tile")), "recipe with ds_scales='tile'"),
    (dict(config=FAST.replace(do_format=FP8Format.E5M2)), "format"),
    (dict(mods={"SOFTCAP": True}), "soft-capping"),
    (dict(mods={"ROW_SHIFT": True}), "row constant"),
    (dict(mask=MaskSpec(causal=True, window=64)), "window"),
    (dict(mask=MaskSpec(causal=True, cu_seqlens_q=torch.tensor([0, 512], dtype=torch.int32),
                        cu_seqlens_k=torch.tensor([0, 512], dtype=torch.int32))), "packed"),
    (dict(shape_q=(2, 4, 512, 96), shape_k=(2, 2, 512, 96)), "head dim 96"),
    (dict(shape_q=(2, 4, 500, 128), shape_k=(2, 2, 500, 128)), "sequence lengths"),
    (dict(shape_q=(2, 4, 256, 128)), "causal with fewer queries"),
])
def test_out_of_scope_names_the_reason(change, words, module):
    reason = _reason(**change, module=module)
    assert reason is not None and words in reason


def test_cpu_tensors_take_the_triton_launches():
    q = torch.zeros(1, 2, 256, 128)
    for key, module in (("gluon_dkdv", backward_dkdv_gluon), ("gluon_dq", backward_dq_gluon),
                        ("gluon_dq_stats", backward_stats_gluon)):
        assert module.unsupported_reason(q, q, CAUSAL, FAST, {}) is not None
        assert not backward._gluon_runs(module, key, q, q, CAUSAL, FAST, {})
    assert "CUDA" in forward_gluon.unsupported_reason(q, q, CAUSAL, FAST, {})
    assert not gluon_hopper.gluon_runs(forward_gluon, forward.GLUON_FORWARD, q, q, CAUSAL, FAST, {}, "test")


def test_compiles_for_sm90():
    """Every kernel at every head dim it is built for, in each of its LAYOUTS (operand layouts,
    schedules), the forward with its one-FMA exponent and as the persistent kernel, built as the GPU
    builds it (in a fresh process without the interpreter, whose patches of triton.language a Gluon
    compile in this process would meet after other tests): shared memory fits a block, the
    consumers' tile loops keep their accumulators in registers (no local-memory traffic beyond one
    reload), and ptxas did not serialise their MMAs (a wait after each)."""
    if gluon_hopper.gluon is None:
        pytest.skip("this Triton has no Gluon")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(BENCHMARKS / "compile_sm90.py"), "--gluon", "--json"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    built = {(r["kernel"], r["layout"], r["d"]) for r in rows if not r["kernel"].endswith("_persistent")}
    assert built == {(name, layout, d) for name, module in LAYERED.items()
                     for layout in module.LAYOUTS for d in module.HEAD_DIMS}
    # dK/dV's PRODUCTS_UNDER_EXPS (off) is spill-free as Triton 3.6 builds it (the GPU machine's, which
    # times it); Triton 3.9's ptxas spills 18-27 values a tile of its interior loop at d = 128
    # (benchmarks/NOTES.md, "Backward"): there only its order is checked, below.
    may_spill = {"kv_shared_q64_under_exps"} if launch.triton_release(triton.__version__) != (3, 6) else set()
    for r in rows:
        assert r["shared"] <= 227 * 1024, r
        assert r["mma_loops"], f"no MMA loop found in the SASS: {r}"
        assert r["layout"] in may_spill or all(loop["stl"] == 0 and loop["ldl"] <= 1 for loop in r["mma_loops"]), r
        assert all(loop["waits"] < loop["mma"] for loop in r["mma_loops"]), r
    # the forward as it runs by default, Q's codes made in the kernel, per token and per head
    assert {(r["causal"], r["qdo_head"]) for r in rows if r["q_in"]} == {(c, h) for c in (True, False)
                                                                        for h in (True, False)}
    # the persistent forward (Q made in the kernel), dQ and statistics kernels, causal
    assert {(r["kernel"], r["causal"]) for r in rows if r["kernel"].endswith("_persistent")} == {
        ("fwd_persistent", True), ("dq_persistent", True), ("stats_persistent", True)}
    assert all(r["q_in"] for r in rows if r["kernel"] == "fwd_persistent")
    # and the persistent forward with the warpgroups' ping-pong (forward_gluon.PINGPONG) and the trees
    assert {r["d"] for r in rows if r["kernel"] == "fwd_persistent" and r["layout"] and "pingpong" in r["layout"]
            and r["tree"]} == set(forward_gluon.HEAD_DIMS)
    # FlashAttention-3's order within a warpgroup (forward_gluon.PV_UNDER_SCORES): two waits a tile, and
    # a tile's 64 exponentials (64 queries x 128 keys on 128 threads) between them, under the P·V in
    # flight; without gluon_hopper.cta_fence ptxas issues the second wait right after the first
    pv_under = [r for r in rows if r["layout"] == "q_shared_pv_under_s3"]
    assert {r["d"] for r in pv_under} == set(forward_gluon.HEAD_DIMS)
    per_thread = forward_gluon.HALF_Q * forward_gluon.BLOCK_N // 128
    assert all(loop["waits"] == 2 and loop["ex2_between_waits"] >= per_thread
               for r in pv_under for loop in r["mma_loops"]), pv_under
    # and dQ's P exponentials under dP' in flight (backward_dq_gluon.EXP_UNDER_DP): a tile's 32 (64 queries x
    # 64 keys) between S's wait and dP's in the interior loop (ptxas issues dP's after 6 without the fence)
    exp_under_dp = [r for r in rows if r["layout"] == "qdo_registers_k64_exp_under_dp"]
    assert exp_under_dp and all(max(loop["ex2_between_waits"] for loop in r["mma_loops"])
                                >= backward_dq_gluon.HALF_Q * backward_dq_gluon.BLOCK_N // 128 for r in exp_under_dp)
    # dK/dV's products under the next tile's exponentials (backward_dkdv_gluon.PRODUCTS_UNDER_EXPS, causal
    # calls): the interior loop's two waits a tile with its 32 exponentials (64 keys x 64 queries)
    # between them (18-20 without the fence: ptxas issues dV's and dK's wait before the rest)
    under = [r for r in rows if r["layout"] == "kv_shared_q64_under_exps" and r["causal"]]
    assert {r["d"] for r in under} == set(backward_dkdv_gluon.HEAD_DIMS)
    assert all(max(loop["ex2_between_waits"] for loop in r["mma_loops"] if loop["waits"] == 2)
               >= backward_dkdv_gluon.HALF_K * 64 // 128 for r in under), under  # (the diagonal's loop: 3 waits)
    # P's codes reach P·V from the registers they were computed in (gluon_hopper.a_operand_in_place): the
    # forward's loops shuffle only for the two rows' max and sum (2 rows x 2 steps x 2 reductions)
    assert all(loop["shfl"] <= 8 for r in rows if r["kernel"].startswith("fwd") for loop in r["mma_loops"]), rows
    # and dS's (dQ), Pᵀ's and dSᵀ's (dK/dV) likewise: those loops reduce nothing across threads
    assert all(loop["shfl"] == 0 for r in rows if r["kernel"].startswith(("dq", "dkdv")) for loop in r["mma_loops"])
    # the row reductions as trees, the running sums (and the statistics' running maximum of |P·dP'|)
    # per lane (TREE_REDUCTIONS): the longest chain of dependent FMNMX (FADD) in a loop pass is a few
    # levels a tile (the statistics' pass holds two tiles), not the 31 values a row holds in a thread
    # (statistics: 15), in no more instructions (the reshapes move no data; the shuffles of the
    # running statistics leave the loop). With them off Triton 3.6 chains the values one after the
    # other (forward 35 / 34, statistics 22-24 / 17), Triton 3.9 builds trees itself (9 / 8, 12 / 6).
    for kernel in ("fwd", "stats"):
        pairs = {}
        for r in rows:
            if r["kernel"] == kernel and r["layout"] == next(iter(LAYERED[kernel].LAYOUTS)):
                pairs.setdefault((r["d"], r["causal"], r["qdo_head"], r["fma_exponent"], r["q_in"]), {})[r["tree"]] = r
        both = [p for p in pairs.values() if len(p) == 2]
        assert both, (kernel, "no build with the trees on and off")
        for p in both:
            for on, off in zip(p[True]["mma_loops"], p[False]["mma_loops"]):
                assert on["max_chain"] <= 16 and on["add_chain"] <= 16, (kernel, on)
                assert on["instructions"] <= off["instructions"] + 4 and on["shfl"] < off["shfl"], (kernel, on, off)
    # the forward with the one-FMA exponent: its loops and the exact form's (exponent.FMA_EXPONENT)
    fma = [r for r in rows if r["fma_exponent"] and r["kernel"] == "fwd"]
    assert {r["causal"] for r in fma} == {True, False}
    assert all(len(r["mma_loops"]) == 2 * len(exact["mma_loops"]) for r in fma for exact in rows
               if exact["kernel"] == "fwd" and exact["layout"] == r["layout"] and exact["causal"] == r["causal"]
               and not exact["fma_exponent"])


def test_device_checks(monkeypatch):
    """The device half of ``unsupported_reason`` on a stand-in for a CUDA tensor (no GPU here)."""
    if gluon_hopper.gluon is None:
        pytest.skip("this Triton has no Gluon")
    fake = SimpleNamespace(shape=(1, 2, 256, 128), is_cuda=True, device=SimpleNamespace(index=0))
    monkeypatch.setattr(gluon_hopper, "interpreting", lambda: False)
    for module in MODULES:
        monkeypatch.setattr(gluon_hopper, "_capability", lambda index: (8, 9))
        assert "Hopper" in module.unsupported_reason(fake, fake, CAUSAL, FAST, {})
        monkeypatch.setattr(gluon_hopper, "_capability", lambda index: (9, 0))
        assert module.unsupported_reason(fake, fake, CAUSAL, FAST, {}) is None


def test_operand_layouts(monkeypatch):
    """The Gluon kernels' default operand layouts and schedules are the first of their LAYOUTS, and
    the scopes follow the tile of the layout in use (BLOCK_Q, BLOCK_N are read at each call)."""
    for module in LAYERED.values():
        default = tuple(getattr(module, name) for name in module.LAYOUT_CONSTANTS)
        assert next(iter(module.LAYOUTS.values())) == default
        assert all(len(values) == len(module.LAYOUT_CONSTANTS) for values in module.LAYOUTS.values())
    shapes = dict(shape_q=(1, 2, 96, 128), shape_k=(1, 2, 128, 128), mask=MaskSpec())
    assert "need multiples of 64 / 128" in _reason(**shapes)
    monkeypatch.setattr(backward_dkdv_gluon, "BLOCK_Q", backward_dkdv_gluon.LAYOUTS["kv_registers_q32"][1])
    assert _reason(**shapes) is None
    shapes = dict(shape_q=(1, 2, 128, 128), shape_k=(1, 2, 192, 128), mask=MaskSpec(), module=backward_dq_gluon)
    assert _reason(**shapes) is None
    monkeypatch.setattr(backward_dq_gluon, "BLOCK_N", backward_dq_gluon.LAYOUTS["qdo_shared_k128"][1])
    assert "need multiples of 128 / 128" in _reason(**shapes)


def test_the_forward_quantizes_rotated_16_bit_q_itself(monkeypatch):
    """``forward_gluon.q_quantization_reason``: the Gluon forward makes Q's codes itself for the rotated
    recipes' 16-bit Q with contiguous channels (the GPU tests check they are the quantization
    launch's codes, bit for bit); otherwise the launch makes them, and the reason says why."""
    monkeypatch.setattr(forward_gluon, "cvt_mode", lambda: 0)  # the GPU's conversion
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    reason = forward_gluon.q_quantization_reason
    for recipe in ("fp8_delta", "fp8_delta_fast", "fp8_stale", "fp8_stale_fast"):
        config = FP8AttentionConfig.from_recipe(recipe)
        assert reason(q, config, True) is None
        assert reason(q.half(), config, True) is None
    delta = FP8AttentionConfig.from_recipe("fp8_delta")
    assert "rotated" in reason(q, FP8AttentionConfig.from_recipe("fp8_delta", hadamard=False), True)
    assert "float32" in reason(q.float(), delta, True)
    assert "contiguous" in reason(q.transpose(2, 3), delta, True)
    assert "not causal" in reason(q, delta, False)  # measured slower there: the launch makes them
    monkeypatch.setattr(forward_gluon, "QUANTIZE_Q_NONCAUSAL", True)
    assert reason(q, delta, False) is None
    monkeypatch.setattr(forward_gluon, "cvt_mode", lambda: 1)
    assert "conversion" in reason(q, delta, True)
    monkeypatch.setattr(forward_gluon, "cvt_mode", lambda: 0)
    monkeypatch.setattr(forward_gluon, "QUANTIZE_Q", False)
    assert "QUANTIZE_Q" in reason(q, delta, True)


class _Stop(Exception):
    """Raised by :func:`_copies_spy` once it has seen its launches."""


def _copies_spy(calls: int = 1):
    """A stand-in for ``stats_then_copies``: records each call's ``Copies`` in the list it returns and
    raises :class:`_Stop` from call ``calls`` on (earlier calls get empty copies), so that no kernel runs."""
    seen = []

    def spy(xs, copies, **kwargs):
        seen.append(copies)
        if len(seen) >= calls:
            raise _Stop
        return None, [(None, ) * 5] * 2

    return seen, spy


@pytest.mark.parametrize("gluon, triton_in_place", [(True, False), (False, True), (False, False)])
def test_vt_comes_in_the_forwards_pv_order(gluon, triton_in_place, monkeypatch):
    """The K/V launch writes Vᵀ's keys in the P·V order (``Copies.col_pv``) of the forward that runs:
    the Gluon one's (``forward_gluon.P_IN_PLACE``: the order ``gluon_hopper.a_operand_in_place`` takes
    P's codes in), the Triton one's with ``forward.P_IN_PLACE_TRITON``; else in token order."""
    seen, spy = _copies_spy()
    monkeypatch.setattr(forward, "gluon_runs", lambda *args: gluon)
    monkeypatch.setattr(forward, "P_IN_PLACE_TRITON", triton_in_place)
    monkeypatch.setattr(forward, "stats_then_copies", spy)
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(_Stop):
        forward.triton_forward(q, q, q, scale=1.0, mask=CAUSAL, config=FP8AttentionConfig.from_recipe("fp8_delta"))
    k_copies, v_copies = seen[0]
    assert v_copies.col and v_copies.col_pv is (gluon or triton_in_place)
    monkeypatch.setattr(forward_gluon, "P_IN_PLACE", False)  # P moved to the A operand's layout instead
    with pytest.raises(_Stop):
        forward.triton_forward(q, q, q, scale=1.0, mask=CAUSAL, config=FP8AttentionConfig.from_recipe("fp8_delta"))
    assert seen[-1][1].col_pv is (not gluon and triton_in_place)  # the Triton forward's rule alone
    assert not k_copies.col_pv


@pytest.mark.parametrize("dq, dkdv, one_sweep", [(True, True, False), (True, False, False), (False, True, False),
                                                 (True, True, True)])
@pytest.mark.parametrize("triton_in_place", [False, True])
def test_backward_copies_come_in_the_kernels_orders(dq, dkdv, one_sweep, triton_in_place, monkeypatch):
    """Where the Gluon dQ launch runs, K's channel-wise copy holds its keys in the order it takes dS's
    codes in, and where the Gluon dK/dV launch runs, Q's and dO's theirs (``Copies.col_pv``); the
    Triton launches (the one-sweep dQ among them) take that order with ``backward.A_IN_PLACE_TRITON``,
    else token order."""
    seen, spy = _copies_spy(calls=2)
    runs = {"gluon_dq": dq, "gluon_dkdv": dkdv}
    monkeypatch.setattr(backward, "_gluon_runs", lambda module, key, *args: runs.get(key, False))
    monkeypatch.setattr(backward, "A_IN_PLACE_TRITON", triton_in_place)
    monkeypatch.setattr(backward, "stats_then_copies", spy)
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 256)
    config = FP8AttentionConfig.from_recipe("fp8_delta", dq_in_stats=one_sweep)
    with pytest.raises(_Stop):
        backward.triton_backward(q, q, q, q, lse, q, scale=1.0, mask=CAUSAL, config=config)
    (qc, doc), (kc, vc) = seen
    assert qc.col_pv is (dkdv or triton_in_place) and doc.col_pv is (dkdv or triton_in_place)
    assert kc.col_pv is (dq and not one_sweep or triton_in_place)
    assert not vc.col_pv


@pytest.mark.parametrize("triton_in_place", [True, False])
@pytest.mark.parametrize("dq", [True, False])
def test_handed_over_k_copy_comes_in_the_order_its_dq_takes(dq, triton_in_place, monkeypatch):
    """A forward that hands K's copies over (``forward.HAND_OVER_KV_COPIES``) makes K's channel-wise
    copy in the order the backward's dQ launch will take (``backward.dq_keys_in_pv_order``): the Gluon
    launch's, else the Triton one's (``backward.A_IN_PLACE_TRITON``)."""
    seen, spy = _copies_spy()
    monkeypatch.setattr(backward, "A_IN_PLACE_TRITON", triton_in_place)
    monkeypatch.setattr(forward, "HAND_OVER_KV_COPIES", True)
    monkeypatch.setattr(forward, "takes_kv_copies", lambda *args: True)
    monkeypatch.setattr(forward, "gluon_runs", lambda *args: False)
    monkeypatch.setattr(backward, "_gluon_runs", lambda module, key, *args: dq and key == "gluon_dq")
    monkeypatch.setattr(forward, "stats_then_copies", spy)
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(_Stop):
        forward.triton_forward(q, q, q, scale=1.0, mask=CAUSAL, config=FP8AttentionConfig.from_recipe("fp8_delta"),
                               for_backward={})
    (k_copies, v_copies), = seen
    assert k_copies.col and k_copies.col_pv is (dq or triton_in_place)
    assert v_copies.col_pv is forward.P_IN_PLACE_TRITON  # the Triton forward's P·V order


@pytest.mark.parametrize("handed_in_place", [True, False])
def test_a_handed_over_copy_in_the_other_order_is_refused(handed_in_place, monkeypatch):
    """K's channel-wise copy handed over in one order (the dQ launch's in-place operand order, or
    token order) meets a backward whose Triton dQ launch takes the other (``A_IN_PLACE_TRITON``): a
    RuntimeError naming both, not a wrong gradient (K and V may be stand-ins then, so no copy can be
    made instead)."""
    monkeypatch.setattr(backward, "A_IN_PLACE_TRITON", not handed_in_place)
    monkeypatch.setattr(backward, "_gluon_runs", lambda *args: False)
    monkeypatch.setattr(backward, "stats_then_copies", lambda xs, copies, **kwargs: (None, [(None, ) * 5] * 2))
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    handed = [((None, ) * 5, (None, ) * 5, handed_in_place)]
    orders = ("in-place operand order", "token order") if handed_in_place else ("token order", "in-place operand order")
    with pytest.raises(RuntimeError, match="handed over by the forward holds its keys in .*{}, this backward's dQ "
                                           "launch takes .*{}".format(*orders)):
        backward.triton_backward(q, q, q, q, torch.zeros(1, 2, 256), q, scale=1.0, mask=CAUSAL,
                                 config=FP8AttentionConfig.from_recipe("fp8_delta"), kv_copies=handed)
    assert handed == []  # taken out, as a matching one is
