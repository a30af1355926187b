"""GPU time of the operand-preparation launches of one recipe (sequence statistics, then FP8
quantization), step by step as the forward and the backward issue them, against the memory
bandwidth a plain copy reaches; ``--sweep`` tries other launch tables, each checked bit for bit.

    python benchmarks/prep_bench.py --recipe fp8_delta_fast --seq 8192 --batch 2
    python benchmarks/prep_bench.py --recipe fp8_delta_fast --sweep --out results/

Steps (bf16 inputs ``(B, H, S, D)``, dense, no GQA): ``fwd_kv`` (K's and V's statistics, with the
backward's, and their forward copies), ``fwd_q`` (Q's statistics and rotated copy, where the recipe
quantizes Q first, with the backward's Q statistics where it hands them over), ``bwd_qdo`` (dO's
statistics, and Q's where the forward does not hand them over; both copies of each), ``bwd_kv``
(the backward's copies of K and V from the forward's statistics). ``fwd_kv`` and ``bwd_qdo`` (where
no Q statistics are handed over) run in one launch where ``one_read_prep`` allows, as the op does
(the sweep's ``ONE_READ`` entry times both ways). Each is timed whole
(``triton.testing.do_bench_cudagraph``: GPU time, no host launch cost) and as its statistics
launches alone. Bytes: every input read once per launch that reads it, every code and scale written
once; TB/s over that, beside ``torch.clone``'s read + write rate on one input in the same run.

``--sweep``: one table entry at a time (``SWEEP``), every step rerun; a candidate whose outputs
differ from the current table's in any bit is reported as such (the tables are meant to change the
speed only). The fastest bit-identical candidate per table is printed, not applied.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_fp8_attention.kernels import quantize as qz  # noqa: E402
from hf_fp8_attention.kernels import sequence_stats as ss  # noqa: E402
from hf_fp8_attention.kernels.forward import _quantizes_q_first  # noqa: E402
from hf_fp8_attention.kernels import one_read_prep as orp  # noqa: E402
from hf_fp8_attention.kernels.operands import (  # noqa: E402
    backward_kv_copies, backward_q_copies, copies_for, stats_for, stats_then_copies,
)
from quantize_bench import _time_us  # noqa: E402  (CUDA-graph median, us)
from recipe_names import apply_launch_tables, recipe_config  # noqa: E402



class ModuleSwitch:
    """A module's global read and written as a table entry (``table[key]``), so that SWEEP can flip it."""

    def __init__(self, module):
        self.module = module

    def __getitem__(self, key):
        return getattr(self.module, key)

    def __setitem__(self, key, value):
        setattr(self.module, key, value)


