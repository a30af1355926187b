"""Summarise an Nsight Compute source page (SASS with warp-stall samples) of one kernel launch.

Input: ``ncu -i REPORT.ncu-rep --page source --csv --print-source sass > K.sass.csv`` (see
``ncu_target.py``). Prints, for the whole launch, the warp-stall reasons and the executed
instruction mix, then for its hottest loop body (the instructions that share the execution count
with the largest share of all executed instructions: the interior tile loop) the opcode counts per
warp and iteration, which is what an issue-bound loop's speed follows; last, how the stall samples
split between code run once per warp and loop bodies (what a short launch spends outside its loop).

    python benchmarks/ncu_summary.py dq.sass.csv [more.sass.csv ...]
"""
from __future__ import annotations

import csv
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_sass(path: str) -> list[dict[str, str]]:
    """Rows of the CSV's instruction table (header on the second line)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[1] if len(rows) > 1 else []
    table = [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]
    if not table or SAMPLES not in header or EXECUTED not in header:
        raise ValueError(f"{path}: no SASS rows with '{SAMPLES}' and '{EXECUTED}'; expected the output of "
                         "ncu -i REPORT --page source --csv --print-source sass")
    return table


def opcode(source: str, full: bool = False) -> str:
    """``@!P0 FMNMX.NAN R1, ...`` -> ``FMNMX`` (``FMNMX.NAN`` with ``full``)."""
    words = source.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op if full else op.split(".")[0]


def _count(row: dict[str, str], key: str) -> int:
    return int(row.get(key) or 0)


def summarise(path: str) -> str:
    rows = read_sass(path)
    stall_keys = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    samples = sum(_count(r, SAMPLES) for r in rows) or 1
    executed = sum(_count(r, EXECUTED) for r in rows) or 1
    stalls, mix = Counter(), Counter()
    for r in rows:
        for k in stall_keys:
            stalls[k[len("stall_"):]] += _count(r, k)
        mix[opcode(r["Source"])] += _count(r, EXECUTED)
    lines = [f"{path}: {len(rows)} instructions, {executed:,} warp-instructions executed, {samples:,} stall samples",
             "  stall reasons: " + ", ".join(f"{k} {v / samples:.1%}" for k, v in stalls.most_common(8)),
             "  executed mix: " + ", ".join(f"{k} {v / executed:.1%}" for k, v in mix.most_common(12))]
    weight = Counter()
    for r in rows:
        weight[_count(r, EXECUTED)] += _count(r, EXECUTED)
    weight.pop(0, None)
    if not weight:
        return "\n".join(lines + ["  no instruction was executed"])
    loop_count = max(weight, key=weight.get)
    body = [r for r in rows if _count(r, EXECUTED) == loop_count]
    ops = Counter(opcode(r["Source"], full=True) for r in body)
    body_samples = Counter()
    for r in body:
        body_samples[opcode(r["Source"])] += _count(r, SAMPLES)
    total = sum(body_samples.values()) or 1
    lines += [f"  hottest loop: {len(body)} instructions per warp and iteration, run {loop_count:,} times "
              f"({weight[loop_count] / executed:.0%} of all executed)",
              "    " + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)),
              "    its stall samples by opcode: "
              + ", ".join(f"{k} {v / total:.0%}" for k, v in body_samples.most_common(10))]
    return "\n".join(lines + regions(rows, samples))


def regions(rows: list[dict[str, str]], samples: int, min_share: float = 0.03) -> list[str]:
    """Where the stall samples sit along the code: their share per execution count (in a short
    launch, the count of once-per-warp code against the loop's), then each run of consecutive
    instructions with one execution count that holds at least ``min_share`` of them (prologue,
    loop body, epilogue), with its instruction indices and commonest opcodes."""
    by_count = Counter()
    runs: list[list] = []  # [first index, last index, execution count, samples, opcodes]
    for i, r in enumerate(rows):
        n, smp = _count(r, EXECUTED), _count(r, SAMPLES)
        by_count[n] += smp
        if runs and runs[-1][2] == n:
            runs[-1][1] = i
            runs[-1][3] += smp
            runs[-1][4][opcode(r["Source"])] += 1
        else:
            runs.append([i, i, n, smp, Counter([opcode(r["Source"])])])
    lines = ["  stall samples by execution count: "
             + ", ".join(f"{n:,}: {v / samples:.1%}" for n, v in by_count.most_common(6))]
    for first, last, n, smp, ops in runs:
        if smp / samples >= min_share:
            lines.append(f"    instructions {first}-{last} (run {n:,} times): {smp / samples:.1%} of samples; "
                         + ", ".join(f"{k} {v}" for k, v in ops.most_common(6)))
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        raise SystemExit(2)
    try:
        for p in sys.argv[1:]:
            print(summarise(p))
    except (OSError, ValueError) as err:
        print(f"ncu_summary: {err}", file=sys.stderr)
        raise SystemExit(2) from None
