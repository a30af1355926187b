"""How many chunks each attention backward of a 0.89B Llama training step runs in
(``kernels.backward.LAUNCH["backward_chunks_below_peak"]``): ``benchmarks/train_step.py`` with
``_chunk_slices`` counted, one warm-up and one timed step.

    python benchmarks/experiments/backward_chunk_count.py 8192,16384 [train_step.py flags]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_step  # noqa: E402
from hf_fp8_attention.kernels import backward  # noqa: E402

chunk_slices, counts = backward._chunk_slices, []


def counted(*args):
    chunks = chunk_slices(*args)
    counts.append(len(chunks))
    return chunks


backward._chunk_slices = counted
train_step.main(["--models", "llama0.9b", "--modes", "eager", "--contexts", sys.argv[1], "--attn", "fp8_delta",
                 "--steps", "1", "--warmup", "1", "--out-dir", "/tmp/backward_chunk_count", *sys.argv[2:]])
print("chunks per attention backward:", counts)