ONE_READ = ModuleSwitch(orp)
QUANTIZE_SWITCHES = ModuleSwitch(qz)
STATS_SWITCHES = ModuleSwitch(ss)
# (table, key, values): each entry is swept alone, the others at their current values.
SWEEP = [
    # The channel-wise copies with sequence-wide scales: division by FMAs instead of div.rn.
    (QUANTIZE_SWITCHES, "COL_FMA_DIVISION", (False, True)),
    # The statistics and copies of fwd_kv and bwd_qdo in one launch (kernels/one_read_prep.py) or two.
    (ONE_READ, "ONE_READ", (False, True)),
    (orp.ONE_READ_LAUNCH, "row_chunk", (16, 32)),
    (orp.ONE_READ_LAUNCH, "col_group", (8, 16, 32)),
    (orp.ONE_READ_LAUNCH, "row_stages", (None, 2)),
    (qz.ROTATED_LAUNCH, "num_warps", (4, 8)),
    (qz.ROTATED_LAUNCH, "row_chunk", (32, 64, 128)),
    (qz.ROTATED_LAUNCH, "col_group", (32, 64, 128)),
    # 128 registers: two 8-warp programs per SM (the backward's K+V launch takes 136-162 uncapped)
    (qz.ROTATED_LAUNCH, "maxnreg", (None, 128)),
    (qz.ROTATED_LAUNCH, "row_stages", (None, 2, 3)),
    # tiles per program: the row-wise loop pipelined across tiles, the Hadamard matrix loaded once a program
    (qz.ROTATED_LAUNCH, "tiles", (None, 2, 4, 8)),
    # the channel-wise copy's next slice loaded before the current one is cast and stored
    (qz.ROTATED_LAUNCH, "col_prefetch", (None, True)),
    (qz.QUANT_LAUNCH, "col_prefetch", (None, True)),
    (ss.ROTATED_PARTIALS, "num_warps", (2, 4, 8)),
    (ss.ROTATED_PARTIALS, "sub", (16, 32, 64)),  # 16: 160-166 registers; K's mean sums other slices
    (ss.ROTATED_PARTIALS, "elementwise", (False, True)),
    # Element-wise extremes for smoothed operands too (K's): 255 registers and a spill at 32-token
    # slices, 176 and none at 16 (offline, sm_90a); K's mean then sums other slices at 16.
    (ss.ROTATED_PARTIALS, "elementwise_smoothed", (False, True)),
    # The slice loop's pipelining: the compiler's default (3) holds 242-252 registers and 50 KB of shared
    # memory, 4 programs per SM; 1 holds 174-176 and 42 KB, 5 (results/cpu_stats_partials_registers.txt)
    (ss.ROTATED_PARTIALS, "stages", (None, 1, 2)),
    # The rotation as Hᵀxᵀ: channels on the dot's M axis, reductions over tokens inside a warp (wgmma
    # from 4 warps on); the shift then sums rotated rows, so its bits change.
    (STATS_SWITCHES, "TRANSPOSED_ROTATION", (False, True)),
    (ss.TRANSPOSED_PARTIALS, "num_warps", (4, 8)),
    (ss.TRANSPOSED_PARTIALS, "sub", (16, 32, 64)),
    (ss.TRANSPOSED_PARTIALS, "stages", (None, 1, 2, 4)),
    # The partials launch's slices by TMA at TRANSPOSED_PARTIALS["tma_stages"] (the same bits): loads
    # in flight without registers (experiments/kv_stats_split.py times the depths).
    (STATS_SWITCHES, "TMA_LOADS", (False, True)),
    # The fold's loads: one chunk's partials at a time, or several issued together (the same bits).
    (STATS_SWITCHES, "FOLD_LOADS", (1, 8, 32)),
]
TABLE_NAMES = {id(qz.ROTATED_LAUNCH): "quantize.ROTATED_LAUNCH", id(qz.QUANT_LAUNCH): "quantize.QUANT_LAUNCH",
               id(ONE_READ): "one_read_prep",
               id(QUANTIZE_SWITCHES): "quantize", id(STATS_SWITCHES): "sequence_stats",
               id(ss.TRANSPOSED_PARTIALS): "sequence_stats.TRANSPOSED_PARTIALS",
               id(orp.ONE_READ_LAUNCH): "one_read_prep.ONE_READ_LAUNCH",
               id(ss.ROTATED_PARTIALS): "sequence_stats.ROTATED_PARTIALS"}


