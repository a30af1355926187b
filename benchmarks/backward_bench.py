"""GPU timing of the Triton FP8 backward against SDPA bf16 (flash and cuDNN), one run, one table.

``python benchmarks/backward_bench.py [--out DIR] [--seqs 4096,8192,16384]``
``[--schedules] [--sweep] [--profile] [--pair MATCHED,STALE] [--set FIELD=VALUE ...] [--no-table]``:
first compare the launch schedules (fused / split, see ``LAUNCH`` in
hf_fp8_attention/kernels/backward.py), sweep launch parameters, or profile the kernels at S=8192,
of the recipe pair ``--pair`` (``--set``: fields overridden on both, for the profile).

Per shape (bf16 inputs, causal, head_dim 128): median times (triton.testing.do_bench) of
- fp8 fwd (public API, Triton forward), fp8 bwd-only (this module's kernels on a saved forward)
  matched and stale, fp8 fwd+bwd through autograd (matched, stale);
- SDPA flash and cuDNN fwd and fwd+bwd;
- TFLOP/s counting causal FLOPs (fwd 2·2·B·H·S²·D / 2, bwd 2.5x fwd);
- peak memory of one training step of the attention op and the activation memory the autograd
  graph holds after the forward (matched saves no O).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from hf_fp8_attention import FP8AttentionConfig, fp8_attention
from hf_fp8_attention.kernels import backward_fp8, quantize
from hf_fp8_attention.kernels.backward import LAUNCH, triton_backward
from hf_fp8_attention.kernels.operands import tile_recipe
from hf_fp8_attention.masking import MaskSpec
from recipe_names import fresh_memory_peak


def _flops_fwd(b, h, s, d, causal=True):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def _forward_for_bwd(q, k, v, scale, mask, cfg):
    """(out, lse) to run the backward on: the Triton forward; if it fails here, the SDPA bf16 output
    and its exact LSE (same shapes, finite; the backward's cost does not depend on the values)."""
    try:
        from hf_fp8_attention.kernels.forward import triton_forward

        return triton_forward(q, k, v, scale=scale, mask=mask, config=cfg)
    except Exception as err:  # noqa: BLE001
        print(f"triton_forward unavailable ({type(err).__name__}); backward timed on an SDPA forward", flush=True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, scale=scale)
        lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
        for i in range(0, q.shape[2], 1024):  # chunked exact LSE (memory: 1024 x S fp32 per head)
            s = (q[:, :, i:i + 1024].float() @ k.float().transpose(-1, -2)) * scale
            if mask.causal:
                pos = torch.arange(i, min(i + 1024, q.shape[2]), device=q.device)[:, None]
                s = s.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > pos, float("-inf"))
            lse[:, :, i:i + 1024] = torch.logsumexp(s, dim=-1)
        return out, lse


