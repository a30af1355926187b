"""EXPERIMENT (not used by the package): the fast recipe's fused dK/dV launch in Gluon, warp-specialised,
with K and V held in registers.

Why (benchmarks/NOTES.md, "Backward", the shared-memory model of the fused dK/dV loop): the Triton
launch runs 64 keys x 32 queries per iteration on one warpgroup and reads all four MMAs' operands
from shared memory, K and V included (48 KB of shared-memory traffic per iteration against 256
clocks of FP8 MMA: 384 clocks at 128 B per clock). Here, as in FlashAttention-3's backward:

- a producer warp brings each query tile's four FP8 copies (Q and dO row-wise for Sᵀ and dPᵀ, Qᵀ
  and dOᵀ channel-wise for dK and dV) by TMA into a STAGES-deep ring, with its LSE' and D' values;
- two consumer warpgroups own 64 keys each (128 per CTA) and share every query tile, so each tile
  is copied once for 128 keys; each holds its K and V codes in registers (the A operand of Sᵀ =
  K Qᵀ and dP'ᵀ = V dOᵀ), so per 64 keys and 32 queries the tensor cores read 16 KB of shared
  memory instead of 32, and the ring's writes are shared by both warpgroups.

Scope: `fp8_delta_fast` (one scale per head for Q, K, V and dO, channel scales per sequence, P on
the fixed grid, dS per head), head dim 128, dense batches without GQA, causal or not, sequence
lengths a multiple of 128, no soft-cap or sinks. The harness runs the package's backward, takes the
arguments of its fused dK/dV launch (the FP8 copies and statistics that launch reads), runs this
kernel on them and compares dK and dV with the Triton launch's.

Status: superseded by the package's ``kernels/backward_dkdv_gluon.py`` (GQA, the factors formed in
the kernel). On the H200 this version matched the Triton launch's dK and dV (to 7e-5) and took
1.38 ms against its 1.84 at B = 2, H = 16, S = 8192, causal (results/h200_v31_gluon_dkdv_ws.log).

    python benchmarks/experiments/gluon_dkdv_ws.py                   # on a Hopper GPU: check, then time
    python benchmarks/experiments/gluon_dkdv_ws.py --compile-only    # any machine: sm_90a build
    TRITON_INTERPRET=1 python benchmarks/experiments/gluon_dkdv_ws.py --check-operands  # any machine
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gluon_forward import _descriptor, gluon  # noqa: E402  (Gluon's imports and the TMA pieces live there)

D, BLOCK_Q, HALF_K, STAGES = 128, 32, 64, 3  # head dim; queries per tile; keys per warpgroup; ring depth
BLOCK_K = 2 * HALF_K
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 240, 24, 168

if gluon is not None:
    from gluon_forward import _tma_load, gl, mbarrier, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def _producer(q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, q_smem, do_smem, qt_smem, dot_smem, k_smem,
                  v_smem, lse_smem, dl_smem, kv_bar, ready, empty, lse2_ptr, delta_ptr, row_q0, row_k0, row_t0,
                  n0, t_lo, t_hi, BLOCK_Q: gl.constexpr, HALF_K: gl.constexpr, STAGES: gl.constexpr):
        """One warp: the CTA's K and V tiles (two 64-key halves each) once, then per query tile t its
        four FP8 copies (TMA) and its LSE' and D' (plain loads, shared stores) into slot (t − t_lo) % STAGES."""
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for w in gl.static_range(2):
            _tma_load(k_desc, [row_k0 + n0 + w * HALF_K, 0], kv_bar, k_smem.index(w))
            _tma_load(v_desc, [row_k0 + n0 + w * HALF_K, 0], kv_bar, v_smem.index(w))
        vec: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        offs = gl.arange(0, BLOCK_Q, layout=vec)
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + qt_desc.block_type.nbytes
                                + dot_desc.block_type.nbytes)
        for t in range(t_lo, t_hi):
            i = t - t_lo
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # the first round does not wait
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            q0 = t * BLOCK_Q
            _tma_load(q_desc, [row_q0 + q0, 0], bar, q_smem.index(slot))
            _tma_load(do_desc, [row_q0 + q0, 0], bar, do_smem.index(slot))
            _tma_load(qt_desc, [row_t0, q0], bar, qt_smem.index(slot))
            _tma_load(dot_desc, [row_t0, q0], bar, dot_smem.index(slot))
            lse_smem.index(slot).store(gl.load(lse2_ptr + row_q0 + q0 + offs))
            dl_smem.index(slot).store(gl.load(delta_ptr + row_q0 + q0 + offs))
            mbarrier.arrive(bar, count=1)  # the slot's second arrival (expect is the first)

    @gluon.jit
    def _consumer_tiles(t_a, t_b, t_lo, dk, dv, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem, lse_smem, dl_smem,
                        ready, empty, keys, s_mul, ds_mul, MASKED: gl.constexpr, BLOCK_Q: gl.constexpr,
                        STAGES: gl.constexpr, s_layout: gl.constexpr, pa_layout: gl.constexpr):
        """Query tiles t_a <= t < t_b into one warpgroup's dK and dV (the Triton launch's
        ``_dkdv_tiles`` for the fast recipe, one exponential per element)."""
        zero_s = gl.zeros([keys.shape[0], BLOCK_Q], gl.float32, s_layout)
        cols: gl.constexpr = gl.SliceLayout(0, s_layout)
        for t in range(t_a, t_b):
            i = t - t_lo
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            st = warpgroup_mma(k_reg, q_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_reg, do_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
            lse2 = lse_smem.index(slot).load(cols)
            pt = gl.exp2(st * s_mul - gl.expand_dims(lse2, 0))  # 448 · Pᵀ (LSE' carries −log2 448)
            if MASKED:
                pos_q = t * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=cols)
                pt = gl.where(gl.expand_dims(pos_q, 0) >= gl.expand_dims(keys, 1), pt, 0.0)
            p8 = gl.convert_layout(pt.to(gl.float8e4nv), pa_layout)
            dv = warpgroup_mma(p8, dot_smem.index(slot).permute((1, 0)), dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
            delta = dl_smem.index(slot).load(cols)
            dst = pt * (dpt - gl.expand_dims(delta, 0)) * ds_mul
            ds8 = gl.convert_layout(dst.to(gl.float8e4nv), pa_layout)
            dk = warpgroup_mma(ds8, qt_smem.index(slot).permute((1, 0)), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(empty.index(slot), count=1)
        return dk, dv

    @gluon.jit
    def _consumer(q_smem, do_smem, qt_smem, dot_smem, k_smem, v_smem, lse_smem, dl_smem, kv_bar, ready, empty,
                  cq_ptr, cdo_ptr, dk_ptr, dv_ptr, row_k0, n0, t_lo, t_m, t_hi, s_mul, ds_mul, tau,
                  WG: gl.constexpr, BLOCK_Q: gl.constexpr, HALF_K: gl.constexpr, D: gl.constexpr,
                  CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup: keys n0 + WG·64 .. + 64 of the CTA; writes their dK and dV."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_Q, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 32])
        ka_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=4)
        pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        keys = n0 + WG * HALF_K + gl.arange(0, HALF_K, layout=gl.SliceLayout(1, s_layout))
        mbarrier.wait(kv_bar, 0)
        k_reg = k_smem.index(WG).load(ka_layout)
        v_reg = v_smem.index(WG).load(ka_layout)
        dk = gl.zeros([HALF_K, D], gl.float32, o_layout)
        dv = gl.zeros([HALF_K, D], gl.float32, o_layout)
        if CAUSAL:  # the CTA's diagonal tiles, masked; then every later query tile sees every key
            dk, dv = _consumer_tiles(t_lo, t_m, t_lo, dk, dv, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem,
                                     lse_smem, dl_smem, ready, empty, keys, s_mul, ds_mul, True, BLOCK_Q, STAGES,
                                     s_layout, pa_layout)
        dk, dv = _consumer_tiles(t_m, t_hi, t_lo, dk, dv, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem,
                                 lse_smem, dl_smem, ready, empty, keys, s_mul, ds_mul, False, BLOCK_Q, STAGES,
                                 s_layout, pa_layout)
        chan = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        dk = dk * gl.expand_dims(gl.load(cq_ptr + chan) * tau, 0)
        dv = dv * gl.expand_dims(gl.load(cdo_ptr + chan) * (1.0 / 448.0), 0)
        rows = gl.expand_dims(row_k0 + n0 + WG * HALF_K + gl.arange(0, HALF_K, layout=gl.SliceLayout(1, o_layout)), 1)
        off = rows.to(gl.int64) * D + gl.expand_dims(chan, 0)
        gl.store(dk_ptr + off, dk.to(dk_ptr.dtype.element_ty))
        gl.store(dv_ptr + off, dv.to(dv_ptr.dtype.element_ty))

    @gluon.jit
    def _ws_dkdv_kernel(
        q_desc, do_desc,  # row-wise codes of Q and dO: (B·H·Sq, D), boxes (BLOCK_Q, D)
        qt_desc, dot_desc,  # channel-wise transposed codes: (B·H·D, Sq_pad), boxes (D, BLOCK_Q)
        k_desc, v_desc,  # row-wise codes of K and V: (B·H·Sk, D), boxes (HALF_K, D)
        lse2_ptr, delta_ptr,  # (B·H, Sq) fp32: LSE' − log2 448 and D'
        head_ptr,  # (B·H, 4) fp32 per head: s_mul (Q's, K's scales and the softmax scale), ds_mul, unused
        cq_ptr, cdo_ptr,  # (B·H, D) fp32: dK's and dV's channel factors (Q's scales · dS's, dO's)
        dk_ptr, dv_ptr,  # (B, H, Sk, D) in the input dtype
        SQ, SK, tau,
        BLOCK_Q: gl.constexpr, HALF_K: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        BLOCK_K: gl.constexpr = 2 * HALF_K
        n_blk = gl.num_programs(0)
        pid = n_blk - 1 - gl.program_id(0) if not CAUSAL else gl.program_id(0)  # causal: longest key blocks first
        bh = gl.program_id(1)
        n0 = pid * BLOCK_K
        row_q0 = bh * SQ
        row_k0 = bh * SK
        row_t0 = bh * D
        t_hi = SQ // BLOCK_Q
        if CAUSAL:
            t_lo = n0 // BLOCK_Q
            t_m = gl.minimum((n0 + BLOCK_K) // BLOCK_Q, t_hi)
        else:
            t_lo = 0
            t_m = 0
        s_mul = gl.load(head_ptr + bh * 4)
        ds_mul = gl.load(head_ptr + bh * 4 + 1)
        cq = cq_ptr + bh * D
        cdo = cdo_ptr + bh * D

        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        qt_smem = gl.allocate_shared_memory(qt_desc.dtype, [STAGES] + qt_desc.block_type.shape, qt_desc.layout)
        dot_smem = gl.allocate_shared_memory(dot_desc.dtype, [STAGES] + dot_desc.block_type.shape, dot_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_Q], vec_layout)
        dl_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_Q], vec_layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=2)  # the producer's expect (TMA bytes) and its vector stores
            mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups

        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, qt_smem, dot_smem, k_smem, v_smem, lse_smem, dl_smem, kv_bar, ready, empty,
                         cq, cdo, dk_ptr, dv_ptr, row_k0, n0, t_lo, t_m, t_hi, s_mul, ds_mul, tau, 0, BLOCK_Q,
                         HALF_K, D, CAUSAL, STAGES)),
            (_consumer, (q_smem, do_smem, qt_smem, dot_smem, k_smem, v_smem, lse_smem, dl_smem, kv_bar, ready, empty,
                         cq, cdo, dk_ptr, dv_ptr, row_k0, n0, t_lo, t_m, t_hi, s_mul, ds_mul, tau, 1, BLOCK_Q,
                         HALF_K, D, CAUSAL, STAGES)),
            (_producer, (q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, q_smem, do_smem, qt_smem, dot_smem,
                         k_smem, v_smem, lse_smem, dl_smem, kv_bar, ready, empty, lse2_ptr, delta_ptr, row_q0,
                         row_k0, row_t0, n0, t_lo, t_hi, BLOCK_Q, HALF_K, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _codes_descriptor(codes_2d: torch.Tensor, block: list[int]):
    """TMA descriptor of a 2-D view of FP8 codes, ``block``-shaped boxes in the default MMA layout."""
    return _descriptor(codes_2d, block, gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv))


def captured_dkdv_launch(q, k, v, do, causal: bool):
    """Run the package's backward of ``fp8_delta_fast`` and return its fused dK/dV launch:
    ``(kernel, grid, args, kwargs)`` as ``backward._run_prequant`` received them (dK and dV filled)."""
    from hf_fp8_attention import RECIPES
    from hf_fp8_attention.kernels import backward
    from hf_fp8_attention.kernels.forward import triton_forward
    from hf_fp8_attention.masking import MaskSpec

    config, mask, scale = RECIPES["fp8_delta_fast"], MaskSpec(causal=causal), q.shape[-1] ** -0.5
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config)
    seen = []
    run = backward._run_prequant

    def capture(kernel, grid, launch, dp, args, kwargs):
        run(kernel, grid, launch, dp, args, kwargs)
        if kernel is backward.bwd_dkdv_fp8_kernel:
            seen.append((kernel, grid, launch, dp, args, kwargs))
    backward._run_prequant = capture
    try:
        backward.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    finally:
        backward._run_prequant = run
    (launch,) = seen
    return launch


def gluon_operands(args: tuple, kwargs: dict) -> tuple:
    """This kernel's arguments from the Triton launch's: the descriptors of the same codes, LSE'
    shifted by log2 448, and per head the factors the Triton kernel forms from its scale vectors."""
    (qr, qrs, qct, qcs, kr, krs, vr, vrs, dor, dors, doct, docs, lse2, _lse2do, delta, dk, dv, _cu_q, _cu_k,
     _toff, _shift, ds_bound, hq, g, sq, sk, _sq_pad, _nt_q, _sq, _sk, _window, qk_scale, tau, _cap) = args
    if g != 1 or not (kwargs["KV_HEAD"] and kwargs["COL_SEQ"] and kwargs["P_FIXED"] and kwargs["DS_HEAD"]
                      and kwargs["QDO_HEAD"]) or kwargs["SOFTCAP"] or kwargs["ROW_SHIFT"] or kwargs["VARLEN"]:
        raise ValueError("the Gluon dK/dV kernel runs the fast recipe, dense, without GQA or logit modifiers")
    bh = qr.shape[0] * qr.shape[1]
    f32 = torch.float32
    sk_head = krs.reshape(bh, -1)[:, 0] * torch.tensor(qk_scale, dtype=f32, device=qr.device)
    s_mul = qrs.reshape(bh, -1)[:, 0] * sk_head  # the Triton kernel's sq · sk
    sdo = dors.reshape(bh, -1)[:, 0] * vrs.reshape(bh, -1)[:, 0]
    amax = ds_bound.view(f32)
    ds_scale = torch.where(amax == 0, 1.0, torch.clamp_min(amax / torch.tensor(448.0, device=qr.device), 2.0**-126))
    ds_mul = (sdo * torch.tensor(1.0 / 448.0, dtype=f32, device=qr.device)) * (1.0 / ds_scale)
    head = torch.stack([s_mul, ds_mul, torch.zeros_like(s_mul), torch.zeros_like(s_mul)], dim=1).contiguous()
    cq = (qcs[:, :, 0, :].reshape(bh, D) * ds_scale[:, None]).contiguous()
    cdo = docs[:, :, 0, :].reshape(bh, D).contiguous()
    lse2_shifted = (lse2 - torch.tensor(8.807354922057604, dtype=f32, device=qr.device)).contiguous()
    descs = (_codes_descriptor(qr.view(-1, D), [BLOCK_Q, D]), _codes_descriptor(dor.view(-1, D), [BLOCK_Q, D]),
             _codes_descriptor(qct.view(-1, qct.shape[-1]), [D, BLOCK_Q]),
             _codes_descriptor(doct.view(-1, doct.shape[-1]), [D, BLOCK_Q]),
             _codes_descriptor(kr.view(-1, D), [HALF_K, D]), _codes_descriptor(vr.view(-1, D), [HALF_K, D]))
    return descs, lse2_shifted, delta, head, cq, cdo, torch.empty_like(dk), torch.empty_like(dv), sq, sk, float(tau)


def emulated_dkdv(args: tuple, operands: tuple, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This kernel's maths in PyTorch (fp32, one head at a time) on ``gluon_operands``' factors and
    the Triton launch's codes: checks the operands' derivation on any machine."""
    qr, qct, kr, vr, dor, doct = args[0], args[2], args[4], args[6], args[8], args[10]
    _, lse2, delta, head, cq, cdo, dk, dv, sq, sk, tau = operands
    fp8 = torch.float8_e4m3fn

    def cast(x):  # the kernels' saturating RNE cast
        return x.clamp(-448.0, 448.0).to(fp8).float()
    for i in range(head.shape[0]):
        b, h = divmod(i, qr.shape[1])
        st = (kr[b, h].float() @ qr[b, h].float().T) * head[i, 0]  # (Sk, Sq)
        pt = torch.exp2(st - lse2[i][None, :])
        if causal:
            pt = torch.where(torch.arange(sq)[None, :] >= torch.arange(sk)[:, None], pt, 0.0)
        dpt = vr[b, h].float() @ dor[b, h].float().T
        dst = pt * (dpt - delta[i][None, :]) * head[i, 1]
        dv[b, h] = ((cast(pt) @ doct[b, h, :, :sq].float().T) * cdo[i] * (1.0 / 448.0)).to(dv.dtype)
        dk[b, h] = ((cast(dst) @ qct[b, h, :, :sq].float().T) * cq[i] * tau).to(dk.dtype)
    return dk, dv


