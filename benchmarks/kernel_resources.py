"""Registers, spills and shared memory of each Triton attention kernel as compiled for a GPU.

Two modes:

- On a CUDA GPU: one fwd+bwd of the FP8 attention op at a benchmark shape; every kernel launch is
  recorded and its compiled resources printed (``n_regs`` per thread, ``n_spills`` = bytes of local
  memory). Pin the forward launch (``HF_FP8_ATTENTION_FWD_CONFIG=64,4,3``) to skip autotuning.
  ``python benchmarks/kernel_resources.py --seq 8192 --heads 16 --dim 128``
- ``--offline`` (any machine with Triton and its bundled ptxas, no GPU needed): the package's host
  code runs on CPU tensors (one fwd+bwd as autograd runs it: the forward's statistics, and with
  ``--switch forward.HAND_OVER_KV_COPIES=1`` K's and V's copies, handed to the backward), and
  every launch it makes is compiled for sm_90a instead of run, with
  Triton's own argument specialization (so the compile is the one a GPU launch would get). Every
  candidate of the forward's autotune space is compiled. Registers and spills come from
  ``ptxas -v`` on the PTX (the flags Triton passes), shared memory from Triton's allocation.
  ``python benchmarks/kernel_resources.py --offline --dims 128 256``
  ``--mix NAME``: also the instruction mix of the launches whose label contains NAME (SASS of the
  whole kernel, by class: integer, floating point, byte permutes, memory, other), e.g. where a
  memory-bound launch spends its issue slots.

Offline counts are a guide, not a measurement: benchmarks/NOTES.md ("Offline compiles") lists where
they pointed the wrong way; the device's SASS (Nsight Compute) and timings decide.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe_names import apply_launch_tables, recipe_config  # noqa: E402

# Hopper: 227 KB of shared memory per block (232448 bytes), 255 registers per thread.
SMEM_LIMIT = 232448
OFFLINE_RECIPES = ("fp8_delta", "fp8_stale", "fp8_delta_fast", "fp8_delta_tile", "hybrid_delta")
OFFLINE_MASKS = ("causal", "dense", "window", "varlen")


def _record(jit_fn, seen: dict):
    """Wrap ``jit_fn.run`` so each launch's CompiledKernel lands in ``seen``, under the kernel name
    and, where one kernel serves several launches (the quantization's), a number per variant."""
    run = jit_fn.run

    def recording_run(*args, **kwargs):
        compiled = run(*args, **kwargs)
        variants = [key for key, c in seen.items() if key.split("#")[0] == jit_fn.__name__]
        if all(seen[key].hash != compiled.hash for key in variants):
            seen[f"{jit_fn.__name__}#{len(variants)}" if variants else jit_fn.__name__] = compiled
        return compiled

    jit_fn.run = recording_run


def gpu_main(args) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("kernel_resources.py needs a CUDA GPU without --offline")

    import hf_fp8_attention  # noqa: F401  (registers the ops)
    from hf_fp8_attention import fp8_attention
    from hf_fp8_attention.kernels import backward_fp8, backward_inreg, forward, quantize

    seen: dict = {}
    for module in (forward, backward_fp8, backward_inreg, quantize):
        for obj in vars(module).values():
            if isinstance(obj, triton.runtime.autotuner.Autotuner):
                obj = obj.fn
            if isinstance(obj, triton.runtime.jit.JITFunction):
                _record(obj, seen)
    q, k, v = (torch.randn(1, args.heads, args.seq, args.dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = fp8_attention(q, k, v, causal=bool(args.causal))
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()} · triton {triton.__version__} · S={args.seq} H={args.heads} "
          f"D={args.dim} causal={bool(args.causal)}")
    print(f"{'kernel':40s} {'regs':>5s} {'spill B':>8s} {'smem B':>8s} {'warps':>5s} {'stages':>6s}")
    for name, c in sorted(seen.items()):
        meta = c.metadata
        print(f"{name:40s} {c.n_regs:5d} {c.n_spills:8d} {meta.shared:8d} {meta.num_warps:5d} {meta.num_stages:6d}")


# --------------------------------------------------------------------------------------------
# offline: compile every launch for sm_90a on the CPU
# --------------------------------------------------------------------------------------------


class OfflineCompiler:
    """Replaces ``JITFunction.run`` while active: a launch compiles for ``target`` and is recorded
    (kernel, constexprs, options, resources) instead of running. Its result buffers stay as the host
    code allocated them (uninitialised); nothing reads them."""

    def __init__(self, capability: int = 90):
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.target = GPUTarget("cuda", capability, 32)
        self.backend = make_backend(self.target)
        self.ptxas = (knobs.nvidia.ptxas_blackwell if capability >= 90 else knobs.nvidia.ptxas).path
        self.arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
        self.records: list[dict] = []
        self.context: dict = {}
        self._resources: dict = {}

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        self._saved = JITFunction.run
        compiler = self

        def offline_run(fn, *args, grid, warmup, **kwargs):
            return compiler.compile(fn, args, kwargs)

        JITFunction.run = offline_run
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._saved

    def compile(self, fn, args, kwargs):
        from triton.compiler import ASTSource
        from triton.compiler import compile as triton_compile
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound_args, specialization,
                                                               options)
        try:
            kernel = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=self.target,
                                    options=options.__dict__)
        except Exception as err:  # a candidate that does not compile (shared memory, ptxas) is a row too
            self.records.append(dict(self.context, kernel=fn.__name__, consts=_named_consts(fn, constexprs),
                                     warps=options.num_warps, stages=options.num_stages,
                                     error=f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"))
            return None
        key = kernel.hash
        if key not in self._resources:
            self._resources[key] = self.ptxas_resources(kernel.asm["ptx"])
        regs, stack, spill_st, spill_ld = self._resources[key]
        self.records.append(dict(self.context, kernel=fn.__name__, consts=_named_consts(fn, constexprs),
                                 warps=options.num_warps, stages=options.num_stages, smem=kernel.metadata.shared,
                                 regs=regs, stack=stack, spill_st=spill_st, spill_ld=spill_ld,
                                 mix=instruction_mix(kernel)))
        return kernel

    def ptxas_resources(self, ptx: str) -> tuple[int, int, int, int]:
        """(registers, stack frame, spill stores, spill loads) in bytes, from ``ptxas -v`` with the
        flags Triton's own compile passes."""
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "kernel.ptx")
            Path(src).write_text(ptx)
            log = subprocess.run([self.ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={self.arch}",
                                  src, "-o", os.path.join(tmp, "kernel.cubin")],
                                 capture_output=True, text=True, check=True).stderr
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        return (int(regs.group(1)), *(int(x) for x in spills.groups()))


# SASS opcodes by class (the rest: "other": branches, barriers, uniform-datapath and moves).
MIX_CLASSES = {
    "integer": ("IMAD", "IADD3", "LEA", "LOP3", "ISETP", "SHF", "SEL", "IMNMX", "VIMNMX", "IABS", "I2F", "F2I", "I2FP"),
    "float": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "MUFU", "FCHK", "F2FP", "HFMA2", "HADD2", "HMUL2"),
    "permute": ("PRMT", "SHFL"),
    "memory": ("LDG", "STG", "LDS", "STS", "LDSM", "STSM", "LDGSTS", "UTMALDG", "UTMASTG", "ATOMG", "RED"),
}


