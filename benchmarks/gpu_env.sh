# Sourced by the GPU scripts (gpu_suite.sh, gpu_recipes.sh) from the repository root, after they
# set OUT: makes $OUT, puts the checkout on PYTHONPATH, sets XDIST to the pytest-xdist flags and
# defines gpu_pytest (below).
# Cold runs are mostly Triton compiles: with pytest-xdist, PYTEST_WORKERS processes compile side by
# side (8 on the H200 machine ran the 112 recipe, forward and backward kernel tests cold in 189 s).
# PYTEST_WORKERS=0 turns it off. Each worker gets nproc / workers CPU threads (OMP_NUM_THREADS, unless
# set): the tests' emulation side is torch CPU work, and with torch's default of one thread per core
# in every worker, 15 workers on 16 cores did not finish one soft-cap test in 470 s; 2 threads each ran
# the same 15 in 86 s (results/h200_v29_pytest_gpu_softcap_fast.log).
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
XDIST=""
if [ "${PYTEST_WORKERS:-8}" != "0" ] && python -c "import xdist" 2>/dev/null; then
  XDIST="-n ${PYTEST_WORKERS:-8}"
  per_worker=$(( $(nproc) / ${PYTEST_WORKERS:-8} ))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( per_worker > 0 ? per_worker : 1 ))}
fi

# gpu_pytest LOG LIMIT_S PYTEST_ARGS...: the GPU tests (pytest -m gpu) with $XDIST, the resume
# plugin (benchmarks/pytest_gpu_resume.py: RESUME_LOGS, failures to $OUT/failures.log as they
# happen) and the switches plugin (benchmarks/pytest_kernel_switches.py: KERNEL_SWITCHES), verbose
# so that a run cut by its limit (SIGINT after LIMIT_S seconds; empty: none) still names its
# failures. The log goes to LOG, the outcome lines to stdout; returns pytest's status.
gpu_pytest() {
  local log=$1 limit=$2
  shift 2
  # shellcheck disable=SC2206
  local cmd=(python -m pytest -v -m gpu -rs $XDIST -p pytest_gpu_resume -p pytest_kernel_switches "$@")
  if [ -n "$limit" ]; then cmd=(timeout -s INT -k 30 "$limit" "${cmd[@]}"); fi
  FAILURE_LOG="$OUT/failures.log" PYTHONPATH="$PWD/benchmarks:$PYTHONPATH" "${cmd[@]}" 2>&1 \
    | tee "$log" | grep -E "FAILED|ERROR|passed|failed"
  return "${PIPESTATUS[0]}"
}
