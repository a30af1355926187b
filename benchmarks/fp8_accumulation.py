"""Hopper's FP8 MMA accumulation promoted to full FP32, for a whole benchmark process.

An FP8 wgmma on sm_90 adds its products into the accumulator after aligning them to the largest
exponent among them, keeping ~13 mantissa bits (``tests/hopper_accumulator.py`` models it), and
Triton never promotes that accumulator there by default (``max_num_imprecise_acc_default`` is
2**30 on sm_90). With ``--promote-accumulation N`` every Triton and Gluon kernel the process
compiles adds each N k-elements' partial sum into a separate FP32 accumulator with ordinary adds
(N = 32: after every FP8 instruction, the most precise). What it buys: the kernels' errors then
match the emulation's, which multiplies in fp32 (``results/h100_v46_fp8_accumulation.log``). What it
costs: a second, partial accumulator's registers and the adds (compiled offline, every Gluon kernel
spills when promoted after every instruction: ``results/cpu_v46_offline_promoted_accumulation.log``);
the time is for the benchmark to measure.

Compiled kernels are cached in memory by their arguments, not by this option: it must be set before
the process compiles its first kernel, and an A/B runs each side in its own process (and Triton
cache directory, for clean compile times).
"""
from __future__ import annotations

import dataclasses

MIN_EVERY = 32  # one FP8 wgmma instruction's k; Gluon's f32 accumulators refuse fewer
_PROMOTES = "_promotes_fp8_accumulation"


def promote_fp8_accumulation(every: int) -> None:
    """Compile every later Triton/Gluon kernel of this process with FP8 accumulation promoted to FP32
    each ``every`` k-elements (a multiple of 32). Raises if already set to another value."""
    if every < MIN_EVERY or every % MIN_EVERY:
        raise ValueError(f"promotion interval must be a positive multiple of {MIN_EVERY} k-elements, got {every}")
    from triton.backends.nvidia.compiler import CUDABackend

    current = getattr(CUDABackend.parse_options, _PROMOTES, None)
    if current == every:
        return
    if current is not None:
        raise RuntimeError(f"FP8 accumulation already promoted every {current} k-elements in this process")
    original = CUDABackend.parse_options

    def parse_options(self, opts):
        return dataclasses.replace(original(self, opts), max_num_imprecise_acc_default=every)

    setattr(parse_options, _PROMOTES, every)
    CUDABackend.parse_options = parse_options


def add_accumulation_option(parser) -> None:
    """``--promote-accumulation N`` (see the module docstring); apply with :func:`apply_accumulation_option`."""
    parser.add_argument("--promote-accumulation", type=int, default=None, metavar="N",
                        help="FP8 MMA accumulation promoted to FP32 every N k-elements (multiple of 32; 32 is "
                             "after every instruction) in every kernel this run compiles; default: Triton's, "
                             "never on sm_90")


def apply_accumulation_option(parser, args) -> str:
    """Set what ``--promote-accumulation`` asks for, before any kernel compiles; a bad value ends
    the script through ``parser.error``. Returns a note for the scripts' headers ("" if unset)."""
    if args.promote_accumulation is None:
        return ""
    try:
        promote_fp8_accumulation(args.promote_accumulation)
    except ValueError as err:
        parser.error(f"--promote-accumulation: {err}")
    return f"FP8 accumulation promoted to FP32 every {args.promote_accumulation} k-elements"


__all__ = ["MIN_EVERY", "add_accumulation_option", "apply_accumulation_option", "promote_fp8_accumulation"]