def steps(q, k, v, do, config):
    """{name: (whole step, its statistics alone, bytes moved)} as the forward and backward run them."""
    bk, bq, pow2 = config.block_k, config.block_q, config.pow2_scales
    nbytes = q.numel() * q.element_size()
    codes = q.numel()  # one byte per element (D is a power of two here)

    def copies_bytes(cs):
        return sum(codes for c in cs for on in (c.row, c.col) if on)

    out = {}
    kc_f, vc_f = copies_for("k", config, row=True, col=False), copies_for("v", config, row=False, col=True)
    also = backward_kv_copies(config)

    def fwd_kv_stats():
        return stats_for((k, v), (kc_f, vc_f), also=also)

    def fwd_kv():
        return stats_then_copies((k, v), (kc_f, vc_f), block=bk, pow2=pow2, also=also)
    out["fwd_kv"] = (fwd_kv, fwd_kv_stats, 4 * nbytes + copies_bytes((kc_f, vc_f)))
    qc, doc = backward_q_copies(config), copies_for("do", config, row=True, col=True)
    q_stats = None  # the Q statistics the forward hands over (forward.triton_forward)
    if _quantizes_q_first(config):
        qc_f = copies_for("q", config, row=True, col=False)
        q_also = (qc,) if qc_f.needs_stats else None

        def fwd_q_stats():
            return stats_for((q,), (qc_f,), also=q_also)
        if q_also is not None:
            q_stats = fwd_q_stats()[0]

        def fwd_q():
            st = fwd_q_stats()
            return st, qz.quantize_operands((q,), (qc_f,), block=bq, pow2=pow2, stats=st)
        reads = 2 if qc_f.needs_stats else 1
        out["fwd_q"] = (fwd_q, fwd_q_stats, reads * nbytes + copies_bytes((qc_f,)))

    def bwd_qdo_stats():
        if q_stats is not None:
            return (q_stats, *stats_for((do,), (doc,)))
        return stats_for((q, do), (qc, doc))

    def bwd_qdo():
        if q_stats is None:
            return stats_then_copies((q, do), (qc, doc), block=bq, pow2=pow2)
        st = bwd_qdo_stats()
        return st, qz.quantize_operands((q, do), (qc, doc), block=bq, pow2=pow2, stats=st)
    out["bwd_qdo"] = (bwd_qdo, bwd_qdo_stats, (3 if q_stats is not None else 4) * nbytes + copies_bytes((qc, doc)))
    kv_stats = fwd_kv_stats()
    kc, vc = also

    def bwd_kv():
        return qz.quantize_operands((k, v), (kc, vc), block=bk, pow2=pow2, stats=kv_stats)
    out["bwd_kv"] = (bwd_kv, None, 2 * nbytes + copies_bytes((kc, vc)))
    return out


