#!/usr/bin/env bash
# One GPU job for the rotating statistics launch as Hᵀxᵀ (kernels.sequence_stats.TRANSPOSED_ROTATION):
# the forward's K/V statistics in the xH form and under the TRANSPOSED_PARTIALS variants (time, and
# bits against the default), its GPU tests (against the xH form; the recipes against the emulation with
# it off, its default on), the forward's K/V step with it off / on (prep_bench.py), and the op's
# forward beside cuDNN with it off / on (switch_ab.py: its bits differ by design). About 8 minutes cold. Logs and results go to $OUT
# (default /tmp/gpu_transposed_stats_out), named by the GPU (h200_ / h100_) and $TAG (default v51).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_transposed_stats_out}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh  # $OUT, PYTHONPATH, $XDIST, gpu_pytest
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in *H200*) P=h200;; *) P=h100;; esac
P=${P}_${TAG:-v51}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python benchmarks/experiments/kv_stats_split.py \
  --only "xH,T 4w s32,T 4w s32 st2,T 4w s32 r128,T 4w s64,T 8w s64,T 8w s64 st2,T 4w s16" \
  > "$OUT/${P}_kv_stats_transposed.log" 2>&1
grep -v Warn "$OUT/${P}_kv_stats_transposed.log"
gpu_pytest "$OUT/${P}_pytest_stats_transposed.log" "${TEST_S:-240}" tests/gpu/test_sequence_stats_fold.py \
  tests/gpu/test_recipes_kernel.py -k "transposed or row_form or folded"
timeout 90 python benchmarks/prep_bench.py --recipe fp8_delta --seq 8192 --batch 2 --sweep \
  --keys TRANSPOSED_ROTATION > "$OUT/${P}_prep_transposed_fp8_delta.log" 2>&1
grep -E "^\||fastest|DIFFER|identical" "$OUT/${P}_prep_transposed_fp8_delta.log" | head -14
timeout 150 python benchmarks/switch_ab.py --switch sequence_stats.TRANSPOSED_ROTATION --op fwd \
  --seqlens 8192,16384 --rounds 2 --rep 60 --out-dir "$OUT" --tag "${P}_transposed_fwd_ab" \
  > "$OUT/${P}_transposed_fwd_ab.log" 2>&1
grep "^|" "$OUT/${P}_transposed_fwd_ab.md"
