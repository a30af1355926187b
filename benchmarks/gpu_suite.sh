#!/usr/bin/env bash
# One command for the GPU machine: the GPU test suite (pytest -m gpu), then the attention benchmark,
# the quantization benchmark, the host-overhead benchmark, the model-step benchmark, the training
# step's profile by kernel kind and the launch-path benchmark.
# Logs and the benchmark's results files go to $OUT (default /tmp/gpu_suite_out).
#   TESTS="tests/gpu/test_forward_kernel.py" bash benchmarks/gpu_suite.sh --modes fwd
# Env: TESTS (pytest paths, default: tests), BENCH_TAG (results name, default gpu_suite),
#      SKIP_TESTS=1 / SKIP_BENCH=1, TEST_LIMIT (seconds: pytest gets SIGINT then, and still prints
#      its summary), RESUME_LOGS (earlier pytest_gpu.log files: their passes on the same sources are
#      not rerun; benchmarks/pytest_gpu_resume.py). Failures also go to $OUT/failures.log as they
#      happen. KERNEL_SWITCHES ("module.NAME=0|1,...": kernel switches set for the tests,
#      benchmarks/pytest_kernel_switches.py). Arguments are passed to benchmarks/bench_attention.py.
# The suite takes longer than 10 minutes cold; in parts:
#   TEST_LIMIT=540 SKIP_BENCH=1 bash benchmarks/gpu_suite.sh        # then, with the log carried back:
#   TEST_LIMIT=540 SKIP_BENCH=1 RESUME_LOGS=part1/pytest_gpu.log bash benchmarks/gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_suite_out}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh  # $OUT, PYTHONPATH, $XDIST, gpu_pytest
tag=${BENCH_TAG:-gpu_suite}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv \
  | tee "$OUT/nvidia_smi.txt"
test_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  gpu_pytest "$OUT/pytest_gpu.log" "${TEST_LIMIT:-}" ${TESTS:-tests}
  test_rc=$?
fi
bench_rc=0
if [ -z "${SKIP_BENCH:-}" ]; then
  python benchmarks/bench_attention.py --tag "$tag" "$@" 2>&1 | tee "$OUT/bench.log"
  bench_rc=${PIPESTATUS[0]}
  cp "benchmarks/results/$tag.md" "benchmarks/results/$tag.json" "$OUT"/ 2>/dev/null
  # The quantization kernel against copy bandwidth, and the host time of one training step.
  python benchmarks/quantize_bench.py --out "$OUT" 2>&1 | tee "$OUT/quantize_bench.log"
  bench_rc=$(( bench_rc || PIPESTATUS[0] ))
  python benchmarks/host_overhead.py --cudagraphs --tag "${tag}_host_overhead" 2>&1 | tee "$OUT/host_overhead.log"
  bench_rc=$(( bench_rc || PIPESTATUS[0] ))
  cp "benchmarks/results/${tag}_host_overhead.md" "$OUT"/ 2>/dev/null
  # One training step of a small Llama per attention backend (dense and padded batches).
  python benchmarks/model_step.py --tag "${tag}_model_step" 2>&1 | tee "$OUT/model_step.log"
  bench_rc=$(( bench_rc || PIPESTATUS[0] ))
  cp "benchmarks/results/${tag}_model_step.md" "$OUT"/ 2>/dev/null
  # The 0.89B Llama's training step at 8k by kernel kind, and where the GPU waits for the host.
  python benchmarks/step_profile.py --attn sdpa,fp8_delta --tag "${tag}_step_profile" --out-dir "$OUT" 2>&1 \
    | tee "$OUT/step_profile.log"
  bench_rc=$(( bench_rc || PIPESTATUS[0] ))
  # The launch path's host time, Triton's and the direct one (HF_FP8_ATTENTION_DIRECT_LAUNCH).
  python benchmarks/launch_path.py 2>&1 | tee "$OUT/launch_path.log"
  bench_rc=$(( bench_rc || PIPESTATUS[0] ))
  # One fwd+bwd's host time, forward and backward apart, direct path off / on, and where it goes.
  python benchmarks/experiments/direct_launch_host_split.py > "$OUT/direct_launch_host_split.log" 2>&1
  bench_rc=$(( bench_rc || $? ))
fi
echo "gpu_suite: pytest rc=$test_rc, bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
