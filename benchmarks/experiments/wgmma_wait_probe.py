"""Where ptxas puts the second of two wgmma waits, on a minimal hand-written PTX kernel (no GPU needed).

FlashAttention-3's order within a warpgroup issues tile t + 1's S and tile t's P·V, waits for S alone
(``wgmma.wait_group 1``), works on the scores (row maxima with shuffles, exponentials, sums) while
P·V runs, and only then waits for P·V (``wgmma.wait_group 0``). The Gluon forward in that order
(``forward_gluon.PV_UNDER_SCORES``) first got the second wait issued before its exponentials. This
probe writes the bare pattern as PTX: two m64n128 wgmmas (S into %a, O into %c), ``wait_group 1``, a
softmax-like pass over %a (two row maxima over 32 values each, quad shuffles unless ``--no-shuffles``,
64 exponentials, their sum), ``wait_group 0``, then O used. It compiles it with the ptxas that
Triton bundles (or ``--ptxas PATH``) for sm_90a and prints the SASS order of the MMAs (G), waits
(W1 / W0), shuffles (s), exponentials (e, counted) and other instructions (counted as ".n").

    python benchmarks/experiments/wgmma_wait_probe.py [--f16] [--no-shuffles] [--fence INSTR] [--ptxas PATH]

``--fence INSTR``: a PTX instruction put just before ``wait_group 0`` (e.g. ``fence.acq_rel.cta``).
Measured (benchmarks/NOTES.md, "Forward"): ptxas 12.8, 12.9 and 13.5 issue W0 six instructions after
W1, before every shuffle and exponential, for e4m3 and f16 operands alike, with the shuffles or
without; behind ``fence.acq_rel.cta`` (or ``membar.cta``, ``fence.sc.cta``) W0 stays after all 64
exponentials, behind ``fence.proxy.async`` or ``bar.sync`` it does not.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile


def probe_ptx(f16: bool, shuffles: bool, fence: str = "") -> str:
    """The PTX of the probe kernel (see the module docstring); ``fence``: an instruction before the
    second wait, or none."""
    shape = "m64n128k16.f32.f16.f16" if f16 else "m64n128k32.f32.e4m3.e4m3"
    tail = ", 1, 1, 0, 0;" if f16 else ", 1, 1;"  # f16 takes the transpose immediates too
    a = ",".join(f"%a{i}" for i in range(64))
    c = ",".join(f"%c{i}" for i in range(64))
    lines = [".version 8.7", ".target sm_90a", ".address_size 64",
             ".visible .entry probe(.param .u64 out, .param .u64 da, .param .u64 db, .param .u64 dv, .param .f32 sc)",
             "{", ".reg .f32 %a<64>;", ".reg .f32 %c<64>;", ".reg .f32 %e<64>;", ".reg .f32 %m<8>;",
             ".reg .b64 %rd<8>;", ".reg .b32 %r<4>;", ".reg .pred %p<2>;", ".reg .f32 %s<2>;",
             "ld.param.u64 %rd1, [out];", "ld.param.u64 %rd2, [da];", "ld.param.u64 %rd3, [db];",
             "ld.param.u64 %rd4, [dv];", "ld.param.f32 %s1, [sc];", "mov.u32 %r1, %tid.x;",
             "cvt.u64.u32 %rd5, %r1;", "shl.b64 %rd5, %rd5, 2;", "add.s64 %rd6, %rd1, %rd5;",
             "setp.ne.u32 %p1, %r1, 12345;"]
    lines += [f"mov.f32 %c{i}, 0f00000000;" for i in range(64)]
    lines += ["wgmma.fence.sync.aligned;",
              f"wgmma.mma_async.sync.aligned.{shape} {{{a}}}, %rd2, %rd3, 0{tail}",
              "wgmma.commit_group.sync.aligned;",
              f"wgmma.mma_async.sync.aligned.{shape} {{{c}}}, %rd2, %rd4, %p1{tail}",
              "wgmma.commit_group.sync.aligned;", "wgmma.wait_group.sync.aligned 1;"]
    for row, (lo, m) in enumerate(((0, 1), (32, 2))):  # an MMA accumulator's two rows a thread holds
        lines += [f"max.f32 %m{m}, %a{lo}, %a{lo + 1};"] + [f"max.f32 %m{m}, %m{m}, %a{i};"
                                                           for i in range(lo + 2, lo + 32)]
        if shuffles:  # the row's four lanes
            for lane in (2, 1):
                lines += [f"shfl.sync.bfly.b32 %r{2 + row}, %m{m}, {lane}, 31, -1;",
                          f"mov.b32 %m{3 + row}, %r{2 + row};", f"max.f32 %m{m}, %m{m}, %m{3 + row};"]
    lines += [f"sub.f32 %e{i}, %a{i}, %m{1 if i < 32 else 2};" for i in range(64)]
    lines += [f"mul.f32 %e{i}, %e{i}, %s1;" for i in range(64)]
    lines += [f"ex2.approx.ftz.f32 %e{i}, %e{i};" for i in range(64)]
    lines += ["add.f32 %m5, %e0, %e1;"] + [f"add.f32 %m5, %m5, %e{i};" for i in range(2, 64)]
    lines += ([f"{fence.rstrip(';')};"] if fence else []) + ["wgmma.wait_group.sync.aligned 0;"]
    lines += [f"fma.rn.f32 %c{i}, %c{i}, %m5, %e{i};" for i in range(64)]
    lines += ["add.f32 %m6, %c0, %c1;"] + [f"add.f32 %m6, %m6, %c{i};" for i in range(2, 64)]
    lines += ["st.global.f32 [%rd6], %m6;", "ret;", "}"]
    return "\n".join(lines) + "\n"


def sass_order(sass: str) -> str:
    """G / W1 / W0 / s / eN / .N: the order of MMAs, waits, shuffles, exponentials and the rest."""
    marks = []
    for line in sass.splitlines():
        if not re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
            continue
        if "GMMA" in line:
            marks.append("G")
        elif "WARPGROUP.DEPBAR" in line:
            marks.append(f" W{int(re.search(r'0x([0-9a-f]+)', line.split('DEPBAR')[1]).group(1), 16)} ")
        elif "SHFL" in line:
            marks.append("s")
        elif "MUFU.EX2" in line:
            marks.append("e")
        else:
            marks.append(".")
    text = "".join(marks)
    return re.sub(r"(e+|\.+)", lambda m: f"{m.group(1)[0]}{len(m.group(1))}", text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--f16", action="store_true", help="f16 operands instead of e4m3")
    parser.add_argument("--no-shuffles", action="store_true", help="the row maxima without the quad shuffles")
    parser.add_argument("--fence", default="", help="a PTX instruction before the second wait, e.g. fence.acq_rel.cta")
    parser.add_argument("--ptxas", default=None, help="ptxas to use (default: the one Triton bundles)")
    args = parser.parse_args(argv)
    import triton  # only for its bundled tools' path

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = args.ptxas or os.path.join(tools, "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "probe.ptx"), os.path.join(tmp, "probe.cubin")
        with open(ptx, "w") as f:
            f.write(probe_ptx(args.f16, not args.no_shuffles, args.fence))
        version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
        subprocess.run([ptxas, "-arch=sm_90a", ptx, "-o", cubin], check=True)
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    print(f"{version}; {'f16' if args.f16 else 'e4m3'}, shuffles {'off' if args.no_shuffles else 'on'}, "
          f"fence {args.fence or 'none'}")
    print(sass_order(sass))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
