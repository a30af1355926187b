#!/usr/bin/env bash
# One GPU job for the sequence statistics folded in their partials launch
# (kernels.sequence_stats.FOLD_IN_PARTIALS): its GPU test (against the finishing launch, repeated
# calls), the recipe tests with the fold on, then fold off / on alternated: per-kernel GPU time and
# the whole call's wall time at the SmolLM2 (host-bound) and 0.89B Llama attention shapes
# (recipe_cost.py --kernels), and fwd+bwd of the op grid's d = 128 shapes beside SDPA (SKIP_BENCH=1:
# not the grid). About 9 minutes cold, 5 without the grid. Logs and results go to $OUT (default
# /tmp/gpu_fold_stats_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_fold_stats_out}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh  # $OUT, PYTHONPATH, $XDIST, gpu_pytest
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
gpu_pytest "$OUT/pytest_stats_fold.log" 120 tests/gpu/test_sequence_stats_fold.py
# The recipe tests with the fold on (the default; benchmarks/pytest_fold_stats.py sets it in every worker).
gpu_pytest "$OUT/pytest_recipes_fold_on.log" 150 -p pytest_fold_stats tests/gpu/test_recipes_kernel.py
# kernels_ab NAME ROUNDS RECIPE_COST_ARGS...: recipe_cost.py --kernels with the fold off and on,
# alternated ROUNDS times; logs $OUT/NAME_fold{0,1}_r{round}.log, the totals (and the statistics
# launches) on stdout.
kernels_ab() {
  local name=$1 rounds=$2 round fold log
  shift 2
  for round in $(seq "$rounds"); do
    for fold in 0 1; do
      log="$OUT/${name}_fold${fold}_r$round.log"
      timeout 60 python benchmarks/recipe_cost.py "$@" --causal 1 --kernels fp8_delta,fast --fold-stats "$fold" \
        > "$log" 2>&1
      grep -E "fwd\+bwd( wall|:)|_partials|_finish" "$log" | sed "s/^/fold=$fold round $round: /"
    done
  done
}
kernels_ab smollm2_kernels_s2048 2 --batch 1 --heads 9 --kv-heads 3 --dim 64 --seq 2048
kernels_ab llama_kernels_s8192 1 --batch 1 --heads 16 --kv-heads 8 --dim 128 --seq 8192
[ "${SKIP_BENCH:-0}" = "1" ] && exit 0
for fold in 0 1; do
  timeout 130 python benchmarks/bench_attention.py --seqlens 8192,16384 --heads 16 --dims 128 --modes fwdbwd \
    --configs fp8_delta,fp8_delta_fast --passes 2 --fold-stats "$fold" --out-dir "$OUT" --tag "fold_stats$fold" 2>&1 \
    | tail -12
done
