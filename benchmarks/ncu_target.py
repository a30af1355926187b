"""One attention launch family for Nsight Compute to profile: a warm-up call, then the call to profile.

Shape: B=2, H=16, S=8192, d=128, bf16 (causal unless ``noncausal`` is given); ``s=SEQ`` sets the
query length (B = 16384 // SEQ) and ``kv=KV_SEQ`` the key length (default SEQ), e.g. ``fwd s=1024``
for the short launches whose time goes to once-per-program code (ncu_summary's regions);
``recipe=NAME`` a recipe of benchmarks/recipe_names.py (default: ``FP8AttentionConfig()``, i.e.
``fp8_delta``; the fast recipes' backward runs the statistics, dQ and one fused dK/dV launch). Pin
the forward's launch (``HF_FP8_ATTENTION_FWD_CONFIG=64,4,3``) so that the autotuner's trial launches do not
shift the launch count. Launches per call: forward ``_fwd_kernel`` 1; backward (matched)
``bwd_dq_fp8_kernel`` 2 (LSE'/D, then dQ), ``bwd_dkdv_fp8_kernel`` 2 (dK, then dV).

    HF_FP8_ATTENTION_FWD_CONFIG=64,4,3 ncu --clock-control none --set full --import-source no \\
        -k regex:bwd_dq_fp8_kernel --launch-skip 3 --launch-count 1 -o dq \\
        python benchmarks/ncu_target.py bwd          # skips the warm-up call's two and LSE'/D: dQ
    ncu -i dq.ncu-rep --page source --csv --print-source sass > dq.sass.csv
    python benchmarks/ncu_summary.py dq.sass.csv

Families: ``fwd`` (the Triton forward), ``bwd`` (the Triton backward, matched), ``gluon_ws`` (the
warp-specialized Gluon forward of benchmarks/experiments).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "experiments")]

from hf_fp8_attention import FP8AttentionConfig  # noqa: E402
from hf_fp8_attention.kernels.backward import triton_backward  # noqa: E402
from hf_fp8_attention.kernels.forward import triton_forward  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from recipe_names import recipe_config  # noqa: E402

FAMILIES = ("fwd", "bwd", "gluon_ws")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in FAMILIES:
        print(f"usage: ncu_target.py {{{','.join(FAMILIES)}}} [noncausal] [s=SEQ] [kv=KV_SEQ] [recipe=NAME]",
              file=sys.stderr)
        return 2
    family, causal = argv[0], "noncausal" not in argv[1:]
    opts = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    s = int(opts.get("s", 8192))
    kv = int(opts.get("kv", s))
    b, h, d = max(16384 // s, 1), 16, 128  # 16k query tokens per batch
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, h, kv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    cfg = recipe_config(opts["recipe"]) if "recipe" in opts else FP8AttentionConfig()
    mask = MaskSpec(causal=causal)
    if family == "fwd":
        def call():
            triton_forward(q, k, v, scale=d**-0.5, mask=mask, config=cfg)
    elif family == "bwd":
        _, lse = triton_forward(q, k, v, scale=d**-0.5, mask=mask, config=cfg)

        def call():
            triton_backward(q, k, v, None, lse, do, scale=d**-0.5, mask=mask, config=cfg)
    else:
        from gluon_forward_ws import gluon_forward_ws

        def call():
            gluon_forward_ws(q, k, v, scale=d**-0.5, causal=causal, config=cfg)
    for _ in range(2):  # compile and warm up, then the profiled call
        call()
        torch.cuda.synchronize()
    print(f"ncu_target: {family} causal={causal} done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
