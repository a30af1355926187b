"""pytest plugin (``-p pytest_fold_stats``, with benchmarks/ on the path): every sequence statistics
launch of the run folds in its partials launch (``kernels.sequence_stats.FOLD_IN_PARTIALS``), in
each pytest-xdist worker too, whatever the package's default; for benchmarks/gpu_fold_stats.sh."""
from hf_fp8_attention.kernels import sequence_stats

sequence_stats.FOLD_IN_PARTIALS = True
