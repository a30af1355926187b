"""GPU time of the forward's K/V quantization launch (K's rotated, smoothed row-wise copy and V's
channel-wise copy, from the sequence statistics), the pair as the forward runs it against K and V
each alone, under variants of ``quantize.ROTATED_LAUNCH`` (the pair's and K's table; V alone takes
the plain ``QUANT_LAUNCH``, and is timed on the pair's table too): which operand the launch waits
on, and whether two launches would beat one. Every variant's codes and scales are compared bit for
bit with the default table's (the tables change the speed only).

    python benchmarks/experiments/kv_quant_split.py [--only LABEL,LABEL] [--recipes fp8_delta,...]
    ncu --section SpeedOfLight -k regex:quantize_kernel --launch-skip 3 --launch-count 1 \
        python benchmarks/experiments/kv_quant_split.py --recipes fp8_delta --pair-only 5

Shape: (2, 16, 8192, 128) bf16, Gaussian. CUDA-graph medians (``triton.testing.do_bench_cudagraph``);
TB/s over one read of each input and one write of its codes and scales.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention.kernels import quantize as qz  # noqa: E402
from hf_fp8_attention.kernels.operands import backward_kv_copies, copies_for, stats_for  # noqa: E402
from quantize_bench import _time_us  # noqa: E402
from recipe_names import recipe_config  # noqa: E402

# (label, ROTATED_LAUNCH entries over the default)
VARIANTS = (("default", {}), ("tiles 1", {"tiles": None}), ("tiles 4", {"tiles": 4}),
            ("row 32", {"row_chunk": 32}), ("col 32", {"col_group": 32}), ("col 128", {"col_group": 128}),
            ("4 warps", {"num_warps": 4}),
            ("4 warps row 32 col 32", {"num_warps": 4, "row_chunk": 32, "col_group": 32}),
            ("tiles 4, 4 warps row 32 col 32", {"tiles": 4, "num_warps": 4, "row_chunk": 32, "col_group": 32}),
            ("stages 2", {"row_stages": 2}), ("no cap", {"maxnreg": None}))


def _same(got, ref) -> bool:
    return all((g is None and r is None) or (g is not None and torch.equal(g, r))
               for go, ro in zip(got, ref) for g, r in zip(go, ro))


def main():
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    recipes = (sys.argv[sys.argv.index("--recipes") + 1].split(",") if "--recipes" in sys.argv
               else ("fp8_delta", "fp8_delta_fast"))
    torch.manual_seed(0)
    shape = (2, 16, 8192, 128)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · shape {shape} bf16 · TB/s over"
          " one read of each input and one write of its codes")
    base = dict(qz.ROTATED_LAUNCH)
    for recipe in recipes:
        cfg = recipe_config(recipe)
        k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kc, vc = copies_for("k", cfg, row=True, col=False), copies_for("v", cfg, row=False, col=True)
        st = stats_for((k, v), (kc, vc), also=backward_kv_copies(cfg))
        bk, pow2 = cfg.block_k, cfg.pow2_scales

        def pair():
            return qz.quantize_operands((k, v), (kc, vc), block=bk, pow2=pow2, stats=st)
        if "--pair-only" in sys.argv:  # the pair's launch N times and nothing else (for a profiler)
            for _ in range(int(sys.argv[sys.argv.index("--pair-only") + 1])):
                pair()
            torch.cuda.synchronize()
            continue
        ref = pair()
        gbytes = (2 * k.numel() * 2 + 2 * k.numel()) / 1e9  # K and V read (bf16), their codes written
        print(recipe, "K", kc, "V", vc)
        try:
            for label, entries in VARIANTS:
                if only and label not in only and label != "default":
                    continue
                qz.ROTATED_LAUNCH = {**base, **entries}
                same = _same(pair(), ref)
                t_pair = _time_us(pair, rep=50)
                t_k = _time_us(lambda: qz.quantize_operands((k,), (kc,), block=bk, pow2=pow2, stats=st[:1]), rep=50)
                t_v = _time_us(lambda: qz.quantize_operands((v,), (vc,), block=bk, pow2=pow2, stats=st[1:]), rep=50)
                v_rot = qz.plan_quantize((v,), (vc,), block=bk, pow2=pow2, stats=st[1:], launch=qz.ROTATED_LAUNCH)
                t_vr = _time_us(lambda: qz.launch_kernel(qz.quantize_kernel, v_rot.grid, *v_rot.args, **v_rot.meta),
                                rep=50)
                print(f"  {recipe:15s} {label:30s} pair {t_pair:6.1f} us ({gbytes / t_pair * 1e3:4.2f} TB/s)"
                      f"  K alone {t_k:6.1f}  V alone {t_v:6.1f}  V on the pair's table {t_vr:6.1f}"
                      f"  ({'same bits' if same else 'BITS DIFFER'})", flush=True)
        finally:
            qz.ROTATED_LAUNCH = base


if __name__ == "__main__":
    main()
