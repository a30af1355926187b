"""Compile the attention kernels for sm_90 on any machine (no GPU) and, optionally, compare their SASS
with another checkout's.

The Triton interpreter runs the kernels' maths on the CPU but never compiles them, so it misses
what only the compiler rejects (a constexpr turned runtime value, a layout it cannot lower); this
builds each kernel as ``triton.compile`` does for an H200 (``GPUTarget("cuda", 90, 32)``), with the
logit modifiers (soft-cap, K-smoothing's row constant, sinks) off and on.

    python benchmarks/compile_sm90.py                       # compile every variant, print sizes
    python benchmarks/compile_sm90.py --against /path/to/other/checkout
    python benchmarks/compile_sm90.py --gluon                   # the Gluon kernels' resources

``--against``: the SASS of each kernel with the modifiers off, this checkout against the other
one's (e.g. ``git worktree add /tmp/main main``), instruction by instruction with the parameter
offsets masked: identical when the modifiers compile away (the other checkout's kernels need not
know the modifiers; their arguments are matched by name).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Arguments by name: fp8 codes, int32 offsets, bf16 tensors, fp32 scalars; other pointers are fp32
# (scales, statistics), other scalars i32.
FP8_PTRS = {"k_codes_ptr", "vt_codes_ptr", "k_desc", "vt_desc", "q_codes_ptr", "QR", "KR", "KCT", "VR", "DOR", "QCT",
            "DOCT"}
INT_PTRS = {"cu_q_ptr", "cu_k_ptr", "tile_off_ptr", "CU_Q", "CU_K", "TOFF_K", "TOFF_Q"}
BF16_PTRS = {"q_ptr", "out_ptr", "DO", "O", "DQ", "DK", "DV", "Q", "K", "V"}
FLOATS = {"qk_scale", "tau", "softcap"}
INTS = {"H", "G", "HQ", "HKV", "SQ", "SK", "D", "NT", "S_PAD", "SQ_TOTAL", "SK_TOTAL", "SK_PAD", "SQ_PAD", "NT_K",
        "OUT_SB", "OUT_SH", "OUT_SS", "Q_SB", "Q_SH", "Q_SS",
        "NT_Q", "N_BLK", "Q_RB", "Q_RH", "Q_CH"}
MODS = {"off": (False, False, False), "softcap": (True, False, False), "sinks": (False, True, True),
        "all": (True, True, True)}  # (SOFTCAP, ROW_SHIFT, SINK)


def _signature(kernel, constexprs: dict) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in FP8_PTRS:
            sig[name] = "*fp8e4nv"
        elif name in INT_PTRS:
            sig[name] = "*i32"
        elif name in BF16_PTRS:
            sig[name] = "*bf16"
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name.endswith("_ptr") or (name.isupper() and name not in INTS):
            sig[name] = "*fp32"
        else:
            sig[name] = "i32"
    return sig


def variants(mods: str):
    """(name, kernel, constexprs, num_warps) of each kernel the modifiers reach: d = 128, causal,
    the default recipe's forward and pre-quantized backward launches, the hybrid in-register ones."""
    from hf_fp8_attention.config import FP8AttentionConfig, FP8Format
    from hf_fp8_attention.kernels import backward_fp8, backward_inreg, forward
    from hf_fp8_attention.kernels.constants import tl_fp8

    softcap, shift, sink = MODS[mods]
    flags = dict(SOFTCAP=softcap, ROW_SHIFT=shift, SINK=sink)
    e4m3 = tl_fp8(FP8Format.E4M3)
    fwd = dict(forward._kernel_meta(FP8AttentionConfig(), 128, True, False, False, 0, False, True), BLOCK_M=128,
               FMA_BOUND=0.0)  # the exact exponent (kernels/exponent.py)
    yield "forward", forward._fwd_kernel, {**fwd, **flags}, 8
    common = dict(HEAD_D=128, BLOCK_D=128, CAUSAL=True, HAS_WINDOW=False, VARLEN=False, POW2=False, DS_DTYPE=e4m3,
                  DS_MAX=448.0, INTERPRET=False, KV_HEAD=False, COL_SEQ=True, ALIGNED=True, BLOCK_DO=128,
                  QDO_HEAD=False, **flags)
    for name, stats, grads in (("dq_stats", True, False), ("dq", False, True)):
        yield name, backward_fp8.bwd_dq_fp8_kernel, dict(common, BLOCK_Q=64, BLOCK_K=128, MATCHED=True, DEBUG=False,
                                                         STATS=stats, GRADS=grads), 4
    for name, dk, dv in (("dk", True, False), ("dv", False, True)):
        yield name, backward_fp8.bwd_dkdv_fp8_kernel, dict(common, BLOCK_Q=128, BLOCK_K=64, COMPUTE_DK=dk,
                                                           COMPUTE_DV=dv, P_FIXED=False), 4
    inreg = dict(HEAD_D=128, BLOCK_D=128, BLOCK_Q=128, BLOCK_K=128, FP8=False, CAUSAL=True, HAS_WINDOW=False,
                 VARLEN=False, POW2=False, QKV_DTYPE=e4m3, DO_DTYPE=e4m3, DS_DTYPE=e4m3, DO_MAX=448.0, DS_MAX=448.0,
                 INTERPRET=False, SOFTCAP=softcap, SINK=sink)
    yield "inreg_dq", backward_inreg.bwd_dq_inreg_kernel, dict(inreg, MATCHED=True, DEBUG=False), 4
    yield "inreg_dkdv", backward_inreg.bwd_dkdv_inreg_kernel, inreg, 8