def _random_inputs(b, h, s, d, seed):
    """q, k, v, dO: four (b, h, s, d) bf16 CUDA tensors of standard normals from one seeded generator."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))


def _bench(fn, rep=200):
    fresh_memory_peak()  # a lone call's path, whatever ran before
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def _fwd_bwd(attn, q, k, v, do):
    def step():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        o = attn(qq, kk, vv)
        torch.autograd.grad(o, (qq, kk, vv), do)
    return step


def _held_activations(attn, q, k, v):
    """Bytes the autograd graph keeps alive after the forward once the caller has dropped O
    (as a model does after the output projection): O itself only if the backward saved it."""
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    o = attn(qq, kk, vv)
    loss = o.float().sum()  # a consumer whose backward needs nothing of O
    del o
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    del loss
    return held


def _peak_step(step):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run(seqs, b, h, d, out_dir):
    rows = []
    for s in seqs:
        q, k, v, do = _random_inputs(b, h, s, d, seed=s)
        scale = d**-0.5
        mask = MaskSpec(causal=True)
        fl = _flops_fwd(b, h, s, d)
        r = {"B": b, "H": h, "S": s, "D": d}
        impls = {
            "fp8_delta": lambda q_, k_, v_: fp8_attention(q_, k_, v_, causal=True, config=FP8AttentionConfig.from_recipe("fp8_delta")),
            "fp8_stale": lambda q_, k_, v_: fp8_attention(q_, k_, v_, causal=True, config=FP8AttentionConfig.from_recipe("fp8_stale")),
        }
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            def sd(q_, k_, v_, _b=backend):
                with sdpa_kernel(_b):
                    return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
            impls[name] = sd
        for name, attn in impls.items():
            try:
                with torch.no_grad():
                    r[f"{name}_fwd_ms"] = _bench(lambda: attn(q, k, v))
                r[f"{name}_fwdbwd_ms"] = _bench(_fwd_bwd(attn, q, k, v, do))
                r[f"{name}_fwdbwd_tflops"] = 3.5 * fl / r[f"{name}_fwdbwd_ms"] / 1e9
                r[f"{name}_peak_step_MiB"] = _peak_step(_fwd_bwd(attn, q, k, v, do)) / 2**20
                r[f"{name}_held_MiB"] = _held_activations(attn, q, k, v) / 2**20
            except Exception as err:  # noqa: BLE001 (a backend missing on this machine is reported, not fatal)
                r[f"{name}_error"] = f"{type(err).__name__}: {err}"[:200]
        # backward alone on a saved forward (emulation-free: Triton forward output)
        for name in ("fp8_delta", "fp8_stale"):
            cfg = FP8AttentionConfig.from_recipe(name)
            out, lse = _forward_for_bwd(q, k, v, scale, mask, cfg)
            o_arg = out if name == "fp8_stale" else None
            # the in-register FP8 kernels run only the tile recipe (backward._check_limits)
            for suffix, prequant in (("", True), ("_inreg", False)) if tile_recipe(cfg) else (("", True),):
                LAUNCH["prequant"] = prequant
                r[f"{name}_bwd{suffix}_ms"] = _bench(
                    lambda: triton_backward(q, k, v, o_arg, lse, do, scale=scale, mask=mask, config=cfg))
            LAUNCH["prequant"] = True
            r[f"{name}_bwd_tflops"] = 2.5 * fl / r[f"{name}_bwd_ms"] / 1e9
        for name in ("sdpa_flash", "sdpa_cudnn"):
            if f"{name}_fwdbwd_ms" in r:
                r[f"{name}_bwd_ms"] = r[f"{name}_fwdbwd_ms"] - r[f"{name}_fwd_ms"]
        r["matched_over_stale_bwd"] = r["fp8_delta_bwd_ms"] / r["fp8_stale_bwd_ms"]
        for ref in ("sdpa_flash", "sdpa_cudnn"):
            if f"{ref}_fwdbwd_ms" in r and "fp8_delta_fwdbwd_ms" in r:
                r[f"speedup_vs_{ref}"] = r[f"{ref}_fwdbwd_ms"] / r["fp8_delta_fwdbwd_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)
        del q, k, v, do
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_backward.json"), "w") as f:
            json.dump(rows, f, indent=1)
    cols = [("S", "S"), ("fp8_delta_fwd_ms", "fp8 fwd"), ("fp8_delta_bwd_ms", "bwd matched"),
            ("fp8_stale_bwd_ms", "bwd stale"), ("fp8_delta_bwd_inreg_ms", "bwd m inreg"), ("matched_over_stale_bwd", "m/s"),
            ("fp8_delta_fwdbwd_ms", "fp8 f+b"), ("fp8_delta_fwdbwd_tflops", "TF/s"),
            ("sdpa_flash_fwdbwd_ms", "flash f+b"), ("sdpa_flash_fwdbwd_tflops", "TF/s"),
            ("sdpa_cudnn_fwdbwd_ms", "cudnn f+b"), ("sdpa_cudnn_fwdbwd_tflops", "TF/s"),
            ("speedup_vs_sdpa_flash", "x flash"), ("speedup_vs_sdpa_cudnn", "x cudnn"),
            ("fp8_delta_peak_step_MiB", "peak MiB m"), ("fp8_stale_peak_step_MiB", "peak s"),
            ("sdpa_cudnn_peak_step_MiB", "peak cudnn"), ("fp8_delta_held_MiB", "held m"), ("fp8_stale_held_MiB", "held s")]
    print(" | ".join(h for _, h in cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c, _ in cols))
    return rows


SWEEP = [  # (free tile dq, free tile dkdv, warps dq, warps dkdv, stages)
    (64, 64, 4, 4, 2), (64, 64, 4, 4, 3), (64, 64, 8, 8, 1), (64, 64, 4, 8, 2), (128, 128, 8, 8, 1),
    (64, 128, 4, 8, 1), (64, 128, 4, 8, 2), (128, 64, 8, 4, 2), (32, 64, 4, 4, 2), (32, 32, 4, 4, 2),
    # 8 warps for the dQ and dK launches (one 4-warp CTA per SM at the default): fewer spills offline,
    # but 5.8-6.0 ms against 3.5 ms on the H200 (benchmarks/NOTES.md).
    (64, 64, 8, 8, 2), (64, 64, 8, 8, 3),
]


def _set_launch(bm, bn, wq, wk, st):
    """One sweep point: query-side launches (dQ, LSE'/D) get (bm, wq), key-side ones (dK, dV, fused
    dK/dV) get (bn, wk); all get ``st`` stages. The split/fused choice stays as LAUNCH has it."""
    for key, tile, warps in (("dq", bm, wq), ("dq_stats", bm, wq), ("dkdv", bn, wk), ("dk", bn, wk), ("dv", bn, wk)):
        LAUNCH["free_tile"][key] = tile
        LAUNCH[key] = {"num_warps": warps, "num_stages": st}


def sweep(s, b, h, d):
    """bwd-only matched time per launch variant (causal, bf16) at one shape; leaves the fastest in LAUNCH."""
    q, k, v, do = _random_inputs(b, h, s, d, seed=1)
    mask, cfg = MaskSpec(causal=True), FP8AttentionConfig()
    _, lse = _forward_for_bwd(q, k, v, d**-0.5, mask, cfg)
    best = None
    for bm, bn, wq, wk, st in SWEEP:
        _set_launch(bm, bn, wq, wk, st)
        try:
            ms = _bench(lambda: triton_backward(q, k, v, None, lse, do, scale=d**-0.5, mask=mask, config=cfg), rep=100)
        except Exception as err:  # noqa: BLE001 (a variant that does not compile is reported)
            print(f"sweep {bm},{bn},{wq},{wk},{st}: {type(err).__name__}: {str(err)[:120]}", flush=True)
            continue
        print(f"sweep S={s} free_tile=({bm},{bn}) warps=({wq},{wk}) stages={st}: {ms:.3f} ms "
              f"{2.5 * _flops_fwd(b, h, s, d) / ms / 1e9:.0f} TFLOP/s", flush=True)
        if best is None or ms < best[0]:
            best = (ms, bm, bn, wq, wk, st)
    _set_launch(*best[1:])
    print(f"best launch: {LAUNCH}", flush=True)


SCHEDULES = {  # LAUNCH switches of each schedule compared by --schedules
    "fused (LSE'/D+dQ, dK+dV)": {"split_dq_stats": False, "split_dkdv": False},
    "split dK/dV only": {"split_dq_stats": False, "split_dkdv": True},
    "split (default)": {"split_dq_stats": True, "split_dkdv": True},
}


def schedules(seqs, b, h, d, pair=("fp8_delta", "fp8_stale")):
    """bwd-only time (matched and stale recipe of ``pair``, causal, bf16) of each launch schedule of
    SCHEDULES, and whether its gradients equal the first schedule's bit for bit."""
    saved = {key: LAUNCH[key] for key in ("split_dq_stats", "split_dkdv")}
    mask = MaskSpec(causal=True)
    matched, stale = pair
    for s in seqs:
        q, k, v, do = _random_inputs(b, h, s, d, seed=s)
        fwd = {n: _forward_for_bwd(q, k, v, d**-0.5, mask, FP8AttentionConfig.from_recipe(n)) for n in pair}
        first = {}
        for label, switches in SCHEDULES.items():
            LAUNCH.update(switches)
            ms, same = {}, True
            for name, (out, lse) in fwd.items():
                cfg = FP8AttentionConfig.from_recipe(name)
                o_arg = out if name == stale else None
                fn = lambda: triton_backward(q, k, v, o_arg, lse, do, scale=d**-0.5, mask=mask, config=cfg)  # noqa: E731
                grads = fn()
                ref = first.setdefault(name, grads)
                same = same and all(torch.equal(a, r) for a, r in zip(grads, ref))
                ms[name] = _bench(fn, rep=150)
            print(f"schedules {matched}/{stale} S={s} B={b} H={h} D={d} {label}: matched {ms[matched]:.3f} ms "
                  f"({2.5 * _flops_fwd(b, h, s, d) / ms[matched] / 1e9:.0f} TFLOP/s), stale {ms[stale]:.3f} ms, "
                  f"matched/stale {ms[matched] / ms[stale]:.3f}, gradients equal to the first: {same}", flush=True)
        LAUNCH.update(saved)


