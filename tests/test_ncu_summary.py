"""benchmarks/ncu_summary.py on a small synthetic Nsight Compute source page (no GPU needed)."""
from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ncu_summary", Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_summary.py")
ncu_summary = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ncu_summary)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
          "stall_barrier", "stall_wait (Not Issued)"]


def _write(path: Path, rows: list[tuple[str, int, int, int, int]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "_k"])
        w.writerow(HEADER)
        for i, (src, samples, executed, wait, barrier) in enumerate(rows):
            w.writerow([hex(i * 16), src, samples, executed, wait, barrier, 0])


def test_summary_finds_the_hottest_loop_and_its_opcodes(tmp_path):
    # A prologue run once, a 4-instruction loop run 1000 times, an epilogue run 500 times.
    rows = [("      LDC R1, c[0x0][0x28]", 5, 1, 5, 0),
            ("      FMUL R2, R3, R4", 10, 1000, 10, 0),
            ("  @!P0 FMNMX.NAN R2, R2, R5, PT", 20, 1000, 0, 20),
            ("      FMUL R6, R2, R2", 30, 1000, 30, 0),
            ("      BRA 0x10", 0, 1000, 0, 0),
            ("      STG.E [R8], R2", 35, 500, 35, 0)]
    path = tmp_path / "k.sass.csv"
    _write(path, rows)
    text = ncu_summary.summarise(str(path))
    assert "4 instructions per warp and iteration, run 1,000 times" in text
    assert "FMUL 2, FMNMX.NAN 1, BRA 1" in text  # predicate stripped, suffix kept in the loop counts
    assert "wait 80.0%, barrier 20.0%" in text  # 80 of 100 samples wait, 20 barrier
    assert "(89% of all executed)" in text  # 4000 of 4501 executed instructions
    # 60 of 100 samples in the loop (run 1000 times), 35 in the epilogue, 5 in the prologue.
    assert "stall samples by execution count: 1,000: 60.0%, 500: 35.0%, 1: 5.0%" in text
    assert "instructions 1-4 (run 1,000 times): 60.0% of samples; FMUL 2, FMNMX 1, BRA 1" in text
    assert "instructions 5-5 (run 500 times): 35.0% of samples; STG 1" in text


def test_summary_names_what_is_wrong_with_other_csv(tmp_path):
    path = tmp_path / "details.csv"
    path.write_text('"ID","Metric Name"\n"0","Duration"\n')
    with pytest.raises(ValueError, match="--page source --csv --print-source sass"):
        ncu_summary.summarise(str(path))