def compile_kernel(kernel, constexprs: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}  # another checkout's kernels
    src = ASTSource(fn=kernel, signature=_signature(kernel, constexprs), constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": 3, "enable_fp_fusion": True})


# A Gluon kernel's constexpr switch -> the module constant that sets it at launch.
GLUON_SWITCHES = {"KV_REGS": "KV_IN_REGISTERS", "QDO_REGS": "QDO_IN_REGISTERS", "Q_REGS": "Q_IN_REGISTERS",
                  "MERGED": "MERGED_WAITS", "PIPELINED": "PIPELINED", "PINGPONG": "PINGPONG",
                  "OUT_STRIDED": "TOKEN_MAJOR_OUT", "P_IN_PLACE": "P_IN_PLACE",
                  "IN_PLACE": "A_IN_PLACE", "TREE": "TREE_REDUCTIONS", "FENCE": "EXP_UNDER_DP"}


def compile_gluon(kernel_name: str, d: int, causal: bool, out_dtype: str = "bf16", qdo_head: bool = True,
                  q_in: bool = False):
    """One of the Gluon kernels (``"dkdv"``: kernels/backward_dkdv_gluon.py, ``"dq"``:
    kernels/backward_dq_gluon.py, ``"stats"``: kernels/backward_stats_gluon.py, ``"fwd"``:
    kernels/forward_gluon.py; ``"fwd_persistent"``, ``"dq_persistent"``, ``"stats_persistent"``: their
    persistent forms) built for sm_90a at head dim ``d``, as the package launches it;
    ``qdo_head``: Q's and dO's row scales one per head (the fast recipes) or per token (dK/dV's
    QDO_HEAD); ``q_in``: the forward makes Q's codes from the bf16 input (forward_gluon.QUANTIZE_Q),
    one scale per head with ``qdo_head``. None where this Triton has no Gluon."""
    import triton
    from triton.backends.compiler import GPUTarget

    from hf_fp8_attention.kernels import (
        backward_dkdv_gluon, backward_dq_gluon, backward_stats_gluon, exponent, forward_gluon, forward_persistent,
        gluon_hopper,
    )
    if gluon_hopper.gluon is None:
        return None
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(block):
        return f"tensordesc<fp8e4nv[{block[0]},{block[1]}],{gluon_hopper._smem_layout(block)!r}>"

    if kernel_name == "dkdv":
        mod = backward_dkdv_gluon
        kernel = mod._dkdv_kernel
        consts = dict(BLOCK_Q=mod.BLOCK_Q, HALF_K=mod.HALF_K)
        descs = dict(q_desc=(mod.BLOCK_Q, d), do_desc=(mod.BLOCK_Q, d), qt_desc=(d, mod.BLOCK_Q),
                     dot_desc=(d, mod.BLOCK_Q), k_desc=(mod.HALF_K, d), v_desc=(mod.HALF_K, d))
        outs = ("DK", "DV")
    elif kernel_name in ("fwd", "fwd_persistent"):
        mod = forward_gluon
        kernel = mod._fwd_kernel if kernel_name == "fwd" else forward_persistent._fwd_persistent_kernel
        consts = dict(HALF_Q=mod.HALF_Q, BLOCK_N=mod.BLOCK_N, LOG2_PMAX=mod.LOG2_PMAX)
        descs = dict(k_desc=(mod.BLOCK_N, d), vt_desc=(d, mod.BLOCK_N))
        if q_in and kernel_name == "fwd_persistent":  # the 16-bit Q by TMA
            consts.update(Q_IN=True, Q_HEAD=qdo_head)
        elif q_in:
            consts.update(q_desc=None, Q_IN=True, Q_HEAD=qdo_head)
        else:
            descs["q_desc"] = (mod.HALF_Q, d)
            consts.update(h_desc=None, Q_IN=False, Q_HEAD=False)
        outs = ("OUT", "Q") if q_in and kernel_name == "fwd" else ("OUT", )
    else:
        mod = backward_dq_gluon if kernel_name.startswith("dq") else backward_stats_gluon
        kernel = getattr(mod, f"_{kernel_name}_kernel")  # _dq_kernel, _dq_persistent_kernel, ...
        consts = dict(HALF_Q=mod.HALF_Q, BLOCK_N=mod.BLOCK_N)
        descs = dict(q_desc=(mod.HALF_Q, d), do_desc=(mod.HALF_Q, d), k_desc=(mod.BLOCK_N, d),
                     v_desc=(mod.BLOCK_N, d))
        if kernel_name.startswith("dq"):
            descs["kt_desc"] = (d, mod.BLOCK_N)
        outs = ("DQ", ) if kernel_name.startswith("dq") else ()
    consts.update(D=d, CAUSAL=causal, STAGES=mod.STAGES, CONSUMER_REGS=mod.CONSUMER_REGS,
                  PRODUCER_REGS=mod.PRODUCER_REGS)
    if "POW2" in kernel.arg_names:
        consts["POW2"] = False
    if "QDO_HEAD" in kernel.arg_names:
        consts["QDO_HEAD"] = qdo_head
    if "HEAD_GROUP" in kernel.arg_names:
        consts["HEAD_GROUP"] = gluon_hopper.head_group(causal)
    # The kernel's layout and schedule switches, from the module's constants of those names.
    consts.update({arg: getattr(mod, name) for arg, name in GLUON_SWITCHES.items() if arg in kernel.arg_names})
    if mod is forward_gluon:  # the forward's waits: merged, and in which order (forward_gluon.merged_mode)
        consts["MERGED"] = forward_gluon.merged_mode()
    elif mod is backward_dkdv_gluon:  # dK/dV's schedule, as launched without GQA (backward_dkdv_gluon.merged_mode)
        consts["MERGED"] = backward_dkdv_gluon.merged_mode(1, causal)
    if "FMA_BOUND" in kernel.arg_names:  # the forward's exponent form (exponent.fma_bound)
        consts["FMA_BOUND"] = exponent.fma_bound()
    sig = {name: "i32" for name in kernel.arg_names}
    sig.update({name: "*fp32" for name in kernel.arg_names if name.isupper() and name not in INTS})
    sig.update({name: desc(block) for name, block in descs.items()})
    if "h_desc" in kernel.arg_names and "h_desc" not in consts:  # the forward's bf16 Hadamard matrix
        layout = gluon_hopper.gl.NVMMASharedLayout.get_default_for([d, d], gluon_hopper.gl.bfloat16)
        sig["h_desc"] = f"tensordesc<bf16[{d},{d}],{layout!r}>"
        if kernel_name == "fwd_persistent":  # and the 16-bit Q's boxes
            layout = gluon_hopper.gl.NVMMASharedLayout.get_default_for([mod.HALF_Q, d], gluon_hopper.gl.bfloat16)
            sig["q_desc"] = f"tensordesc<bf16[{mod.HALF_Q},{d}],{layout!r}>"
    if "SCHED" in kernel.arg_names:
        sig["SCHED"] = "*i32"
    sig.update({name: f"*{out_dtype}" for name in outs})
    sig.update({name: kind for name, kind in (("DS_BOUND", "*i32"), ("qk_scale", "fp32"), ("tau", "fp32"),
                                              ("slack", "fp32"))
                if name in kernel.arg_names})
    sig.update({name: "constexpr" for name in consts})
    src = GluonASTSource(kernel, sig, constexprs={(kernel.arg_names.index(n), ): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=mod.MAXNREG))


def mma_loops(compiled) -> list[dict]:
    """The innermost loops that issue MMAs (a branch back to a label, over < 700 instructions): per
    loop its instruction, MMA, MMA-wait, local-memory (spill) and shuffle counts, from the SASS, and
    the exponentials (MUFU.EX2) between its first two waits. As many waits as MMAs: ptxas
    serialised the wgmmas (its C751x performance notes)."""
    labels, ins, loops = {}, [], []
    for line in _sass_text(compiled).splitlines():
        line = line.strip()
        if re.fullmatch(r"\w+:", line):
            labels[line[:-1]] = len(ins)
        elif "\t" in line and ";" in line:
            ins.append(line.split("\t", 1)[1])
            target = re.search(r"BRA (\w+);", ins[-1])
            if target and target.group(1) in labels:
                body = ins[labels[target.group(1)]:]
                if any("GMMA" in x for x in body) and len(body) < 700:
                    waits = [i for i, x in enumerate(body) if "WARPGROUP.DEPBAR" in x]
                    loops.append(dict(instructions=len(body), mma=sum("GMMA" in x for x in body),
                                      waits=len(waits),
                                      ex2_between_waits=sum("MUFU.EX2" in x for x in body[waits[0]:waits[1]])
                                      if len(waits) > 1 else 0,
                                      stl=sum("STL" in x for x in body), ldl=sum("LDL" in x for x in body),
                                      shfl=sum("SHFL" in x for x in body), max_chain=_chain(body, "FMNMX"),
                                      add_chain=_chain(body, "FADD")))
    return loops


def _chain(body: list[str], opcode: str) -> int:
    """The most ``opcode`` instructions (FMNMX, FADD) one after another on a path of register
    dependencies through one pass of a loop's ``body`` (SASS, in order; its predicates and the
    previous pass's values ignored): the row reductions' depth, which their latency multiplies."""
    depth, best = {}, 0
    for ins in body:
        words = ins.split()
        op = words[1] if words[0].startswith("@") else words[0]
        regs = re.findall(r"\bR(\d+)\b", ins)
        if not regs:
            continue
        here = max((depth.get(r, 0) for r in regs[1:]), default=0) + (op.split(".")[0] == opcode)
        depth[regs[0]] = here
        best = max(best, here)
    return best


def _sass_text(compiled) -> str:
    from triton.tools.disasm import get_sass
    return get_sass(compiled.asm["cubin"])


def sass_lines(compiled) -> list[str]:
    """The instructions of a compiled kernel, parameter offsets masked (their layout moves with the
    argument list)."""
    text = _sass_text(compiled)
    return [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[param]", line.split("\t", 1)[1].strip())
            for line in text.splitlines() if "\t" in line and ";" in line]


def _digest(mods: str) -> dict:
    return {name: sass_lines(compile_kernel(kernel, meta, warps)) for name, kernel, meta, warps in variants(mods)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another checkout: compare the modifiers-off SASS with it")
    parser.add_argument("--gluon", action="store_true",
                        help="the Gluon kernels' shared memory and loops (forward, dK/dV and dQ in each layout)")
    parser.add_argument("--json", action="store_true", help="with --gluon: one JSON line instead of the table")
    parser.add_argument("--digest", action="store_true", help=argparse.SUPPRESS)  # JSON of the off SASS (a child run)
    args = parser.parse_args(argv)
    if args.digest:  # the package on PYTHONPATH (the other checkout's)
        print(json.dumps(_digest("off")))
        return 0
    sys.path.insert(0, str(ROOT))
    if args.gluon:
        from hf_fp8_attention.kernels import (
            backward_dkdv_gluon, backward_dq_gluon, backward_stats_gluon, exponent, forward_gluon,
        )
        rows = []
        # built in each of their LAYOUTS
        layered = {"fwd": forward_gluon, "dkdv": backward_dkdv_gluon, "dq": backward_dq_gluon,
                   "stats": backward_stats_gluon}
        builds = [(name, layout, d, True, False, False) for name, module in layered.items()
                  for layout in module.LAYOUTS for d in module.HEAD_DIMS]
        # dK/dV's default layout with per-token Q and dO scales too (fp8_delta, fp8_stale)
        builds += [("dkdv", next(iter(backward_dkdv_gluon.LAYOUTS)), d, False, False, False)
                   for d in backward_dkdv_gluon.HEAD_DIMS]
        # (the forward above in its exact form) the forward's default layout with the one-FMA exponent
        # (exponent.FMA_EXPONENT)
        builds += [("fwd", next(iter(forward_gluon.LAYOUTS)), d, True, True, False) for d in forward_gluon.HEAD_DIMS]
        # and as it runs by default: Q's codes made by the kernel (forward_gluon.QUANTIZE_Q), one scale
        # per token (fp8_delta) or per head (the fast recipes)
        builds += [("fwd", next(iter(forward_gluon.LAYOUTS)), d, qdo_head, True, True) for d in forward_gluon.HEAD_DIMS
                   for qdo_head in (False, True)]
        # and as the persistent kernel (forward_gluon.PERSISTENT), Q's codes made from the 16-bit Q that
        # TMA brings, one scale per token,
        builds += [("fwd_persistent", None, d, False, True, True) for d in forward_gluon.HEAD_DIMS]
        # and the persistent dQ and statistics kernels (their modules' PERSISTENT)
        builds += [(name, None, d, True, False, False) for name, module in (("dq_persistent", backward_dq_gluon),
                                                                            ("stats_persistent", backward_stats_gluon))
                   for d in module.HEAD_DIMS]
        # and the forward (as it runs by default) and the statistics kernel with their row reductions in
        # the other form than the default (TREE_REDUCTIONS)
        trees = {"fwd": forward_gluon, "stats": backward_stats_gluon}
        builds = [(*build, None) for build in builds]
        builds += [("fwd", next(iter(forward_gluon.LAYOUTS)), d, True, True, True, not forward_gluon.TREE_REDUCTIONS)
                   for d in forward_gluon.HEAD_DIMS]
        builds += [("stats", next(iter(backward_stats_gluon.LAYOUTS)), d, True, False, False,
                    not backward_stats_gluon.TREE_REDUCTIONS) for d in backward_stats_gluon.HEAD_DIMS]
        # and the persistent forward with the warpgroups' ping-pong and the trees (the fast recipes)
        builds += [("fwd_persistent", "q_shared_merged_s3_pingpong", d, True, True, True, True)
                   for d in forward_gluon.HEAD_DIMS]
        for name, layout, d, qdo_head, fma, q_in, tree in builds:
            # the persistent forms causal only: their per-block code is built both ways above
            for causal in (True, ) if name.endswith("_persistent") else (True, False):
                module = layered.get(name.removesuffix("_persistent") if layout else name)
                names = module.LAYOUT_CONSTANTS if layout else ()
                default = [getattr(module, n) for n in names]
                for n, value in zip(names, module.LAYOUTS[layout] if layout else ()):
                    setattr(module, n, value)
                fma_default, exponent.FMA_EXPONENT = exponent.FMA_EXPONENT, fma
                tree_module = trees.get(name.removesuffix("_persistent"))
                tree_default = tree_module.TREE_REDUCTIONS if tree_module else None
                if tree is not None:
                    tree_module.TREE_REDUCTIONS = tree
                try:
                    compiled = compile_gluon(name, d, causal, qdo_head=qdo_head, q_in=q_in)
                finally:
                    for n, value in zip(names, default):
                        setattr(module, n, value)
                    exponent.FMA_EXPONENT = fma_default
                    if tree_module:
                        tree_module.TREE_REDUCTIONS = tree_default
                if compiled is None:
                    print("this Triton has no Gluon")
                    return 3
                rows.append(dict(kernel=name, layout=layout, d=d, causal=causal, qdo_head=qdo_head, fma_exponent=fma,
                                 q_in=q_in, tree=tree_default if tree is None else tree,
                                 shared=compiled.metadata.shared,
                                 spill_stores=sum(line.startswith("STL") for line in sass_lines(compiled)),
                                 mma_loops=mma_loops(compiled)))
                if not args.json:
                    r = rows[-1]
                    label = ((layout or "") + ("" if qdo_head else " (Q, dO per token)")
                             + (" (FMA exp.)" if fma else "") + (" (Q in kernel)" if q_in else "")
                             + ("" if tree is None else f" (trees {'on' if tree else 'off'})"))
                    print(f"{name:5s} {label:16s} d={d:3d} causal={causal!s:5s} {r['shared']:6d} B shared "
                          f"memory, {r['spill_stores']} spill stores in all; MMA loops: {r['mma_loops']}")
        if args.json:
            print(json.dumps(rows))
        return 0
    if args.against is None:
        for mods in MODS:
            for name, kernel, meta, warps in variants(mods):
                compiled = compile_kernel(kernel, meta, warps)
                print(f"{mods:8s} {name:11s} {len(sass_lines(compiled)):6d} instructions, {compiled.metadata.shared:6d} B shared memory")
        return 0
    ours = _digest("off")
    # The other checkout's kernels, each under its own package in a fresh interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(args.against.resolve())
    run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--digest"], cwd=args.against, env=env,
                         capture_output=True, text=True, check=True)
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    same = True
    for name, lines in ours.items():
        equal = lines == theirs.get(name)
        same &= equal
        print(f"{name:11s} {'identical' if equal else 'DIFFERS'} ({len(lines)} instructions)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
