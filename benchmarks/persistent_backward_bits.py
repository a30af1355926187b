"""Which of the persistent backward kernels changes the gradients' bits, and where: the backward of one
call (B = 1, H = 16, 16k tokens, causal, d = 128, ``fp8_delta``, bf16) with the persistent dQ and
statistics kernels (``backward_dq_gluon.PERSISTENT``, ``backward_stats_gluon.PERSISTENT``) off, on,
and each alone, in one pass and in two chunks, each arm run twice; per gradient: equal or not, how
many elements differ, the largest difference.

    python benchmarks/persistent_backward_bits.py > results/TAG.log
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention.kernels import backward, backward_dq_gluon, backward_stats_gluon, forward  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from recipe_names import recipe_config  # noqa: E402  (benchmarks/ is on the path as the script's folder)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(16384 + 1)
    q, k, v, do = (torch.randn(1, 16, 16384, 128, device="cuda", generator=g, dtype=torch.bfloat16)
                   for _ in range(4))
    kw = dict(scale=128 ** -0.5, mask=MaskSpec(causal=True), config=recipe_config("fp8_delta"))
    out, lse = forward.triton_forward(q, k, v, **kw)
    saved = (dict(backward.LAUNCH), backward_dq_gluon.PERSISTENT, backward_stats_gluon.PERSISTENT)
    backward.LAUNCH["backward_chunks_below_peak"] = False  # the chunk count set below, whatever the peak

    def run(dq_on: bool, stats_on: bool, chunks: int):
        backward_dq_gluon.PERSISTENT, backward_stats_gluon.PERSISTENT = dq_on, stats_on
        backward.LAUNCH["backward_chunks"] = chunks
        return backward.triton_backward(q, k, v, out, lse, do, **kw)

    def compare(tag, got, want):
        print(tag, [(name, bool(torch.equal(x, y)), int((x != y).sum()), float((x.float() - y.float()).abs().max()))
                    for name, x, y in zip(("dq", "dk", "dv"), got, want)], flush=True)
    try:
        for chunks in (1, 2):
            off1, on1, off2, on2 = (run(False, False, chunks), run(True, True, chunks), run(False, False, chunks),
                                    run(True, True, chunks))
            compare(f"chunks={chunks} off/off", off1, off2)
            compare(f"chunks={chunks} on/on", on1, on2)
            compare(f"chunks={chunks} on/off", on1, off1)
            compare(f"chunks={chunks} dq only/off", run(True, False, chunks), off1)
            compare(f"chunks={chunks} stats only/off", run(False, True, chunks), off1)
    finally:
        backward.LAUNCH.clear()
        backward.LAUNCH.update(saved[0])
        backward_dq_gluon.PERSISTENT, backward_stats_gluon.PERSISTENT = saved[1:]
    return 0


if __name__ == "__main__":
    sys.exit(main())
