#!/usr/bin/env bash
# One GPU job for FP8AttentionConfig(dq_in_stats=True), dQ formed in the statistics sweep: its GPU
# tests (kernels against the emulation, packing, the fixture's errors), a tile sweep of its launch,
# then the attention benchmark of the fast recipe with and without it beside SDPA (cuDNN, flash),
# d = 64 and 128, 16k tokens, S = 4k-16k, causal and not, forward, backward and fwd+bwd. About 9
# minutes cold. Logs and the benchmark's results go to $OUT (default /tmp/gpu_dq_in_stats_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_dq_in_stats_out}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh  # $OUT, PYTHONPATH, $XDIST
# shellcheck disable=SC2086
python -m pytest -v -m gpu -rs $XDIST -k dq_in_stats tests/gpu/test_recipes_kernel.py 2>&1 \
  | tee "$OUT/pytest_dq_in_stats.log" | grep -E "FAILED|ERROR|passed|failed"
test_rc=${PIPESTATUS[0]}
# The one-sweep launch's tile shapes at 8k causal, B = 2, d = 128: whether LAUNCH["block_free"]
# ["dq_sweep"] should change (the table below runs the committed shape).
python benchmarks/backward_tiles.py --recipe fp8_delta_fast+dq_in_stats --out "$OUT" 2>&1 | tee "$OUT/backward_tiles.log"
tag=${BENCH_TAG:-dq_in_stats}
python benchmarks/bench_attention.py --tag "$tag" --configs fp8_delta_fast,fp8_delta_fast+dq_in_stats,fp8_delta \
  --modes fwd,bwd,fwdbwd --dims 64,128 --heads 16 --seqlens 4096,8192,16384 --passes 1 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
cp "benchmarks/results/$tag.md" "benchmarks/results/$tag.json" "$OUT"/ 2>/dev/null
echo "gpu_dq_in_stats: pytest rc=$test_rc, bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
