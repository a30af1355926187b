"""Variants of the Gluon kernels' use timed side by side in one process, beside SDPA.

Each variant sets entries of ``backward.LAUNCH`` (which Gluon backward kernels run at which head
dims), ``forward.GLUON_FORWARD`` (``triton_fwd``: the Triton forward kernel) or the operand layout
or schedule of a Gluon kernel (their ``LAYOUTS``: ``fwd_*``, ``dkdv_*``, ``dq_*``, ``stats_*``)
before its calls; the variants are
alternated over ``--rounds`` so that drift between them shows.
Per shape and variant: median ms of the forward, the backward alone and fwd+bwd
(triton.testing.do_bench, ``bench_attention._time``), the ratio to SDPA's cuDNN backend in the
same run, and the difference of the output and each gradient from the first variant's, as a
relative Frobenius norm (every variant computes the same maths; the order of fp32 accumulation
may differ).
``--profile`` adds the GPU time per kernel of one fwd+bwd of the first shape under each variant.

    python benchmarks/gluon_variants.py --recipe fp8_delta_fast --out-dir $OUT
    python benchmarks/gluon_variants.py --variants package,dkdv_kv_shared_q64 --shapes 8192:128:1,16384:128:0

Shapes: ``S:D:causal``, 16 query heads, 16k tokens per batch (B = 16384 // S), bf16; ``--kv-heads``
fewer than 16 gives GQA (cuDNN is then timed on K and V repeated to the query heads).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import _sdpa_fn, _time, environment, flops  # noqa: E402
from recipe_cost import print_kernels  # noqa: E402

from hf_fp8_attention import fp8_attention  # noqa: E402
from hf_fp8_attention.kernels import (  # noqa: E402
    backward, backward_dkdv_gluon, backward_dq_gluon, backward_stats_gluon, exponent, forward, forward_gluon,
)
from recipe_names import recipe_config  # noqa: E402

# name: ({LAUNCH key: head dims}, {(module, constant): value}), set before the variant's calls (the
# package's values otherwise)
MODES = ("fwd", "bwd", "fwdbwd")
VARIANTS = {
    "package": ({}, {}),
    "triton_stats": ({"gluon_dq_stats": ()}, {}),
    "gluon_stats": ({"gluon_dq_stats": (128, )}, {}),
    "triton_dq": ({"gluon_dq": ()}, {}),
    "triton_dkdv": ({"gluon_dkdv": ()}, {}),
    "triton_all": ({"gluon_dq_stats": (), "gluon_dq": (), "gluon_dkdv": ()}, {}),
    "triton_fwd": ({}, {(forward, "GLUON_FORWARD"): ()}),
    # the Gluon forward and dK/dV kernels at every head dim they are built for (64 too)
    "gluon_fwd": ({}, {(forward, "GLUON_FORWARD"): forward_gluon.HEAD_DIMS}),
    "gluon_dkdv": ({"gluon_dkdv": backward_dkdv_gluon.HEAD_DIMS}, {}),
    # the Gluon forward's exponent: one FMA where a warpgroup's bound allows (exponent.FMA_EXPONENT, the
    # default), or the exact form everywhere
    "fwd_fma_exponent": ({}, {(exponent, "FMA_EXPONENT"): True}),
    "fwd_exact_exponent": ({}, {(exponent, "FMA_EXPONENT"): False}),
    # the Gluon kernels' operand layouts and schedules (each variant changes one kernel's; the
    # statistics kernel's also switch that kernel on)
    **{f"{prefix}_{name}": (launch, {(module, c): v for c, v in zip(module.LAYOUT_CONSTANTS, values)})
       for prefix, module, launch in (("fwd", forward_gluon, {}), ("dkdv", backward_dkdv_gluon, {}),
                                      ("dq", backward_dq_gluon, {}),
                                      ("stats", backward_stats_gluon, {"gluon_dq_stats": (128, )}))
       for name, values in module.LAYOUTS.items()},
}
DEFAULT_LAUNCH = dict(backward.LAUNCH)
DEFAULT_CONSTANTS = {(module, attr): getattr(module, attr) for _, constants in VARIANTS.values()
                     for module, attr in constants}


def apply(name: str) -> None:
    launch, constants = VARIANTS[name]
    backward.LAUNCH.clear()
    backward.LAUNCH.update(DEFAULT_LAUNCH, **launch)
    for (module, attr), value in {**DEFAULT_CONSTANTS, **constants}.items():
        setattr(module, attr, value)


def outputs(cfg, q, k, v, do, causal):
    """[O, dQ, dK, dV] in fp32."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = fp8_attention(qg, kg, vg, causal=causal, config=cfg)
    out.backward(do)
    return [out.detach().float()] + [t.grad.float() for t in (qg, kg, vg)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="fp8_delta_fast")
    p.add_argument("--variants", default="package,gluon_stats,triton_all")
    p.add_argument("--shapes", default="8192:128:1,16384:128:1,8192:128:0,16384:128:0")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--tag", default="gluon_variants")
    p.add_argument("--kv-heads", type=int, default=16, help="K/V heads (a divisor of 16; fewer: GQA)")
    a = p.parse_args(argv)
    if a.kv_heads < 1 or 16 % a.kv_heads:
        p.error(f"--kv-heads must divide the 16 query heads, got {a.kv_heads}")
    names = a.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {sorted(VARIANTS)}")
    cfg = recipe_config(a.recipe)
    env = environment()
    print(json.dumps(env))
    rows = []

    def save() -> None:  # after every shape, so that a run cut by a time limit keeps what it timed
        if a.out_dir:
            a.out_dir.mkdir(parents=True, exist_ok=True)
            (a.out_dir / f"{a.tag}.json").write_text(json.dumps({"env": env, "recipe": a.recipe, "rows": rows},
                                                                indent=1))

    for shape in a.shapes.split(","):
        s, d, causal = (int(x) for x in shape.split(":"))
        causal = bool(causal)
        b, h, hkv = max(16384 // s, 1), 16, a.kv_heads
        gen = torch.Generator(device="cuda").manual_seed(s + d)
        q, k, v, do = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for n in (h, hkv, hkv, h))
        k_full, v_full = (t.repeat_interleave(h // hkv, dim=1) for t in (k, v))
        ref = None
        row = {"S": s, "D": d, "B": b, "H": h, "H_kv": hkv, "causal": causal}
        cudnn = _sdpa_fn("cudnn", causal)
        for rnd in range(a.rounds):
            for mode in MODES:
                row.setdefault(f"cudnn/{mode}", []).append(_time(cudnn, mode, q, k_full, v_full, 25, 100))
            for name in names:
                apply(name)
                if rnd == 0:
                    g = outputs(cfg, q, k, v, do, causal)
                    if ref is None:
                        ref = g
                    row[f"{name}/diff"] = [float((x - y).norm() / y.norm()) for x, y in zip(g, ref)]
                impl = lambda q_, k_, v_: fp8_attention(q_, k_, v_, causal=causal, config=cfg)  # noqa: E731
                for mode in MODES:
                    row.setdefault(f"{name}/{mode}", []).append(_time(impl, mode, q, k, v, 25, 100))
        rows.append(row)
        line = [f"S={s} D={d} B={b} H={h} H_kv={hkv} causal={causal}"]
        for mode in MODES:
            ref_ms = min(row[f"cudnn/{mode}"])
            line.append(f"  {mode}: cudnn {ref_ms:.3f} ms ({flops(mode, b, h, s, d, causal) / ref_ms / 1e9:.0f} TF)")
            for name in names:
                ms = row[f"{name}/{mode}"]
                line.append(f"    {name:<12} " + " / ".join(f"{x:.3f}" for x in ms)
                            + f" ms  x cudnn {ref_ms / min(ms):.3f}")
        line.append("  O/dQ/dK/dV diff vs first: " + "; ".join(
            f"{n} " + "/".join(f"{x:.1e}" for x in row[f"{n}/diff"]) for n in names))
        print("\n".join(line), flush=True)
        save()
    if a.profile:
        s, d, causal = (int(x) for x in a.shapes.split(",")[0].split(":"))
        b = max(16384 // s, 1)
        q, k, v, do = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16)
                       for n in (16, a.kv_heads, a.kv_heads, 16))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        for name in names:
            apply(name)

            def step():
                out = fp8_attention(qg, kg, vg, causal=bool(causal), config=cfg)
                torch.autograd.grad(out, (qg, kg, vg), do)

            print_kernels(f"{name} fwd+bwd, S={s} D={d} causal={bool(causal)}", step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
