"""The direct launch path (:mod:`hf_fp8_attention.kernels.launch`), without a GPU.

What makes a cached launch safe is checked against Triton itself: its specializer (two arguments
with one launch key must specialize alike) and its argument binder (the direct path must hand the
launcher the values Triton's own binding would, for every launch of a real fwd+bwd). The launch
itself is Triton's ``CompiledKernel[grid]``; running it needs a GPU
(``tests/gpu/test_direct_launch.py``).
"""
import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from hf_fp8_attention import RECIPES, fp8_attention, ops
from hf_fp8_attention.config import Backend
from hf_fp8_attention.kernels import launch as launch_mod
from hf_fp8_attention.kernels.launch import (DIRECT_LAUNCH_ENV, DirectLauncher, Unkeyable, arg_key,
                                              default_direct_launch, launcher)

native = pytest.importorskip("triton._C.libtriton")
if not hasattr(native, "native_specialize_impl"):
    pytest.skip("this Triton has no native specializer to compare with", allow_module_level=True)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

BACKEND = make_backend(GPUTarget("cuda", 90, 32))


def _specialize(a):
    return native.native_specialize_impl(BACKEND, a, False, True, True)


def _sample_arguments() -> list:
    ints = [-(1 << 63), -(1 << 31) - 1, -(1 << 31), -17, -16, -1, 0, 1, 2, 15, 16, 17, 32, (1 << 31) - 16,
            (1 << 31) - 1, 1 << 31, 1 << 32, (1 << 63) - 16, (1 << 63) - 1, 1 << 63, (1 << 64) - 16]
    base = torch.zeros(256, dtype=torch.uint8)
    tensors = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.float8_e4m3fn,
                  torch.float8_e5m2, torch.uint8):
        flat = base.view(dtype)
        tensors += [flat, flat[1:], flat[16 // flat.element_size():]]
    values = ints + [0.0, 1.0, 1.5, -2.0, True, False, None] + tensors
    if launch_mod.TensorDescriptor is not None:
        codes = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
        values += [launch_mod.TensorDescriptor.from_tensor(codes, [64, 128]),
                   launch_mod.TensorDescriptor.from_tensor(codes, [32, 128]),
                   launch_mod.TensorDescriptor.from_tensor(codes.view(torch.uint8), [64, 128])]
    if launch_mod.GluonTensorDescriptor is not None:  # Gluon's descriptors carry their shared-memory layout too
        from triton.experimental.gluon import language as gl
        codes = torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
        # (rows of the tensor, rows of the block, swizzle width, dtype of the view)
        for rows, block, swizzle, dtype in ((128, 64, 128, codes.dtype), (64, 64, 128, codes.dtype),
                                            (128, 64, 64, codes.dtype), (128, 32, 128, codes.dtype),
                                            (128, 64, 128, torch.uint8)):
            layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=8, rank=2)
            values.append(launch_mod.GluonTensorDescriptor.from_tensor(codes[:rows].view(dtype), [block, 128], layout))
    return values


def test_one_launch_key_never_spans_two_triton_specializations():
    values = _sample_arguments()
    keyed = [(arg_key(a), _specialize(a), a) for a in values]
    for (key_a, spec_a, a), (key_b, spec_b, b) in itertools.combinations(keyed, 2):
        if key_a == key_b:
            assert spec_a == spec_b, f"{a!r:.40} and {b!r:.40} share the key {key_a} but Triton gives {spec_a}, {spec_b}"
    # and the key separates what matters here: alignment, the constant 1, the integer widths
    assert arg_key(values[0]) != arg_key(values[4])
    assert len({arg_key(a) for a in values}) > 20


@pytest.mark.parametrize("value", ["text", 3 + 0j, b"bytes", object()])
def test_unknown_argument_types_are_not_keyed(value):
    with pytest.raises(Unkeyable):
        arg_key(value)


def _capture_launches(monkeypatch, recipe: str, gluon: bool = False) -> list:
    """(kernel function, args, keyword arguments) of every launch of one fwd+bwd, kernels stubbed
    (the interpreter's kernels record their call instead of running). ``gluon``: the Hopper path,
    every Gluon kernel taken (they are compiled-mode kernels even under the interpreter) at a shape
    in their scope, the persistent schedule for 132 SMs."""
    import triton.runtime.interpreter as interpreter
    from hf_fp8_attention.kernels import backward, forward, forward_gluon, persistent_schedule

    calls = []
    def record(self, *args, grid=None, warmup=False, **kwargs):
        calls.append((self.fn, args, kwargs))

    for kind in (JITFunction, interpreter.InterpretedFunction):
        monkeypatch.setattr(kind, "run", record)
    monkeypatch.setattr(ops, "select_backend", lambda device, config: Backend.TRITON)
    shape = (256, 128) if gluon else (96, 64)
    if gluon:
        for module in (forward, backward):
            monkeypatch.setattr(module, "gluon_runs", lambda *args, **kwargs: True)
        monkeypatch.setattr(forward_gluon, "q_quantization_reason", lambda *args, **kwargs: None)
        monkeypatch.setattr(persistent_schedule, "sm_count", lambda device: 132)
    torch.manual_seed(0)
    q = torch.randn(1, 4, *shape, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, *shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = fp8_attention(q, k, v, causal=True, config=RECIPES[recipe].replace(backend="triton"))
    out.backward(torch.randn_like(out))
    return calls


def _assert_binder_agrees(calls: list) -> None:
    """The direct path's arguments (positional ones, then :meth:`DirectLauncher.tail`) are, one by
    one, what Triton's binder passes for each captured launch."""
    for fn, args, kwargs in calls:
        kernel = JITFunction(fn)
        binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
        bound, _, _ = binder(*args, **kwargs, debug=False)
        ours = args + DirectLauncher(kernel).tail(len(args), kwargs)
        theirs = tuple(bound.values())
        assert len(ours) == len(theirs), fn.__name__
        for name, a, b in zip(kernel.arg_names, ours, theirs):
            assert a is b or (not isinstance(a, torch.Tensor) and a == b), f"{fn.__name__}.{name}: {a!r:.40} vs {b!r:.40}"


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast", "fp8_stale", "fp8_delta_tile", "hybrid_delta"])
def test_direct_arguments_are_what_tritons_binder_passes(monkeypatch, recipe):
    calls = _capture_launches(monkeypatch, recipe)
    assert len(calls) >= 4
    _assert_binder_agrees(calls)


@pytest.mark.skipif(launch_mod.GluonTensorDescriptor is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast"])
def test_direct_arguments_of_the_gluon_kernels_are_what_tritons_binder_passes(monkeypatch, recipe):
    from hf_fp8_attention.kernels import gluon_hopper

    calls = _capture_launches(monkeypatch, recipe, gluon=True)
    gluon_modules = {"forward_persistent", "backward_stats_gluon", "backward_dq_gluon", "backward_dkdv_gluon"}
    gluon_names = {fn.__name__ for fn, _, _ in calls if fn.__module__.rsplit(".", 1)[-1] in gluon_modules}
    # the forward, the backward's statistics, dQ and dK/dV, each with Gluon descriptors among its arguments
    assert len(gluon_names) == 4, sorted(gluon_names)
    assert all(any(isinstance(a, gluon_hopper.TensorDescriptor) for a in args)
               for fn, args, _ in calls if fn.__name__ in gluon_names)
    _assert_binder_agrees(calls)


def _toy(x_ptr, n, y, BLOCK: tl.constexpr, FLAG: tl.constexpr = 3):
    pass


class _FakeCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


@pytest.fixture
def toy_launcher(monkeypatch):
    """A DirectLauncher over a JITFunction whose ``run`` (Triton's bind, compile and launch)
    records the call and returns a fake compiled kernel that records its launches."""
    kernel = JITFunction(_toy)
    log = []

    def run(*args, grid, warmup, **kwargs):
        log.append(("bound", grid, args))
        return _FakeCompiled(log)

    monkeypatch.setattr(kernel, "run", run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return DirectLauncher(kernel), log


def test_direct_launcher_reuses_a_kernel_only_within_its_key(toy_launcher):
    direct, log = toy_launcher
    buf = torch.zeros(64, dtype=torch.float32)
    direct((4,), (buf, 64, 0.5), dict(BLOCK=16, num_warps=4))
    view = buf[4:]
    direct((8, 2), (view, 128, 1.5), dict(BLOCK=16, num_warps=4))  # same key: aligned, n % 16 == 0
    path, grid, args = log[-1]
    assert (path, grid) == ("direct", (8, 2, 1)) and args[0] is view and args[1:] == (128, 1.5, 16, 3)
    for args, meta in [((buf[1:], 64, 0.5), dict(BLOCK=16, num_warps=4)),  # misaligned pointer
                       ((buf, 1, 0.5), dict(BLOCK=16, num_warps=4)),  # Triton passes a 1 as a constant
                       ((buf, 65, 0.5), dict(BLOCK=16, num_warps=4)),  # not divisible by 16
                       ((buf, 64, 0.5), dict(BLOCK=32, num_warps=4)),  # another constexpr
                       ((buf, 64, 0.5), dict(BLOCK=16, num_warps=8))]:  # another compile option
        direct((4,), args, meta)
        assert log[-1][0] == "bound", (args[1:], meta)
    assert (direct.direct, direct.bound) == (1, 6)


def _toy_desc(x_ptr, n, BLOCK: tl.constexpr, x_desc=None):
    pass


@pytest.mark.skipif(launch_mod.TensorDescriptor is None, reason="Triton without host-side tensor descriptors")
def test_runtime_keyword_arguments_are_keyed_like_positional_ones(monkeypatch):
    """A descriptor passed by keyword (the statistics launch's TMA slices) is keyed by
    :func:`arg_key`, and each direct call passes its own descriptor, not the first call's."""
    kernel = JITFunction(_toy_desc)
    log = []

    def run(*args, grid, warmup, **kwargs):
        log.append(("bound", grid, args, kwargs))
        return _FakeCompiled(log)

    monkeypatch.setattr(kernel, "run", run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    direct = DirectLauncher(kernel)
    buf = torch.zeros(64, dtype=torch.float32)
    codes = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    descs = [launch_mod.TensorDescriptor.from_tensor(c, [64, 128]) for c in (codes, codes[128:], codes.clone())]
    for desc in descs:
        direct((4,), (buf, 64), dict(BLOCK=16, x_desc=desc))
    assert [entry[0] for entry in log] == ["bound", "direct", "direct"]
    assert log[1][2][-1] is descs[1] and log[2][2][-1] is descs[2]  # this call's descriptor
    direct((4,), (buf, 64), dict(BLOCK=16, x_desc=launch_mod.TensorDescriptor.from_tensor(codes, [32, 128])))
    direct((4,), (buf, 64), dict(BLOCK=16, x_desc=None))
    assert [entry[0] for entry in log[3:]] == ["bound", "bound"]  # another block shape; no descriptor
    direct((4,), (buf, 64), dict(BLOCK=16, x_desc=None))
    assert log[-1][0] == "direct" and log[-1][2][-1] is None


def test_unkeyable_calls_and_hooked_kernels_take_tritons_path(toy_launcher):
    direct, log = toy_launcher
    buf = torch.zeros(64, dtype=torch.float32)
    for _ in range(2):
        direct((4,), (buf, 64, "text"), dict(BLOCK=16))
        direct((4,), (buf, 64, 0.5), dict(BLOCK=[16]))  # an unhashable keyword value
    assert [entry[0] for entry in log] == ["bound"] * 4 and not direct.compiled
    direct.kernel.pre_run_hooks.append(lambda *a, **k: None)
    for _ in range(2):
        direct((4,), (buf, 64, 0.5), dict(BLOCK=16))
    assert [entry[0] for entry in log] == ["bound"] * 6


@pytest.mark.parametrize("version, cuda, on", [
    ("3.6.0", True, True), ("3.9.0", True, True), ("3.7.1+git4a2b", True, True), ("3.5.1", True, False),
    ("3.10.0", True, False), ("4.0.0", True, False), ("3.6.0", False, False),
])
def test_direct_path_is_on_by_default_only_under_the_tested_triton_releases_with_cuda(version, cuda, on):
    assert default_direct_launch(version, cuda) is on


def test_launcher_follows_the_switch_the_environment_then_the_default_and_never_the_interpreter(monkeypatch):
    kernel = JITFunction(_toy)
    monkeypatch.setattr(launch_mod, "DIRECT_LAUNCH", None)
    monkeypatch.delenv(DIRECT_LAUNCH_ENV, raising=False)
    for default in (False, True):
        monkeypatch.setattr(launch_mod, "_DEFAULT", default)
        assert (launcher(kernel) is not None) is default
    monkeypatch.setattr(launch_mod, "_DEFAULT", None)  # found afresh: this machine's
    expected = default_direct_launch(triton.__version__, launch_mod.nvidia_cuda_available())
    assert (launcher(kernel) is not None) is expected
    monkeypatch.setenv(DIRECT_LAUNCH_ENV, "0")
    assert launcher(kernel) is None
    monkeypatch.setenv(DIRECT_LAUNCH_ENV, "1")
    monkeypatch.setattr(launch_mod, "_DEFAULT", False)
    assert launcher(kernel) is not None
    monkeypatch.delenv(DIRECT_LAUNCH_ENV)
    monkeypatch.setattr(launch_mod, "DIRECT_LAUNCH", True)  # the module's switch over the environment
    assert launcher(kernel) is not None
    monkeypatch.setenv(DIRECT_LAUNCH_ENV, "1")
    monkeypatch.setattr(launch_mod, "DIRECT_LAUNCH", False)
    assert launcher(kernel) is None
    monkeypatch.setattr(launch_mod, "DIRECT_LAUNCH", None)
    assert launcher(kernel) is launcher(kernel) is not None
    interpreted = triton.runtime.interpreter.InterpretedFunction(_toy)
    assert launcher(interpreted) is None