def check_operands() -> int:
    """Any machine (the Triton interpreter on a CPU): :func:`emulated_dkdv` on the captured launch's
    operands against the launch's own dK and dV."""
    torch.manual_seed(0)
    worst = 0.0
    for causal in (True, False):
        q, k, v, do = (torch.randn(1, 2, 256, D, dtype=torch.float32) for _ in range(4))
        kernel, grid, _, _, args, kwargs = captured_dkdv_launch(q, k, v, do, causal)
        ops = gluon_operands(args, kwargs)
        got_dk, got_dv = emulated_dkdv(args, ops, causal)
        rel = [((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()
               for x, y in ((got_dk, args[15]), (got_dv, args[16]))]
        worst = max(worst, *rel)
        print(f"causal={causal}: emulated operands against the launch: rel dK {rel[0]:.1e}, rel dV {rel[1]:.1e}")
    return 0 if worst < 1e-3 else 1


def gluon_dkdv(operands: tuple, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    descs, lse2, delta, head, cq, cdo, dk, dv, sq, sk, tau = operands
    bh = head.shape[0]
    _ws_dkdv_kernel[(sk // BLOCK_K, bh)](
        *descs, lse2, delta, head, cq, cdo, dk, dv, sq, sk, tau,
        BLOCK_Q=BLOCK_Q, HALF_K=HALF_K, D=D, CAUSAL=causal, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)
    return dk, dv


def check_and_time() -> int:
    """On a Hopper GPU: dK and dV against the Triton launch's on the same operands, then both launches timed."""
    from triton.testing import do_bench

    from hf_fp8_attention.kernels.launch import launch as launch_kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    for causal in (True, False):
        for b, h, s in ((1, 2, 256), (1, 4, 1024), (2, 16, 8192)):
            q, k, v, do = (torch.randn(b, h, s, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(4))
            kernel, grid, _, _, args, kwargs = captured_dkdv_launch(q, k, v, do, causal)
            want_dk, want_dv = args[15].clone(), args[16].clone()
            ops = gluon_operands(args, kwargs)
            got_dk, got_dv = gluon_dkdv(ops, causal)
            rel = [((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()
                   for x, y in ((got_dk, want_dk), (got_dv, want_dv))]
            line = f"B={b} H={h} S={s} causal={causal}: rel dK {rel[0]:.1e}, rel dV {rel[1]:.1e}"
            if s >= 8192:
                t_triton = do_bench(lambda: launch_kernel(kernel, grid, *args, **kwargs))
                t_gluon = do_bench(lambda: gluon_dkdv(ops, causal))
                line += (f"; Triton launch {t_triton * 1e3:.0f} us, Gluon {t_gluon * 1e3:.0f} us "
                         f"({t_triton / t_gluon:.2f}x)")
            print(line, flush=True)
    return 0


def compile_offline(causal: bool = True):
    """Build for sm_90a on any machine (no GPU): the CompiledKernel (asm: ttgir, ptx, cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(shape):
        lay = gl.NVMMASharedLayout.get_default_for(list(shape), gl.float8e4nv)
        return f"tensordesc<fp8e4nv[{shape[0]},{shape[1]}],{lay!r}>"

    names = list(_ws_dkdv_kernel.arg_names)
    sig = {n: "i32" for n in names}
    sig.update(q_desc=desc((BLOCK_Q, D)), do_desc=desc((BLOCK_Q, D)), qt_desc=desc((D, BLOCK_Q)),
               dot_desc=desc((D, BLOCK_Q)), k_desc=desc((HALF_K, D)), v_desc=desc((HALF_K, D)),
               lse2_ptr="*fp32", delta_ptr="*fp32", head_ptr="*fp32", cq_ptr="*fp32", cdo_ptr="*fp32",
               dk_ptr="*bf16", dv_ptr="*bf16", tau="fp32")
    consts = dict(BLOCK_Q=BLOCK_Q, HALF_K=HALF_K, D=D, CAUSAL=causal, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
                  PRODUCER_REGS=PRODUCER_REGS)
    for n in consts:
        sig[n] = "constexpr"
    src = GluonASTSource(_ws_dkdv_kernel, sig, constexprs={(names.index(n), ): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAXNREG))


def main(argv: list[str]) -> int:
    if gluon is None:
        print("this Triton has no Gluon")
        return 1
    if "--check-operands" in argv:
        return check_operands()
    if "--compile-only" in argv:
        for causal in (True, False):
            kernel = compile_offline(causal)
            print(f"causal={causal}: compiled for sm_90a, shared memory {kernel.metadata.shared} B", flush=True)
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("the check needs a Hopper (sm_90) GPU")
        return 2
    return check_and_time()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
