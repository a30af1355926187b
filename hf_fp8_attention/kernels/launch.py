"""Kernel launches that skip Triton's per-call argument binding once a specialization is known.

``kernel[grid](*args, **meta)`` binds every argument on every call: it specializes each one
(dtype and 16-byte alignment of pointers, divisibility and range of integers), builds the
compiled-kernel cache key from that, checks the kernel's globals, and only then calls the
compiled kernel's launcher (Gluon kernels alike). For these kernels' 18-71 arguments that is 20-87
µs of host time per launch on the benchmark machine, of which the launcher itself takes 7-27 µs
(``benchmarks/experiments/launch_probe.py``; ``benchmarks/NOTES.md``, "Host time").

:func:`launch` keys each call by a cheap superset of Triton's specialization (:func:`arg_key`
per runtime argument, positional or keyword, the exact values of the constexprs and options), lets
Triton bind, compile and launch the first call of each key, and afterwards calls that key's
compiled kernel directly with the arguments in the kernel's parameter order
(``CompiledKernel[grid](*args)``, Triton's own launcher, launch hooks included). Two calls Triton
would specialize differently never share a key, so a cached kernel is only ever run on arguments it
was compiled for (``tests/test_launch.py`` checks the superset against Triton's specializer).

The direct path is on by default on a CUDA machine under the Triton releases whose specialization
the tests check the key against (:data:`DIRECT_TRITON`: 3.6 on the GPU, 3.9 on the CPU, and the
releases between), off elsewhere; ``HF_FP8_ATTENTION_DIRECT_LAUNCH=0`` / ``=1`` or
:data:`DIRECT_LAUNCH` (set by a process, e.g. a benchmark alternating the two paths step by step)
override that. On the H100 it takes 0.1-0.7 ms off the host time of the fast recipe's fwd+bwd
(2.7-5.4 ms there) and 0.5-7% off the time of a host-bound training step (``benchmarks/NOTES.md``,
"End to end", v61). Under the Triton interpreter, with a kernel's pre-run hooks, or with an argument
type it cannot key, every call takes Triton's path.
"""
from __future__ import annotations

import inspect
import os

import torch
import triton
from triton.runtime.jit import JITFunction

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton without host-side tensor descriptors
    TensorDescriptor = None
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:  # Triton without Gluon
    GluonTensorDescriptor = None

DIRECT_LAUNCH_ENV = "HF_FP8_ATTENTION_DIRECT_LAUNCH"
# The direct path on (True) or off (False) in this process whatever the environment says; None: the
# environment variable where set, else the default (default_direct_launch).
DIRECT_LAUNCH: bool | None = None
# The Triton releases (major, minor) whose specialization and launcher the direct path's key and
# calls are tested against (tests/test_launch.py): there it is on unless the environment says 0.
DIRECT_TRITON = ((3, 6), (3, 9))

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


class Unkeyable(TypeError):
    """An argument whose specialization :func:`arg_key` does not know: the call takes Triton's path."""


def arg_key(a) -> object:
    """What Triton's specialization of runtime argument ``a`` depends on, or finer.

    Tensors: dtype and whether the data pointer is 16-byte aligned. Integers: equal to 1 (Triton
    passes a 1 as a constant), divisible by 16, and the narrowest of int32 / int64 / wider that
    holds them. Floats and bools: their type only (Triton does not specialize on their values).
    None: itself. Host tensor descriptors: the base's dtype, the block shape and the options;
    Gluon's also their shared-memory layout (a frozen dataclass: hashed by value). Raises
    :class:`Unkeyable` for anything else.
    """
    cls = a.__class__
    if cls is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, not a.data_ptr() & 15)
    if cls is int:
        width = 32 if _INT32[0] <= a <= _INT32[1] else 64 if _INT64[0] <= a <= _INT64[1] else 128
        return (a == 1, not a & 15, width)
    if cls is float or cls is bool:
        return cls
    if a is None:
        return None
    if TensorDescriptor is not None and cls is TensorDescriptor:
        return (cls, a.base.dtype, tuple(a.block_shape), a.padding, getattr(a, "round_f32_to_tf32", None))
    if GluonTensorDescriptor is not None and cls is GluonTensorDescriptor:
        return (cls, a.base.dtype, tuple(a.block_shape), a.padding, a.layout)
    raise Unkeyable(f"no launch key for an argument of type {cls.__name__}")


def triton_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a Triton version string such as ``"3.6.0"`` or ``"3.9.0+git1a2b"``."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def default_direct_launch(version: str, cuda: bool) -> bool:
    """The direct path's default: on a machine with CUDA, under a Triton ``version`` within
    :data:`DIRECT_TRITON`."""
    return cuda and DIRECT_TRITON[0] <= triton_release(version) <= DIRECT_TRITON[1]


