"""GPU time of the forward's K/V statistics launch, the pair as the forward runs it against K and V
each alone, under variants of the rotating launch: labelled ``xH``, the rotation as xH
(``TRANSPOSED_ROTATION`` off) on ``sequence_stats.ROTATED_PARTIALS``; labelled ``T``, as Hᵀxᵀ on
``TRANSPOSED_PARTIALS``; ``fold N`` / ``tma``, the module's ``FOLD_LOADS`` / ``TMA_LOADS``:
which operand the launch waits on, and whether two launches (K on the
rotating table, V on the plain 4-warp one) would beat one. Each variant's statistics against the
default tables': row and channel amax bit for bit, the shift's largest difference relative to its
largest entry (the two forms sum in other orders).

    python benchmarks/experiments/kv_stats_split.py [--only LABEL,LABEL] [--recipes fp8_delta,...]

Shape: (2, 16, 8192, 128) bf16, Gaussian; statistics as ``fp8_delta`` and ``fp8_delta_fast`` ask them
(K: rotated, smoothed extremes, mean and channel amax; V: amax and channel amax), with the backward's
statistics computed beside them as the forward does. K alone takes the rotating table; V alone (no
rotation) the 4-warp unrotated launch. CUDA-graph medians (``triton.testing.do_bench_cudagraph``).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention.kernels import sequence_stats as ss  # noqa: E402
from hf_fp8_attention.kernels.operands import backward_kv_copies, copies_for, operand_needs  # noqa: E402
from quantize_bench import _time_us  # noqa: E402
from recipe_names import recipe_config  # noqa: E402

# (label, entries over the default tables). "transposed": TRANSPOSED_ROTATION for the variant (absent:
# the module's), its entries then over TRANSPOSED_PARTIALS; False (the xH form): over ROTATED_PARTIALS.
VARIANTS = (("default", {}), ("xH", {"transposed": False}), ("xH sub16", {"transposed": False, "sub": 16}),
            ("xH sub16+ew", {"transposed": False, "sub": 16, "elementwise_smoothed": True}),
            ("xH ew", {"transposed": False, "elementwise_smoothed": True}),
            ("xH 4 warps sub64", {"transposed": False, "sub": 64, "num_warps": 4}),
            ("T 4w s32", {"transposed": True, "stages": 1}),
            ("T 4w s32 st2", {"transposed": True, "stages": 2}),
            ("T 4w s32 r128", {"transposed": True, "stages": 1, "maxnreg": 128}),
            ("T 4w s64", {"transposed": True, "stages": 1, "sub": 64}),
            ("T 8w s64", {"transposed": True, "stages": 1, "num_warps": 8, "sub": 64}),
            ("T 8w s64 st2", {"transposed": True, "num_warps": 8, "sub": 64, "stages": 2}),
            ("T 4w s16", {"transposed": True, "stages": 1, "sub": 16}),
            ("fold 1", {"FOLD_LOADS": 1}), ("fold 32", {"FOLD_LOADS": 32}),
            ("T st3", {"stages": 3}), ("T st4", {"stages": 4}),
            ("tma st2", {"TMA_LOADS": True, "tma_stages": 2}), ("tma st3", {"TMA_LOADS": True, "tma_stages": 3}),
            ("tma st4", {"TMA_LOADS": True, "tma_stages": 4}),
            ("tma st3 s64", {"TMA_LOADS": True, "tma_stages": 3, "sub": 64}))
# Entries in capitals set the module's switch of that name for the variant (restored after).
SWITCHES = ("FOLD_LOADS", "TMA_LOADS")


def _against(got, ref) -> str:
    """How a variant's statistics differ from the default's (see the module docstring)."""
    same = all(torch.equal(g.row_amax, r.row_amax) and torch.equal(g.col_amax, r.col_amax) for g, r in zip(got, ref))
    shift = max(float((g.shift - r.shift).abs().max() / r.shift.abs().max().clamp_min(1e-30))
                for g, r in zip(got, ref))
    return f"amax {'same' if same else 'DIFFER'}, shift {shift:.1e}"


def main():
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · shape (2, 16, 8192, 128) bf16")
    base, base_t, base_switch = dict(ss.ROTATED_PARTIALS), dict(ss.TRANSPOSED_PARTIALS), ss.TRANSPOSED_ROTATION
    base_switches = {name: getattr(ss, name) for name in SWITCHES}
    recipes = (sys.argv[sys.argv.index("--recipes") + 1].split(",") if "--recipes" in sys.argv
               else ("fp8_delta", "fp8_delta_fast"))
    for recipe in recipes:
        cfg = recipe_config(recipe)
        k, v = (torch.randn(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kc, vc = copies_for("k", cfg, row=True, col=False), copies_for("v", cfg, row=False, col=True)
        nk, nv = operand_needs((kc, vc), backward_kv_copies(cfg))
        print(recipe, "K needs", nk, "V needs", nv)
        ref = ss.sequence_stats((k, v), (nk, nv))
        try:
            for label, entries in VARIANTS:
                if only and label not in only and label != "default":
                    continue
                entries = dict(entries)
                for name in SWITCHES:
                    setattr(ss, name, entries.pop(name, base_switches[name]))
                ss.TRANSPOSED_ROTATION = entries.pop("transposed", base_switch)
                if ss.TRANSPOSED_ROTATION:
                    ss.TRANSPOSED_PARTIALS = {**base_t, **entries}
                else:
                    ss.ROTATED_PARTIALS = {**base, **entries}
                diff = _against(ss.sequence_stats((k, v), (nk, nv)), ref)
                t_pair = _time_us(lambda: ss.sequence_stats((k, v), (nk, nv)), rep=50)
                t_k = _time_us(lambda: ss.sequence_stats((k,), (nk,)), rep=50)
                t_v = _time_us(lambda: ss.sequence_stats((v,), (nv,)), rep=50)
                print(f"  {recipe:15s} {label:14s} pair {t_pair:6.1f} us  K alone {t_k:6.1f}  V alone {t_v:6.1f}"
                      f"  ({diff})", flush=True)
        finally:
            ss.ROTATED_PARTIALS, ss.TRANSPOSED_PARTIALS, ss.TRANSPOSED_ROTATION = base, base_t, base_switch
            for name, value in base_switches.items():
                setattr(ss, name, value)


if __name__ == "__main__":
    main()
