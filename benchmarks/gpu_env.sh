# Sourced by the GPU scripts (gpu_suite.sh, gpu_recipes.sh) from the repository root, after they
# set OUT: makes $OUT, puts the checkout on PYTHONPATH, and sets XDIST to the pytest-xdist flags.
# Cold runs are mostly Triton compiles: with pytest-xdist, PYTEST_WORKERS processes compile side by
# side (8 on the H200 machine ran the 112 recipe, forward and backward kernel tests cold in 189 s).
# PYTEST_WORKERS=0 turns it off.
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
XDIST=""
if [ "${PYTEST_WORKERS:-8}" != "0" ] && python -c "import xdist" 2>/dev/null; then XDIST="-n ${PYTEST_WORKERS:-8}"; fi