def nvidia_cuda_available() -> bool:
    """A CUDA device under NVIDIA's CUDA (not HIP): the key is checked against Triton's NVIDIA backend."""
    return torch.cuda.is_available() and torch.version.hip is None


_DEFAULT: bool | None = None  # this process's default_direct_launch, found at its first launch


def direct_launch_enabled() -> bool:
    """Whether launches take the direct path: :data:`DIRECT_LAUNCH` where set, else the environment
    variable where set (``0`` or empty: off), else :func:`default_direct_launch` of this process."""
    if DIRECT_LAUNCH is not None:
        return DIRECT_LAUNCH
    env = os.environ.get(DIRECT_LAUNCH_ENV)
    if env is not None:
        return env not in ("", "0")
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = default_direct_launch(triton.__version__, nvidia_cuda_available())
    return _DEFAULT


class DirectLauncher:
    """The compiled kernels of one ``@triton.jit`` kernel by launch key (see the module docstring).

    Attributes read by the tests and benchmarks: ``direct`` / ``bound`` count the calls that took
    the direct path / Triton's.
    """

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        params = inspect.signature(kernel.fn).parameters
        self.names = tuple(params)
        self.defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        # Runtime parameters a call may pass by keyword (e.g. TMA descriptors after the constexprs):
        # keyed by arg_key like positional ones, not by value (a descriptor is unhashable, a tensor
        # would be keyed by its identity).
        self.runtime = frozenset(p.name for p in kernel.params if not p.is_constexpr)
        self.compiled: dict[tuple, tuple] = {}
        self.direct = 0
        self.bound = 0

    def tail(self, n_args: int, meta: dict) -> tuple:
        """The values of the parameters after the first ``n_args`` (positional) ones, in signature
        order: from ``meta`` by name, else the parameter's default."""
        return tuple(meta[n] if n in meta else self.defaults[n] for n in self.names[n_args:])

    def __call__(self, grid: tuple, args: tuple, meta: dict) -> None:
        kernel = self.kernel
        try:
            if getattr(kernel, "pre_run_hooks", None):
                raise Unkeyable("the kernel has pre-run hooks")
            runtime = self.runtime
            if runtime.isdisjoint(meta):  # constexprs and options only: keyed by value, in one C call
                meta_key = tuple(meta.items())
            else:
                meta_key = tuple((k, arg_key(v)) if k in runtime else (k, v) for k, v in meta.items())
            key = (torch.cuda.current_device(), meta_key, tuple(map(arg_key, args)))
            entry = self.compiled.get(key)  # TypeError: an unhashable keyword value
        except TypeError:  # Unkeyable included
            self.bound += 1
            kernel[grid](*args, **meta)
            return
        if entry is not None:
            self.direct += 1
            compiled, tail = entry
            if tail is None:  # runtime values by keyword: this call's, not the first call's
                tail = self.tail(len(args), meta)
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *tail)
            return
        self.bound += 1
        compiled = kernel[grid](*args, **meta)
        if hasattr(compiled, "__getitem__"):  # a Triton whose kernels launch so (3.6-3.9 do)
            keyed_by_value = self.runtime.isdisjoint(meta)  # the tail then holds constexprs and options only
            self.compiled[key] = (compiled, self.tail(len(args), meta) if keyed_by_value else None)


_LAUNCHERS: dict[int, DirectLauncher] = {}


def launcher(kernel) -> DirectLauncher | None:
    """The :class:`DirectLauncher` of ``kernel`` (made on first use), or None where calls must take
    Triton's path: direct launching off, or ``kernel`` not a compiled-mode ``JITFunction`` (the
    interpreter's kernels are not)."""
    if not isinstance(kernel, JITFunction) or not direct_launch_enabled():
        return None
    found = _LAUNCHERS.get(id(kernel))
    if found is None or found.kernel is not kernel:
        found = _LAUNCHERS[id(kernel)] = DirectLauncher(kernel)
    return found


def launch(kernel, grid: tuple, *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``: runtime arguments positional, constexprs and compile options
    (``num_warps``, ...) by keyword; through :class:`DirectLauncher` where :func:`launcher` gives one."""
    direct = launcher(kernel)
    if direct is None:
        kernel[grid](*args, **meta)
    else:
        direct(grid, args, meta)


__all__ = ["DIRECT_LAUNCH", "DIRECT_LAUNCH_ENV", "DIRECT_TRITON", "DirectLauncher", "Unkeyable", "arg_key",
           "default_direct_launch", "direct_launch_enabled", "launch", "launcher", "nvidia_cuda_available",
           "triton_release"]
