"""How fast fp32 atomics accumulate dQ on the GPU, for a backward that forms dQ in its dK/dV launch
(FlashAttention-2/3's schedule: each key-block program adds its dS·K partial of every query tile it
visits into an fp32 dQ buffer, instead of a separate dQ launch recomputing S and dP).

The probe issues exactly those additions with no maths around them: grid (key blocks of 128, B·H),
each program walks its causal query tiles of 64 rows and adds one (64, D) fp32 tile per visit into
``dq_acc (B·H·S, D)``. Forms timed (CUDA-graph median, ``triton.testing.do_bench_cudagraph``):

- ``store``: plain stores of the same tiles (what the bytes cost without the read-modify-write);
- ``atomic``: ``tl.atomic_add(..., sem="relaxed")`` (one 4-byte atomic per element in Triton 3.6,
  ``atom.global.add.f32``; 3.9 emits ``red``);
- ``red_v2`` / ``red_v4``: ``red.global.add.v2.f32`` / ``.v4.f32`` by inline PTX, two / four
  neighbouring elements per instruction (sm_90's vector reductions; a wgmma accumulator holds
  pairs of neighbours per thread, so v2 needs no layout change there);
- ``*_x2``: each tile added twice (two consumer warpgroups adding their own 64-key partials
  instead of one summed partial).

Printed: ms and the effective rate in GB/s of fp32 payload. The dQ launch this would replace took
~0.80 ms at S = 8k causal, B = 2, H = 16, d = 128 (benchmarks/NOTES.md, "Backward").

    python benchmarks/experiments/atomic_dq_probe.py [--seq 8192 --batch 2 --heads 16 --dim 128]
"""
from __future__ import annotations

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _red(ptrs, vals, VEC: gl.constexpr):
    """``red.global.add.v{VEC}.f32`` of ``vals`` at ``ptrs``, VEC neighbouring elements per
    instruction (each thread must hold them contiguously: the layout's size_per_thread)."""
    if VEC == 4:
        asm: gl.constexpr = ("red.global.gpu.relaxed.add.v4.f32 [$4], {$8, $9, $10, $11}; "
                             "mov.u32 $0, 0; mov.u32 $1, 0; mov.u32 $2, 0; mov.u32 $3, 0;")
        cons: gl.constexpr = "=r,=r,=r,=r,l,l,l,l,r,r,r,r"
    else:
        asm: gl.constexpr = "red.global.gpu.relaxed.add.v2.f32 [$2], {$4, $5}; mov.u32 $0, 0; mov.u32 $1, 0;"
        cons: gl.constexpr = "=r,=r,l,l,r,r"
    return gl.inline_asm_elementwise(asm, cons, [ptrs, vals.to(gl.int32, bitcast=True)], dtype=gl.int32,
                                     is_pure=False, pack=VEC)


@gluon.jit
def _add_tiles(DQ, SQ, BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr, D: gl.constexpr, MODE: gl.constexpr,
               TIMES: gl.constexpr, CAUSAL: gl.constexpr, VEC: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // D if D < 32 * VEC else 1,
                                                       32 if D >= 32 * VEC else D // VEC], [4, 1], [1, 0])
    pid = gl.program_id(0)
    bh = gl.program_id(1)
    rows = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    val = (gl.expand_dims(rows, 1) * D + gl.expand_dims(cols, 0)).to(gl.float32) * 1e-6
    t_lo = pid * (BLOCK_K // BLOCK_Q) if CAUSAL else 0
    for t in range(t_lo, SQ // BLOCK_Q):
        ptrs = DQ + gl.expand_dims((bh * SQ + t * BLOCK_Q + rows).to(gl.int64) * D, 1) + gl.expand_dims(cols, 0)
        for _ in gl.static_range(TIMES):
            if MODE == 0:
                gl.store(ptrs, val)
            elif MODE == 1:
                gl.atomic_add(ptrs, val, sem="relaxed")
            else:
                _red(ptrs, val, VEC)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--non-causal", action="store_true")
    a = p.parse_args(argv)
    s, bh, d, causal = a.seq, a.batch * a.heads, a.dim, not a.non_causal
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
          f"S={s} B·H={bh} D={d} causal={causal}")
    acc = torch.zeros(bh * s, d, device="cuda", dtype=torch.float32)
    n_kb = s // 128
    visits = sum((s // 64) - (kb * 2 if causal else 0) for kb in range(n_kb)) * bh
    for name, mode, times, vec in (("store", 0, 1, 4), ("atomic", 1, 1, 4), ("red_v2", 2, 1, 2),
                                   ("red_v4", 2, 1, 4), ("atomic_x2", 1, 2, 4), ("red_v4_x2", 2, 2, 4)):
        def run():
            _add_tiles[(n_kb, bh)](acc, s, BLOCK_Q=64, BLOCK_K=128, D=d, MODE=mode, TIMES=times, CAUSAL=causal,
                                   VEC=vec, num_warps=4)
        run()
        ms = triton.testing.do_bench_cudagraph(run, rep=50)
        payload = visits * times * 64 * d * 4
        print(f"  {name:<10} {ms:7.3f} ms  {payload / ms / 1e6:7.0f} GB/s  ({payload / 1e9:.2f} GB)", flush=True)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
