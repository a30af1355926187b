"""Per-kernel host cost of Triton's launch path against a direct call of the compiled kernel's
launcher: the measurement that priced the direct launch path (``results/h200_v25_launch_probe.log``;
``benchmarks/launch_path.py`` measures the path as built).

Columns, median host µs per launch of one fwd+bwd (q (1, 9, 2048, 64), k/v (1, 3, 2048, 64), causal):
``full`` = ``kernel[grid](*args, **meta)``; ``binder`` = Triton's argument binding alone; ``key`` =
its cache-key lookup; ``direct`` = ``CompiledKernel.run`` with the bound values; ``argkey`` = a
Python key of every argument's type, alignment and integer class (what a direct path must compute).

    PYTHONPATH=. python benchmarks/experiments/launch_probe.py
"""
import statistics, sys, time
import torch, triton
from triton.runtime.jit import JITFunction, compute_cache_key
from triton import knobs
sys.path.insert(0, ".")
from hf_fp8_attention import RECIPES, fp8_attention

CAP = {}
orig = JITFunction.run
def rec(self, *args, grid, warmup, **kwargs):
    kw = dict(kwargs)
    k = orig(self, *args, grid=grid, warmup=warmup, **kwargs)
    CAP.setdefault((self.fn.__name__, len(CAP)), (self, args, grid, kw, k))
    return k
JITFunction.run = rec

def med(fn, n=300):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)

def argkey(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15)
    if type(a) is int:
        return (a == 1, a & 15, -2**31 <= a < 2**31)
    return a if a is None or type(a) is bool else type(a)

q = torch.randn(1, 9, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, 3, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, 3, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
do = torch.randn_like(q)
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
for name in ["fp8_delta", "fp8_delta_fast"]:
    cfg = RECIPES[name]
    for _ in range(3):
        out = fp8_attention(q, k, v, causal=True, config=cfg)
        out.backward(do)
    CAP.clear()
    out = fp8_attention(q, k, v, causal=True, config=cfg); out.backward(do)
    torch.cuda.synchronize()
    JITFunction.run = orig
    tot = {"full": 0, "binder": 0, "key": 0, "direct": 0, "argkey": 0}
    for (kname, i), (fn, args, grid, kw, kern) in sorted(CAP.items(), key=lambda x: x[0][1]):
        dev = torch.cuda.current_device()
        binder = fn.device_caches[dev][4]
        kcache = fn.device_caches[dev][1]
        kwb = dict(kw); kwb["debug"] = False; kwb["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, spec, opts = binder(*args, **kwb)
        vals = tuple(bound.values())
        g = grid(bound) if callable(grid) else grid
        g = tuple(g) + (1,) * (3 - len(g))
        stream = torch.cuda.current_stream().cuda_stream
        t_full = med(lambda: fn[grid](*args, **kw))
        t_bind = med(lambda: binder(*args, **kwb))
        t_key = med(lambda: compute_cache_key(kcache, spec, opts))
        t_dir = med(lambda: kern.run(g[0], g[1], g[2], stream, kern.function, kern.packed_metadata, None, None, None, *vals))
        t_ak = med(lambda: (tuple(map(argkey, args)), tuple(kw.items())))
        for n_, t_ in zip(tot, (t_full, t_bind, t_key, t_dir, t_ak)):
            tot[n_] += t_
        print(f"{name:15s} {kname:24s} args {len(vals):3d}: full {t_full:6.1f}  binder {t_bind:6.1f}  key {t_key:5.1f}  "
              f"direct {t_dir:6.1f}  argkey {t_ak:5.1f} us", flush=True)
    print(f"{name}: {len(CAP)} launches, totals (us): " + ", ".join(f"{a} {b:.0f}" for a, b in tot.items()), flush=True)
    JITFunction.run = rec
