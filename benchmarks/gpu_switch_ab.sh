#!/usr/bin/env bash
# One GPU job for a kernel switch that is still off: the GPU tests it reaches with the switch on
# (benchmarks/pytest_kernel_switches.py), then switch_ab.py's timing of the op with the switch on
# and off (CUDA graph, the same bits checked). Logs and results under $OUT (default
# /tmp/gpu_switch_ab_out).
#   SWITCH=forward_gluon.TREE_REDUCTIONS TESTS="tests/gpu/test_gluon_forward.py" \
#     bash benchmarks/gpu_switch_ab.sh --op fwd
# Env: SWITCH (module.NAME[+module.NAME...], required), TESTS (pytest paths, default tests/gpu),
#      TESTS_K (pytest -k expression, default all), TEST_S / AB_S (time limits, s), SKIP_TESTS=1,
#      TAG (results name, default switch_ab). Arguments go to switch_ab.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_switch_ab_out}
: "${SWITCH:?SWITCH: the switch to test and time, module.NAME[+module.NAME...]}"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh  # $OUT, PYTHONPATH, $XDIST, gpu_pytest
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
test_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  on=$(echo "$SWITCH" | sed 's/+/=1,/g; s/$/=1/')
  # shellcheck disable=SC2086
  KERNEL_SWITCHES=$on gpu_pytest "$OUT/pytest_gpu.log" "${TEST_S:-300}" ${TESTS_K:+-k "$TESTS_K"} ${TESTS:-tests/gpu}
  test_rc=$?
fi
timeout "${AB_S:-300}" python benchmarks/switch_ab.py --switch "$SWITCH" --tag "${TAG:-switch_ab}" --out-dir "$OUT" "$@" \
  2>&1 | tee "$OUT/switch_ab.log" | tail -20
ab_rc=${PIPESTATUS[0]}
echo "gpu_switch_ab: pytest rc=$test_rc, switch_ab rc=$ab_rc"
exit $(( test_rc != 0 || ab_rc != 0 ))