# Constexpr switches that tell the launches of one kernel apart (see LAUNCH in hf_fp8_attention/kernels/backward.py).
_PASS_FLAGS = ("STATS", "GRADS", "COMPUTE_DK", "COMPUTE_DV")


def _timed_launches(kernels, events):
    """Wrap each JIT kernel's ``run`` so that every launch appends (label, start, end) CUDA events to
    ``events``; the label is the kernel name plus the pass flags set in that launch. Returns an undo."""
    originals = []
    for kernel in kernels:
        run = kernel.run

        def timed_run(*args, _run=run, _name=kernel.__name__, **kwargs):
            flags = "+".join(f for f in _PASS_FLAGS if kwargs.get(f))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            compiled = _run(*args, **kwargs)
            end.record()
            events.append((f"{_name}[{flags}]" if flags else _name, start, end))
            return compiled

        kernel.run = timed_run
        originals.append((kernel, run))

    def undo():
        for kernel, run in originals:
            kernel.run = run
    return undo


def profile(s, b, h, d, runs=5, pair=("fp8_delta", "fp8_stale"), overrides=None):
    """GPU time of each launch of one matched and one stale backward (the recipes of ``pair``; CUDA
    events around each launch, so the passes of one kernel, e.g. its dK and dV launches, are timed
    apart). ``overrides``: config fields set on both recipes (``--set``)."""
    kernels = [backward_fp8.bwd_dq_fp8_kernel, backward_fp8.bwd_dkdv_fp8_kernel, quantize.quantize_kernel]
    q, k, v, do = _random_inputs(b, h, s, d, seed=2)
    mask = MaskSpec(causal=True)
    for name in pair:
        cfg = FP8AttentionConfig.from_recipe(name, **(overrides or {}))
        out, lse = _forward_for_bwd(q, k, v, d**-0.5, mask, cfg)
        o_arg = out if name == pair[1] else None
        for _ in range(3):  # compile and warm up
            triton_backward(q, k, v, o_arg, lse, do, scale=d**-0.5, mask=mask, config=cfg)
        torch.cuda.synchronize()
        events = []
        undo = _timed_launches(kernels, events)
        try:
            for _ in range(runs):
                triton_backward(q, k, v, o_arg, lse, do, scale=d**-0.5, mask=mask, config=cfg)
            torch.cuda.synchronize()
        finally:
            undo()
        per_launch = {}
        for label, start, end in events:
            per_launch[label] = per_launch.get(label, 0.0) + start.elapsed_time(end) / runs
        print(f"profile {name}{' ' + str(overrides) if overrides else ''} S={s} B={b} H={h} D={d} (mean of {runs} backward calls, ms per call):")
        for label, ms in per_launch.items():
            print(f"  {label:55s} {ms:8.3f}")
        print(f"  {'total':55s} {sum(per_launch.values()):8.3f}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--sweep", action="store_true", help="first try launch variants at S=8192, keep the fastest")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel launch (per pass) of the backward at S=8192")
    ap.add_argument("--schedules", action="store_true", help="first compare the launch schedules at --seqs")
    ap.add_argument("--pair", default="fp8_delta,fp8_stale",
                    help="the matched and the stale recipe that --schedules and --profile time")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="config fields set on both --pair recipes for --profile (e.g. ds_scales=head)")
    ap.add_argument("--no-table", action="store_true", help="skip the default timing table")
    a = ap.parse_args()
    pair = tuple(a.pair.split(","))
    overrides = dict(item.split("=", 1) for item in a.set)
    if a.schedules:
        schedules([int(x) for x in a.seqs.split(",")], a.batch, a.heads, a.head_dim, pair)
    if a.sweep:
        sweep(8192, a.batch, a.heads, a.head_dim)
    if a.profile:
        profile(8192, a.batch, a.heads, a.head_dim, pair=pair, overrides=overrides)
    if not a.no_table:
        run([int(x) for x in a.seqs.split(",")], a.batch, a.heads, a.head_dim, a.out)
