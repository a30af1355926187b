"""Host time of the FP8 forward at the 0.89B Llama layer's shape (q (1, 16, 8192, 128) token-major,
k / v (1, 8, 8192, 128), causal), on a GPU: what the 8k training step's forward waits on
(benchmarks/NOTES.md, "End to end", v60).

Prints, in order: the fast recipe's host time per forward and per forward + backward with the direct
launch path (:mod:`hf_fp8_attention.kernels.launch`, Gluon kernels included) off and on, alternated
over three rounds (median of 200 calls, a sync every 10, not timed); per recipe
the forward's host time through autograd and without gradients, and the host time inside one call
of its pieces (``stats_then_copies``, ``stats_for``, the Gluon launch with its descriptors, the
schedule table, the Triton launches); per kernel launched, ``kernel[grid](...)`` repeated alone
against the direct launch path (:mod:`hf_fp8_attention.kernels.launch`) and its key; a Gluon TMA
descriptor's construction.

    PYTHONPATH=. python benchmarks/experiments/forward_launch_probe.py
"""
import time, sys
import torch, triton
sys.path.insert(0, ".")
from triton.runtime.jit import JITFunction
from hf_fp8_attention import RECIPES, fp8_attention
from hf_fp8_attention.kernels import forward_persistent as fp, forward_gluon as fg, gluon_hopper as gh, forward
from hf_fp8_attention.kernels import launch as L, sequence_stats as ss, quantize as qz
from direct_launch_host_split import host_us  # beside this script

CAP = {}
orig = JITFunction.run
def rec(self, *args, grid, warmup, **kw):
    k = orig(self, *args, grid=grid, warmup=warmup, **kw)
    CAP[self.fn.__name__] = (self, args, grid, dict(kw), k)
    return k
JITFunction.run = rec
S = 8192
q = torch.randn(1, S, 16, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
k = torch.randn(1, S, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
v = torch.randn(1, S, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)

def med(fn):
    """Median host µs of ``fn()`` over 200 calls, a sync every 10 (direct_launch_host_split.host_us)."""
    return host_us(fn, n=200)

cfg = RECIPES["fp8_delta_fast"]
grad = torch.randn_like(q)
def fwd_bwd():
    fp8_attention(q, k, v, causal=True, config=cfg).backward(grad)
for rnd in range(3):
    for direct in (False, True):
        L.DIRECT_LAUNCH = direct
        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        print(f"round {rnd}: fast, direct launch {direct}: forward host "
              f"{med(lambda: fp8_attention(q, k, v, causal=True, config=cfg)):.1f} us, forward + backward host "
              f"{med(fwd_bwd):.1f} us", flush=True)
L.DIRECT_LAUNCH = None
for name in ["fp8_delta_fast", "fp8_delta"]:
    cfg = RECIPES[name]
    for _ in range(3):
        fp8_attention(q, k, v, causal=True, config=cfg)
    torch.cuda.synchronize()
    call = lambda: fp8_attention(q, k, v, causal=True, config=cfg)  # noqa: E731
    print(f"{name}: fp8_attention forward (autograd, grads wanted) {med(call):.1f} us host")
    with torch.no_grad():
        print(f"{name}: fp8_attention forward (no grad) {med(call):.1f} us host")
    acc = {}
    def wrap(mod, fn):
        f = getattr(mod, fn)
        def w(*a, **kw):
            t = time.perf_counter(); r = f(*a, **kw); acc[fn] = acc.get(fn, 0) + time.perf_counter() - t; return r
        setattr(mod, fn, w); return f
    saved = [(forward, "stats_then_copies", wrap(forward, "stats_then_copies")),
             (forward, "stats_for", wrap(forward, "stats_for")),
             (ss, "sequence_stats", wrap(ss, "sequence_stats")),
             (forward, "quantize_operands", wrap(forward, "quantize_operands")),
             (fg, "gluon_forward", wrap(fg, "gluon_forward")),
             (fp, "launch_table", wrap(fp, "launch_table")),
             (ss, "launch_kernel", wrap(ss, "launch_kernel")),
             (qz, "launch_kernel", wrap(qz, "launch_kernel"))]
    n = 100
    for i in range(n):
        if i % 10 == 0:
            torch.cuda.synchronize()
        fp8_attention(q, k, v, causal=True, config=cfg)
    torch.cuda.synchronize()
    for m, fn, f in saved:
        setattr(m, fn, f)
    print(f"{name}: per forward, us host: " + ", ".join(f"{k} {1e6 * t / n:.1f}" for k, t in acc.items()), flush=True)

for kname, (kern, args, grid, kw, compiled) in CAP.items():
    g = grid if isinstance(grid, tuple) else grid({})
    full = med(lambda: kern[g](*args, **kw))
    line = f"{kname}: {len(args)} args; kernel[grid](...) {full:.1f} us"
    try:
        direct = L.DirectLauncher(kern)
        direct(g, args, kw); direct(g, args, kw)
        line += f"; direct path {med(lambda: direct(g, args, kw)):.1f} us ({direct.direct} direct)"
        key = lambda: (torch.cuda.current_device(), tuple(kw.items()), tuple(map(L.arg_key, args)))
        line += f"; key alone {med(key):.1f} us"
    except Exception as e:  # noqa
        line += f"; direct path: {type(e).__name__}: {e}"
    print(line, flush=True)
persistent = CAP.get("_fwd_persistent_kernel")
descs = [a for a in persistent[1] if type(a).__name__ == "TensorDescriptor"] if persistent else []
if descs:
    d = descs[1]
    print(f"Gluon TensorDescriptor(...) {med(lambda: gh.descriptor(d.base, tuple(d.block_shape))):.1f} us each")