def _flat(obj):
    """Every tensor in a nested result, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _flat(o)]
    return []


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x as integers of its width, so that equality is bit equality (NaN included)."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _same(a, b) -> bool:
    ta, tb = _flat(a), _flat(b)
    return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(_bits(x), _bits(y)) for x, y in zip(ta, tb))


def time_steps(st: dict, reference: dict | None = None) -> dict:
    """{step: (whole us, statistics us or None, identical to ``reference``'s outputs or None)}."""
    res = {}
    for name, (whole, stats, _) in st.items():
        same = None
        if reference is not None:
            same = _same(whole(), reference[name])
        res[name] = (_time_us(whole, rep=50), _time_us(stats, rep=50) if stats is not None else None, same)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="fp8_delta_fast")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--keys", default="", help="comma-separated table entries to sweep (default: all of SWEEP)")
    ap.add_argument("--set", default="", metavar="KEY=VALUE,...",
                    help="entries of quantize.ROTATED_LAUNCH to start from (e.g. row_stages=3): the current "
                         "table for the timings and the sweep, whose bit checks stay against the first table's outputs")
    ap.add_argument("--stats-launch", default="", metavar="KEY=VALUE,...",
                    help="the same for sequence_stats.ROTATED_PARTIALS (e.g. stages=None)")
    ap.add_argument("--one-read", type=int, choices=(0, 1), default=None,
                    help="one_read_prep.ONE_READ for the timings and the sweep (its ONE_READ_LAUNCH entries "
                         "matter only with 1); bit checks against the default's outputs")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    first_tables = (dict(qz.ROTATED_LAUNCH), dict(ss.ROTATED_PARTIALS))
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "recipe": a.recipe,
           "shape": f"B={a.batch} H={a.heads} S={a.seq} D={a.dim} bf16"}
    print(" · ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(a.batch, a.heads, a.seq, a.dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for _ in range(4))
    config = recipe_config(a.recipe)
    st = steps(q, k, v, do, config)
    clone_us = _time_us(lambda: q.clone(), rep=50)
    clone_tbs = 2 * q.numel() * q.element_size() / clone_us / 1e6
    reference = {name: whole() for name, (whole, _, _) in st.items()}
    apply_launch_tables(ap, a.set, a.stats_launch, quant_flag="--set")
    first_one_read = orp.ONE_READ
    if a.one_read is not None:
        orp.ONE_READ = bool(a.one_read)
    if (dict(qz.ROTATED_LAUNCH), dict(ss.ROTATED_PARTIALS), orp.ONE_READ) != (*first_tables, first_one_read):
        same = all(_same(reference[name], whole()) for name, (whole, _, _) in st.items())
        given = (("--set", a.set), ("--stats-launch", a.stats_launch), ("--one-read", a.one_read))
        flags = " ".join(f"{flag} {spec}" for flag, spec in given if spec not in (None, ""))
        print(f"{flags}: outputs {'bit-identical to' if same else 'DIFFER from'} the first tables'", flush=True)
        env["set"] = flags
    base = time_steps(st)
    lines = [f"clone of one input: {clone_us:.1f} us, {clone_tbs:.2f} TB/s (read + write)", "",
             "| step | us | statistics us | bytes (MB) | TB/s | x clone |", "|---|---|---|---|---|---|"]
    for name, (us, stats_us, _) in base.items():
        mb = st[name][2] / 1e6
        tbs = st[name][2] / us / 1e6
        s_txt = f"{stats_us:.1f}" if stats_us is not None else "-"
        lines.append(f"| {name} | {us:.1f} | {s_txt} | {mb:.0f} | {tbs:.2f} | {tbs / clone_tbs:.2f} |")
    lines.append(f"| total | {sum(r[0] for r in base.values()):.1f} | | | | |")
    print("\n".join(lines), flush=True)
    result = {"env": env, "clone_us": clone_us, "steps": {n: r[:2] for n, r in base.items()}, "sweep": []}
    if a.sweep:
        lines += ["", "## sweep (us per step; `same`: outputs bit-identical to the current table's)", "",
                  "| table | entry | value | " + " | ".join(st) + " | total | same |",
                  "|---|---|---|" + "---|" * (len(st) + 2)]
        best = {}
        keys = set(a.keys.split(",")) if a.keys else None
        for table, key, values in SWEEP:
            if keys is not None and key not in keys:
                continue
            current = table[key]
            tname = TABLE_NAMES[id(table)]
            for value in values:
                table[key] = value
                try:
                    r = time_steps(st, reference)
                except Exception as err:  # a shape that does not compile is a row too
                    lines.append(f"| {tname} | {key} | {value} | error: {type(err).__name__} |")
                    print(lines[-1], flush=True)
                    continue
                finally:
                    table[key] = current
                total = sum(x[0] for x in r.values())
                same = all(x[2] for x in r.values())
                result["sweep"].append({"table": tname, "key": key, "value": value, "total": total, "same": same,
                                        "steps": {n: x[:2] for n, x in r.items()}})
                lines.append(f"| {tname} | {key} | {value} | " + " | ".join(f"{x[0]:.1f}" for x in r.values())
                             + f" | {total:.1f} | {'yes' if same else 'NO'} |")
                print(lines[-1], flush=True)
                if same and total < best.get((tname, key), (None, float("inf")))[1]:
                    best[(tname, key)] = (value, total)
        lines.append("")
        lines += [f"fastest bit-identical: {t} {k} = {v} ({tot:.1f} us)" for (t, k), (v, tot) in best.items()]
        if best:
            print("\n".join(lines[-len(best):]), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        stem = os.path.join(a.out, f"prep_bench_{a.recipe}_d{a.dim}")
        with open(stem + ".md", "w") as f:
            f.write(" · ".join(f"{k} {v}" for k, v in env.items()) + "\n\n" + "\n".join(lines) + "\n")
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
