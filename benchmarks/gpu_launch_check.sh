#!/usr/bin/env bash
# One GPU job for the direct launch path (hf_fp8_attention/kernels/launch.py): its GPU test
# (bit-identical outputs and gradients with the path on and off), the launch-path benchmark, and
# the host breakdown of the SmolLM2-shaped training step with the path off and on. About 4 minutes
# warm. Logs go to $OUT (default /tmp/gpu_launch_check_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_launch_check_out}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh  # $OUT, PYTHONPATH, $XDIST
# shellcheck disable=SC2086
python -m pytest -v -m gpu -rs $XDIST tests/gpu/test_direct_launch.py 2>&1 | tee "$OUT/pytest_direct_launch.log" \
  | grep -E "FAILED|ERROR|passed|failed"
test_rc=${PIPESTATUS[0]}
python benchmarks/launch_path.py 2>&1 | tee "$OUT/launch_path.log"
bench_rc=${PIPESTATUS[0]}
python benchmarks/host_breakdown.py --attn sdpa,fp8_delta,fp8_delta_fast --direct both 2>&1 | tee "$OUT/host_breakdown.log"
bench_rc=$(( bench_rc || PIPESTATUS[0] ))
echo "gpu_launch_check: pytest rc=$test_rc, bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
