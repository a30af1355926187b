#!/usr/bin/env bash
# One job of a parity phase on one GPU: every mode as its own process, side by side (the small
# runs are host-bound, so they share a GPU well), each resuming its run folder under RUNS.
#   OUT=/tmp/out RUNS=/tmp/parity bash benchmarks/gpu_parity.sh PHASE MINUTES [examples/parity.py flags]
# e.g.  ... gpu_parity.sh extend 9 --model /tmp/smollm2-135m-instruct.q4_1
#       ... gpu_parity.sh ladder 9 --sizes 120m --seeds 0
# Console logs go to $OUT/PHASE_<mode>.log. Starts are 5 s apart, spreading the processes' start-up
# (corpus tokenization, model loading) over the host's CPUs. MODES overrides parity.py's mode list.
# Needs the package's `train` extra (pip install -e ".[train]": datasets, peft, accelerate) in the
# Python it runs; it stops at once, before any run starts, where one is missing.
set -u
phase=$1 minutes=$2; shift 2
: "${OUT:?set OUT}" "${RUNS:?set RUNS (the run folders; keep them between jobs on the same machine)}"
source "$(dirname "$0")/gpu_env.sh"
for module in datasets peft accelerate; do
  python -c "import $module" 2>/dev/null || { echo "gpu_parity.sh: Python module '$module' is missing (pip install -e \".[train]\")" >&2; exit 2; }
done
modes=${MODES:-$(cd examples && python -c "from parity import MODES; print(*MODES)")}
for m in $modes; do
  python examples/parity.py "$phase" --modes "$m" --out-dir "$RUNS" --max-minutes "$minutes" --no-progress "$@" \
    > "$OUT/${phase}_$m.log" 2>&1 &
  sleep 5
done
wait
tail -n 3 "$OUT"/"${phase}"_*.log