def instruction_mix(kernel) -> dict:
    """Instructions of a compiled kernel's SASS by class (:data:`MIX_CLASSES`), and their total."""
    from compile_sm90 import sass_lines

    ops = [re.sub(r"^@!?U?P\w+\s+", "", op).split()[0].split(".")[0] for op in sass_lines(kernel)]
    mix = {name: sum(op in codes for op in ops) for name, codes in MIX_CLASSES.items()}
    mix["other"] = len(ops) - sum(mix.values())
    mix["total"] = len(ops)
    return mix


def _named_consts(fn, constexprs: dict) -> dict:
    names = fn.arg_names
    return {names[path[0]]: getattr(value, "value", value) for path, value in constexprs.items() if len(path) == 1}


def launch_label(rec: dict) -> str:
    """Which launch a record is: the kernel and the constexprs that tell its launches apart."""
    c, name = rec["consts"], rec["kernel"]
    if name == "_fwd_kernel":
        return f"forward BLOCK_M={c['BLOCK_M']}"
    if name == "bwd_dq_fp8_kernel":
        job = {(True, False): "dq_stats", (False, True): "dq", (True, True): "dq+stats"}[(c["STATS"], c["GRADS"])]
        if c.get("ONE_SWEEP"):
            job = "dq_sweep"
        return f"{job} {c['BLOCK_Q']}x{c['BLOCK_K']}"
    if name == "bwd_dkdv_fp8_kernel":
        job = {(True, False): "dk", (False, True): "dv", (True, True): "dkdv"}[(c["COMPUTE_DK"], c["COMPUTE_DV"])]
        return f"{job} {c['BLOCK_K']}x{c['BLOCK_Q']}"
    if name in ("bwd_dq_inreg_kernel", "bwd_dkdv_inreg_kernel"):
        mode = "bf16" if not c["FP8"] else "fp8"
        return f"{name[4:-7]} {mode} {c['BLOCK_Q']}x{c['BLOCK_K']}"
    if name == "quantize_kernel":
        rot = " rotated" if c["X_ROTATE"] or c["Y_ROTATE"] else ""
        return f"quantize{rot} rows{c['ROW_CHUNK']}/cols{c['COL_GROUP']}"
    if name == "_partials_kernel":
        return f"stats partials sub{c['SUB']}{' transposed' if c.get('TRANSPOSED') else ''}"
    if name == "_finish_kernel":
        return "stats finish"
    return name


