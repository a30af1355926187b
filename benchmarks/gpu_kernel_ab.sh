#!/usr/bin/env bash
# One GPU job for a kernel change: the GPU tests it reaches (pytest -k $TESTS_K), then the attention
# benchmark of this checkout and of another one ($OLD: a folder holding that checkout's
# hf_fp8_attention/ and benchmarks/, e.g. `git archive HEAD~1 hf_fp8_attention benchmarks | tar -x -C
# DIR`), alternated $ROUNDS times, each run beside SDPA (cuDNN, flash) so that every ratio is from
# one run. Logs and results under $OUT (default /tmp/gpu_kernel_ab_out): bench_{new,old}_R.md/json.
#   OLD=.gpu_old TESTS_K="fast or ds_head" bash benchmarks/gpu_kernel_ab.sh --configs fp8_delta_fast
# Env: TEST_S / BENCH_S (time limits, s), SKIP_TESTS=1, RESUME_LOGS (benchmarks/pytest_gpu_resume.py).
# Arguments go to bench_attention.py after the defaults below (d = 64 and 128, H = 16, 16k tokens,
# S = 8k and 16k, bwd and fwd+bwd).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_kernel_ab_out}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh  # $OUT, PYTHONPATH, $XDIST, gpu_pytest
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
test_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  gpu_pytest "$OUT/pytest_gpu.log" "${TEST_S:-300}" -k "${TESTS_K:-fast}" tests/gpu
  test_rc=$?
fi
bench=(--seqlens 8192,16384 --heads 16 --dims 64,128 --modes bwd,fwdbwd --passes 1 --out-dir "$OUT")
bench_rc=0
for round in $(seq 1 "${ROUNDS:-1}"); do
  for side in new old; do
    if [ "$side" = new ]; then root=$PWD; else root=${OLD:?OLD: the other checkout\'s folder}; fi
    PYTHONPATH="$root:$PYTHONPATH" timeout "${BENCH_S:-240}" python "$root/benchmarks/bench_attention.py" \
      "${bench[@]}" --tag "bench_${side}_${round}" "$@" 2>&1 | tee "$OUT/bench_${side}_${round}.log" | tail -30
    bench_rc=$(( bench_rc || PIPESTATUS[0] ))
  done
done
echo "gpu_kernel_ab: pytest rc=$test_rc, bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
