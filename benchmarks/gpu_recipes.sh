#!/usr/bin/env bash
# The recipes on the GPU machine in one call: their kernel tests (against the emulation, packing,
# real activations), then the attention benchmark of every recipe against SDPA, then the other GPU
# kernel tests in the time left. Logs and results under $OUT (default /tmp/gpu_recipes_out).
#   TAG=h200_v20 bash benchmarks/gpu_recipes.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_recipes_out}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh  # $OUT, PYTHONPATH, $XDIST
tag=${TAG:-gpu_recipes}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
timeout "${TEST_S:-200}" python -m pytest -q -p no:cacheprovider -rs $XDIST tests/gpu/test_recipes_kernel.py 2>&1 \
  | tee "$OUT/pytest_recipes.log" | tail -25
timeout "${BENCH_S:-270}" python benchmarks/bench_attention.py --seqlens 8192,16384 --heads 16 --dims 128,64 \
  --modes fwd,fwdbwd --configs fp8_delta,fp8_delta_fast,fp8_stale,fp8_stale_fast,fp8_delta_tile --passes 1 \
  --memory --out-dir "$OUT" --tag "$tag" 2>&1 | tee "$OUT/bench.log" | tail -45
timeout "${MORE_S:-90}" python -m pytest -q -p no:cacheprovider -x $XDIST tests/gpu/test_forward_kernel.py \
  tests/gpu/test_backward_kernel.py 2>&1 | tee "$OUT/pytest_kernels.log" | tail -8