def full_label(rec: dict) -> str:
    """:func:`launch_label` plus, for a quantization or statistics launch, what it computes per
    operand: the launches of one recipe differ in that (the forward's Q alone, K and V; the
    backward's Q and dO, K and V)."""
    return f"{launch_label(rec)} {_copies_label(rec)}".strip()


# Per operand of a statistics launch: (constexpr suffix, letter): rotated rows, their extremes, the
# sum (the key mean), the raw amax.
_STATS_FLAGS = (("_ROTATE", "R"), ("_EXT", "e"), ("_SUM", "s"), ("_AMAX", "a"))


def _copies_label(rec: dict) -> str:
    """A quantization launch's copies per operand (``X:rc Y:r``: X row- and channel-wise, Y row-wise);
    a statistics launch's statistics per operand (``X:Resa Y:a Z:Rea``, letters in :data:`_STATS_FLAGS`)."""
    c = rec["consts"]
    if rec["kernel"] == "quantize_kernel":
        return " ".join(f"{op}:{'r' * bool(c.get(op + '_ROW'))}{'c' * bool(c.get(op + '_COL'))}" for op in ("X", "Y"))
    if rec["kernel"] == "_partials_kernel":  # Z: a third operand (Q beside K and V)
        ops = ("X", "Y", "Z") if c.get("Z_OP") else ("X", "Y")
        return " ".join(f"{op}:" + "".join(ch for key, ch in _STATS_FLAGS if c.get(op + key)) for op in ops)
    return ""


def _offline_inputs(d: int, mask_kind: str, seq: int):
    from hf_fp8_attention.masking import MaskSpec

    hq, hkv = 4, 2  # GQA: the dK/dV kernels loop over the group
    sq = sk = seq
    if mask_kind == "causal":
        mask = MaskSpec(causal=True)
    elif mask_kind == "dense":
        mask, sq, sk = MaskSpec(), seq - 24, seq - 24  # not a multiple of the tiles: every loop compiled
    elif mask_kind == "window":
        mask = MaskSpec(causal=True, window=seq // 3)
    elif mask_kind == "varlen":
        cu = torch.tensor([0, seq // 3, seq], dtype=torch.int32)
        longest = seq - seq // 3
        mask = MaskSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    else:
        raise ValueError(f"unknown mask kind {mask_kind!r}; known: {', '.join(OFFLINE_MASKS)}")
    q, do = (torch.randn(1, hq, sq, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, hkv, sk, d, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, do, mask


def offline_main(args) -> None:
    """Compile every launch of the recipes, head dims and masks in ``args`` for sm_90a and print the
    table. The kernels must be imported with the interpreter off (``main`` sees to it)."""
    from hf_fp8_attention.kernels import backward, forward

    # The host code asks the device two things: TMA (sm_90 has it) and the SM count (H200: 132).
    forward._use_tma = lambda device: forward.os.environ.get(forward.TMA_ENV, "1") != "0"
    forward.sm_count = lambda index: 132
    backward._check_limits = lambda q, config: None

    class EveryCandidate:
        """Stands in for the forward's tuner: compiles every candidate of the space it is given."""

        def pick(self, key, launch, candidates=None):
            space = candidates if candidates is not None else forward.FORWARD_TUNER.candidates
            for cand in space:
                launch(cand)
            return space[0]

    tuner = forward.FORWARD_TUNER
    forward.FORWARD_TUNER = EveryCandidate()
    forward.FORWARD_TUNER.candidates = tuner.candidates
    rows = []
    try:
        with OfflineCompiler(args.capability) as comp:
            for d in args.dims:
                for recipe in args.recipes:
                    for mask_kind in args.masks:
                        comp.context = dict(d=d, recipe=recipe, mask=mask_kind)
                        q, k, v, do, mask = _offline_inputs(d, mask_kind, args.seq)
                        config = recipe_config(recipe)
                        scale = d ** -0.5
                        # As autograd runs them: what the forward computes for the backward handed over.
                        saved = {}
                        out, lse = forward.triton_forward(q, k, v, scale=scale, mask=mask, config=config,
                                                          for_backward=saved)
                        backward.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config,
                                                 kv_stats=saved.get("kv_stats"), q_stats=saved.get("q_stats"),
                                                 kv_copies=saved.get("kv_copies"))
                        print(f"compiled d={d} {recipe} {mask_kind}", file=sys.stderr, flush=True)
            rows = comp.records
    finally:
        forward.FORWARD_TUNER = tuner
    print_table(rows, args)


def print_table(rows: list[dict], args) -> None:
    print(f"# offline compile for sm_{args.capability}a · triton {triton.__version__} · torch {torch.__version__} · "
          f"Hq=4, Hkv=2, bf16; ptxas -v registers and spills, Triton's shared memory (limit {SMEM_LIMIT} B per "
          f"block)")
    print(f"# masks: causal S={args.seq}; dense non-causal S={args.seq - 24} (partial tiles: every loop compiled); "
          f"window causal, w=S/3; varlen causal, two packed sequences")
    header = f"{'d':>4s} {'recipe':15s} {'mask':7s} {'launch':44s} {'warps':>5s} {'stages':>6s} {'regs':>4s} " \
             f"{'spill st/ld B':>13s} {'smem B':>7s}"
    print(header)
    seen = set()
    for r in rows:
        label = full_label(r)
        key = (r["d"], r["recipe"], r["mask"], label, r["warps"], r["stages"])
        if key in seen:  # the same launch made twice in one call (e.g. the tuner's pick)
            continue
        seen.add(key)
        if "error" in r:
            print(f"{r['d']:4d} {r['recipe']:15s} {r['mask']:7s} {label:44s} {r['warps']:5d} {r['stages']:6d} "
                  f"does not compile: {r['error']}")
            continue
        flag = "  OVER" if r["smem"] > SMEM_LIMIT else ""
        print(f"{r['d']:4d} {r['recipe']:15s} {r['mask']:7s} {label:44s} {r['warps']:5d} {r['stages']:6d} "
              f"{r['regs']:4d} {r['spill_st']:6d}/{r['spill_ld']:<6d} {r['smem']:7d}{flag}")
    if args.mix:
        print()
        print(f"# instruction mix of the launches labelled *{args.mix}* (whole kernel, static SASS counts)")
        print(f"{'d':>4s} {'recipe':15s} {'mask':7s} {'launch':44s} {'total':>6s} "
              + " ".join(f"{name:>9s}" for name in (*MIX_CLASSES, "other")))
        shown = set()
        for r in rows:
            if "error" in r or args.mix not in launch_label(r):
                continue
            label = full_label(r)
            if (r["d"], r["recipe"], r["mask"], label) in shown:
                continue
            shown.add((r["d"], r["recipe"], r["mask"], label))
            m = r["mix"]
            print(f"{r['d']:4d} {r['recipe']:15s} {r['mask']:7s} {label:44s} {m['total']:6d} "
                  + " ".join(f"{m[name]:5d} {100 * m[name] / m['total']:2.0f}%" for name in (*MIX_CLASSES, "other")))
    # Per head dim and launch: the worst case over recipes and masks.
    print()
    print("# worst case per launch over the recipes and masks above")
    print(f"{'d':>4s} {'launch':44s} {'warps':>5s} {'stages':>6s} {'max regs':>8s} {'max spill st B':>14s} "
          f"{'max smem B':>10s} {'cases':>5s}")
    worst: dict = {}
    counted = set()
    for r in rows:
        if "error" in r:
            continue
        key = (r["d"], full_label(r), r["warps"], r["stages"])
        if key + (r["recipe"], r["mask"]) in counted:  # a launch made twice in one call
            continue
        counted.add(key + (r["recipe"], r["mask"]))
        w = worst.setdefault(key, dict(regs=0, spill=0, smem=0, n=0))
        w["regs"] = max(w["regs"], r["regs"])
        w["spill"] = max(w["spill"], r["spill_st"])
        w["smem"] = max(w["smem"], r["smem"])
        w["n"] += 1
    for (d, label, warps, stages), w in sorted(worst.items()):
        flag = "  OVER" if w["smem"] > SMEM_LIMIT else ""
        print(f"{d:4d} {label:44s} {warps:5d} {stages:6d} {w['regs']:8d} {w['spill']:14d} {w['smem']:10d} "
              f"{w['n']:5d}{flag}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=None, help="tokens (GPU default 8192, offline 1024)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--offline", action="store_true", help="compile for sm_90a on this machine, no GPU")
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 256], help="offline: head dims")
    parser.add_argument("--recipes", type=lambda s: s.split(","), default=list(OFFLINE_RECIPES),
                        help="offline: comma-separated recipe names (recipe+flag switches a boolean option on)")
    parser.add_argument("--masks", type=lambda s: s.split(","), default=list(OFFLINE_MASKS),
                        help=f"offline: comma-separated mask kinds ({', '.join(OFFLINE_MASKS)})")
    parser.add_argument("--capability", type=int, default=90, help="offline: compute capability (90: H100/H200)")
    parser.add_argument("--mix", default=None,
                        help="offline: instruction mix of the launches whose label contains this")
    parser.add_argument("--quant-launch", default="", metavar="KEY=VALUE,...",
                        help="offline: entries of quantize.ROTATED_LAUNCH to compile with "
                             "(e.g. maxnreg=128,row_stages=3)")
    parser.add_argument("--stats-launch", default="", metavar="KEY=VALUE,...",
                        help="offline: entries of sequence_stats.ROTATED_PARTIALS to compile with (e.g. stages=1)")
    parser.add_argument("--switch", default="", metavar="module.NAME=0|1,...",
                        help="booleans of the kernel modules to compile with (e.g. sequence_stats.TRANSPOSED_ROTATION=1)")
    args = parser.parse_args(argv)
    if args.offline:  # before any kernel module is imported: they are decorated compiled, not interpreted
        os.environ.pop("TRITON_INTERPRET", None)
    if args.switch:
        from switch_ab import fixed

        for (module, attr), value in fixed(args.switch).items():
            setattr(module, attr, value)
    if args.quant_launch or args.stats_launch:
        apply_launch_tables(parser, args.quant_launch, args.stats_launch)
    if args.offline:
        args.seq = args.seq or 1024
        offline_main(args)
    else:
        args.seq = args.seq or 8192
        gpu_main(args)


if __name__ == "__main__":
    main()
