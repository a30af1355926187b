"""Launchers as ``torch.library`` custom ops, the autograd Function, and the choice of implementation.

- :func:`select_backend` decides, per device and config, whether the Triton kernels or the PyTorch
  emulation run (rules in its docstring).
- ``torch.ops.hf_fp8_attention.forward`` / ``.backward`` are custom ops with fake (meta)
  implementations, so ``torch.compile`` traces the attention call as one opaque node (no graph
  break). Their arguments are flat: the :class:`MaskSpec` becomes ``causal``, ``window`` (-1: none),
  the optional ``cu_seqlens`` tensors and ``max_seqlen_q`` / ``max_seqlen_k`` (-1: unknown, read from
  ``cu_seqlens`` on the device); the config travels as its canonical string key; the logit
  modifiers ``softcap`` (None: none) and ``sinks`` (None: none) come last. The backward op returns
  a list: ``[dq, dk, dv]``, and ``dsinks`` after them when there are sinks.
- The forward op carries its autograd formula (the backward op); :class:`FP8AttentionFunction`
  is the entry point: it calls the ops under torch.compile, and in eager mode runs the same
  implementations (:func:`run_forward` / :func:`run_backward`) through a plain autograd Function,
  without the custom-op dispatch. The backward saves O only for the stale delta.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
from typing import Optional

import torch

from . import reference
from .config import Backend, BackwardPrecision, DeltaMode, FP8AttentionConfig
from .masking import NO_WINDOW, MaskSpec

logger = logging.getLogger(__name__)

_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards


@functools.lru_cache(maxsize=None)
def _kernel_unavailable_reason(device_index: int) -> str | None:
    """Why the Triton kernels cannot run on CUDA device ``device_index`` (None if they can)."""
    cap = torch.cuda.get_device_capability(device_index)
    if cap < _MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device_index)} is sm_{cap[0]}{cap[1]}; the FP8 kernels need "
                f"FP8 tensor cores (sm_89 Ada or sm_90 Hopper and newer)")
    try:
        import triton  # noqa: F401

        from .kernels import forward  # noqa: F401
    except Exception as err:  # noqa: BLE001 (report any import failure as the reason)
        return f"Triton is not usable ({type(err).__name__}: {err})"
    return None


def select_backend(device: torch.device | str, config: FP8AttentionConfig) -> Backend:
    """``Backend.TRITON`` or ``Backend.EMULATION`` for tensors on ``device``.

    - ``backend="emulation"``: the PyTorch emulation, on any device.
    - ``backend="auto"``: the Triton kernels for CUDA tensors on an sm_89+ GPU with Triton
      importable; the emulation for CPU (and other non-CUDA) tensors; a RuntimeError for CUDA
      tensors on an older GPU, naming ``attn_implementation="sdpa"`` and ``backend="emulation"``.
    - ``backend="triton"``: the kernels, or a RuntimeError saying why they cannot run.
    """
    device = torch.device(device)
    if config.backend is Backend.EMULATION:
        return Backend.EMULATION
    if device.type != "cuda":
        if config.backend is Backend.TRITON:
            raise RuntimeError(
                f"FP8AttentionConfig(backend='triton') needs CUDA tensors on an FP8-capable GPU (sm_89+), "
                f"got tensors on {device}; use backend='auto' or 'emulation' for the PyTorch emulation, "
                "or attn_implementation='sdpa' for bf16 attention"
            )
        return Backend.EMULATION
    index = device.index if device.index is not None else torch.cuda.current_device()
    reason = _kernel_unavailable_reason(index)
    if reason is not None:
        raise RuntimeError(
            f"FP8 attention kernels cannot run on {device}: {reason}. Use attn_implementation=\"sdpa\" "
            "(bf16 attention) for this model, or FP8AttentionConfig(backend=\"emulation\") to run the FP8 "
            "recipe in PyTorch (correct but slow and memory-hungry)"
        )
    return Backend.TRITON


# ---------------------------------------------------------------------------------------------
# flat op arguments
# ---------------------------------------------------------------------------------------------


_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(FP8AttentionConfig))
_CONFIG_DEFAULTS = FP8AttentionConfig()


def config_key(config: FP8AttentionConfig) -> str:
    """Canonical string of a config (custom ops take strings, not dataclasses).

    Built from plain attribute reads so that torch.compile folds it to a constant without having
    to rebuild the frozen config object (which some torch versions cannot do).
    """
    parts = []
    for name in _CONFIG_FIELDS:
        value = getattr(config, name)
        parts.append(value.value if isinstance(value, enum.Enum) else str(value))
    return "|".join(parts)


@functools.lru_cache(maxsize=64)
def _config_from_key(key: str) -> FP8AttentionConfig:
    values = key.split("|")
    if len(values) != len(_CONFIG_FIELDS):
        raise ValueError(f"hf_fp8_attention: malformed config key {key!r}")
    fields = {}
    for name, text in zip(_CONFIG_FIELDS, values):
        default = getattr(_CONFIG_DEFAULTS, name)
        if isinstance(default, bool):
            fields[name] = text == "True"
        elif isinstance(default, int):
            fields[name] = int(text)
        else:
            fields[name] = text  # enums: coerced and validated by the config itself
    return FP8AttentionConfig(**fields)


_UNKNOWN_LENGTH = -1  # max_seqlen_q / max_seqlen_k of the custom ops when the host does not know them


def _mask_spec(causal: bool, window: int, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
               max_seqlen_k: int) -> MaskSpec:
    """The MaskSpec of the custom ops' flat arguments (inverse of :func:`_flat_mask`)."""
    return MaskSpec(causal=causal, window=None if window == NO_WINDOW else window,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=None if max_seqlen_q < 0 else max_seqlen_q,
                    max_seqlen_k=None if max_seqlen_k < 0 else max_seqlen_k)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def _triton_backward_fn():
    """The FP8 backward kernel's entry point, or None (with one warning) if it is unavailable."""
    try:
        from .kernels.backward import triton_backward
    except Exception as err:  # noqa: BLE001
        _warn_once(f"FP8 attention: the Triton backward kernel is unavailable ({type(err).__name__}: {err}); "
                   "the backward runs in the PyTorch emulation (same numerics, much slower)")
        return None
    return triton_backward


# ---------------------------------------------------------------------------------------------
# the implementations behind both entry points (custom ops, eager autograd Function)
# ---------------------------------------------------------------------------------------------


def _no_autocast(device_type: str):
    """A context that switches autocast off if it is on. The recipe fixes every precision itself:
    an enclosing autocast must not turn the emulation's fp32 matmuls into bf16 ones
    (functional.fp8_attention already cast the inputs). Entering autocast costs host time, so
    it is entered only when on."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def run_forward(q, k, v, scale: float, mask: MaskSpec, config: FP8AttentionConfig,
                softcap: float | None = None, sinks: torch.Tensor | None = None, for_backward: dict | None = None,
                token_major_out: bool = False, hand_over_copies: bool = True):
    """FP8 attention forward on the backend :func:`select_backend` picks.

    ``softcap``, ``sinks (Hq,)`` fp32: the logit modifiers (:mod:`.reference`). Returns
    ``out (B, Hq, Sq, D)`` in q's dtype and ``lse (B, Hq, Sq)`` fp32, both contiguous; with
    ``token_major_out`` O may instead be laid out as a token-major q is
    (:func:`.kernels.forward.output_buffer`: the caller's transpose to ``(B, Sq, Hq, D)`` then needs
    no copy). ``for_backward``: a dict the kernels may leave values in for :func:`run_backward` (its
    ``saved``; the emulation leaves none); ``hand_over_copies``: whether those may include K's and
    V's FP8 copies (:func:`.kernels.forward.triton_forward`).
    """
    with _no_autocast(q.device.type):
        if select_backend(q.device, config) is Backend.TRITON:
            from .kernels.forward import triton_forward

            out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config, softcap=softcap, sinks=sinks,
                                      for_backward=for_backward, token_major_out=token_major_out,
                                      hand_over_copies=hand_over_copies)
        else:
            out, lse = reference.emulated_forward(q, k, v, scale=scale, mask=mask, config=config,
                                                  softcap=softcap, sinks=sinks)
    if not (token_major_out and out.transpose(1, 2).is_contiguous()):
        out = out.contiguous()
    return out, lse.contiguous()


def run_backward(q, k, v, out, lse, dout, scale: float, mask: MaskSpec, config: FP8AttentionConfig,
                 softcap: float | None = None, sinks: torch.Tensor | None = None, saved: dict | None = None):
    """FP8 attention backward on the backend :func:`select_backend` picks: ``(dq, dk, dv)``
    contiguous, shapes/dtypes of q, k, v, followed with ``sinks`` by ``dsinks (Hq,)`` fp32. ``out``
    is read only by the stale delta (None in matched mode); ``dout`` may have any strides.
    ``saved``: what :func:`run_forward` left in its ``for_backward`` for these inputs."""
    grads = None
    saved = saved or {}
    with _no_autocast(q.device.type):
        if select_backend(q.device, config) is Backend.TRITON:
            kernel = _triton_backward_fn()
            if kernel is not None:
                grads = kernel(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config, softcap=softcap,
                               sinks=sinks, kv_stats=saved.get("kv_stats"), q_stats=saved.get("q_stats"),
                               kv_copies=saved.get("kv_copies"))
        if grads is None:
            grads = reference.emulated_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config,
                                                softcap=softcap, sinks=sinks)
    return tuple(g.contiguous() for g in grads)


# ---------------------------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("hf_fp8_attention::forward", mutates_args=())
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    config: str,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention forward: ``out (B, Hq, Sq, D)`` contiguous in q's dtype, ``lse (B, Hq, Sq)`` fp32."""
    mask = _mask_spec(causal, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return run_forward(q, k, v, scale, mask, _config_from_key(config), softcap, sinks)


@attention_forward.register_fake
def _(q, k, v, scale, causal, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, config, softcap=None,
      sinks=None):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.custom_op("hf_fp8_attention::backward", mutates_args=())
def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: Optional[torch.Tensor],
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
    causal: bool,
    window: int,
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    config: str,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """FP8 attention backward: ``[dq, dk, dv]`` contiguous, shapes/dtypes of q, k, v, and with
    ``sinks`` also ``dsinks (Hq,)`` fp32 (a custom op cannot return an optional tensor).

    ``out`` is read only by the stale delta (None in matched mode).
    """
    mask = _mask_spec(causal, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return list(run_backward(q, k, v, out, lse, dout, scale, mask, _config_from_key(config), softcap, sinks))


@attention_backward.register_fake
def _(q, k, v, out, lse, dout, scale, causal, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      config, softcap=None, sinks=None):
    grads = [torch.empty(q.shape, dtype=q.dtype, device=q.device),
             torch.empty(k.shape, dtype=k.dtype, device=k.device),
             torch.empty(v.shape, dtype=v.dtype, device=v.device)]
    if sinks is not None:
        grads.append(torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device))
    return grads


def _flat_mask(mask: MaskSpec) -> tuple:
    """The custom ops' mask arguments: (causal, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k), -1 for no window and for an unknown length."""
    max_q = _UNKNOWN_LENGTH if mask.max_seqlen_q is None else int(mask.max_seqlen_q)
    max_k = _UNKNOWN_LENGTH if mask.max_seqlen_k is None else int(mask.max_seqlen_k)
    return bool(mask.causal), mask.window_arg, mask.cu_seqlens_q, mask.cu_seqlens_k, max_q, max_k


def _saved_for_backward(q, k, v, lse, out, sinks, config: FP8AttentionConfig) -> tuple:
    """What both autograd formulas save: O only for the stale delta (matched mode never reads it),
    and the sinks (None without)."""
    return q, k, v, lse, (out if config.delta is DeltaMode.STALE else None), sinks


def _setup_context(ctx, inputs, output):
    q, k, v, scale, causal, window, cu_q, cu_k, max_q, max_k, key, softcap, sinks = inputs
    out, lse = output
    ctx.save_for_backward(*_saved_for_backward(q, k, v, lse, out, sinks, _config_from_key(key)))
    ctx.args = (scale, causal, window, cu_q, cu_k, max_q, max_k, key, softcap)
    ctx.set_materialize_grads(False)  # an unused LSE output must arrive as None, not zeros


def _backward(ctx, dout, dlse):
    if dlse is not None:
        # The LSE output is an internal of the backward; nothing in the package differentiates it.
        raise RuntimeError("hf_fp8_attention::forward: gradients through the LSE output are not supported")
    if dout is None:
        return (None,) * 13
    q, k, v, lse, out, sinks = ctx.saved_tensors
    grads = torch.ops.hf_fp8_attention.backward(q, k, v, out, lse, dout, *ctx.args, sinks)
    dsinks = grads[3] if sinks is not None else None
    return grads[0], grads[1], grads[2], *(None,) * 9, dsinks


torch.library.register_autograd("hf_fp8_attention::forward", _backward, setup_context=_setup_context)


def _saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks pack what autograd Functions save (activation checkpointing,
    CPU offloading); True where torch no longer tells (the check is a private API)."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, RuntimeError, TypeError):
        return True


def _shape_only(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A stand-in of ``shape`` and ``dtype`` for an input the backward reads the shape of only: one
    NaN element broadcast, so that any read of its values would show in the gradients."""
    return torch.full((1,) * len(shape), float("nan"), dtype=dtype, device=device).expand(shape)


def _copies_to_save(item: tuple) -> tuple[list[torch.Tensor], tuple]:
    """The tensors of a handed-over ``kv_copies`` item (``(K's copies, V's copies, order)``, each
    copies tuple tensors or None) for ``save_for_backward``, and the layout :func:`_copies_from_saved`
    rebuilds the item from."""
    k_all, v_all, order = item
    tensors = [t for t in (*k_all, *v_all) if t is not None]
    return tensors, (tuple(t is not None for t in k_all), tuple(t is not None for t in v_all), order)


def _copies_from_saved(tensors, layout: tuple) -> tuple:
    """The ``kv_copies`` item :func:`_copies_to_save` took apart."""
    k_present, v_present, order = layout
    it = iter(tensors)
    k_all = tuple(next(it) if present else None for present in k_present)
    v_all = tuple(next(it) if present else None for present in v_present)
    return k_all, v_all, order


class _EagerAttention(torch.autograd.Function):
    """The custom ops' autograd formula as a plain autograd Function, for eager calls.

    Same implementations (:func:`run_forward` / :func:`run_backward`), same saved tensors (but for
    K's and V's copies handed to the backward in their place, ``forward.HAND_OVER_KV_COPIES``); it
    skips the custom-op dispatch and the config/mask flattening, which cost about 100 us of host time
    per call on the benchmark GPU machine: at short sequences the GPU waits for the host.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale: float, mask: MaskSpec, config: FP8AttentionConfig, softcap, sinks):
        # With an FP8 backward ahead, the forward's statistics launches also compute those the
        # backward needs of K and V (two launches fewer; small per-(sequence, head) vectors).
        ctx.for_backward = {} if config.backward is BackwardPrecision.FP8 and any(ctx.needs_input_grad) else None
        # K's and V's FP8 copies kept for the backward (forward.HAND_OVER_KV_COPIES) would escape
        # saved-tensor hooks (activation checkpointing, offloading): none then.
        out, lse = run_forward(q, k, v, scale, mask, config, softcap, sinks, for_backward=ctx.for_backward,
                               token_major_out=True, hand_over_copies=not _saved_tensors_hooked())
        # With the copies handed over the backward reads V for its shape alone, and K too without
        # soft-cap and sinks (their statistics read K): those are not saved, so that until its
        # backward a layer keeps the copies (3 bytes per (K, V) element pair) in place of the 16-bit
        # K and V (4), not beside them. The copies are saved tensors, so autograd frees them after
        # the backward, or keeps them for another one (retain_graph), as it does K and V.
        handed = ctx.for_backward.pop("kv_copies", None) if ctx.for_backward is not None else None
        copies, ctx.copies_layout = _copies_to_save(handed[0]) if handed else ([], None)
        drop_k, drop_v = bool(handed) and softcap is None and sinks is None, bool(handed)
        ctx.dropped = (k.shape, k.dtype) if drop_k else None, (v.shape, v.dtype) if drop_v else None
        ctx.save_for_backward(*_saved_for_backward(q, None if drop_k else k, None if drop_v else v, lse, out, sinks,
                                                   config), *copies)
        ctx.args = (scale, mask, config, softcap)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lse, out, sinks, *copies = ctx.saved_tensors
        saved = ctx.for_backward
        if ctx.copies_layout is not None:  # a list of its own for each backward, which that backward empties
            saved = {**saved, "kv_copies": [_copies_from_saved(copies, ctx.copies_layout)]}
            k, v = (t if t is not None else _shape_only(*like, q.device) for t, like in zip((k, v), ctx.dropped))
        grads = run_backward(q, k, v, out, lse, dout, *ctx.args, sinks, saved=saved)
        dsinks = grads[3] if sinks is not None else None
        return grads[0], grads[1], grads[2], None, None, None, None, dsinks


class FP8AttentionFunction:
    """``out = attention(q, k, v)`` in FP8, with the configured backward (shapes: see reference.py).

    ``FP8AttentionFunction.apply(q, k, v, scale, mask, config, softcap=None, sinks=None)`` (sinks:
    ``(Hq,)`` fp32, differentiable):

    - under ``torch.compile`` (and for tensors that are not plain CPU/CUDA tensors: meta, fake,
      subclasses) it calls the custom op, flattening the mask and config into its arguments; the
      op carries its autograd formula (``register_autograd``), so the compiler sees one op node
      and never needs to rebuild the MaskSpec / config objects;
    - in eager mode it runs the same implementations through :class:`_EagerAttention`, without
      the custom-op dispatch; with gradients disabled, the forward alone (nothing is made for a
      backward: inputs that require grad would otherwise still have the forward keep it).

    O is saved for the backward only with the stale delta. In eager mode O may be token-major
    (:func:`.kernels.forward.output_buffer`); the custom op's is contiguous, as its fake says.
    """

    @staticmethod
    def apply(q, k, v, scale: float, mask: MaskSpec, config: FP8AttentionConfig, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling() or not all(_plain(t) for t in (q, k, v)):
            out, _ = torch.ops.hf_fp8_attention.forward(q, k, v, scale, *_flat_mask(mask), config_key(config),
                                                        softcap, sinks)
            return out
        if not torch.is_grad_enabled():  # no graph to record: nothing is computed or kept for a backward
            return run_forward(q, k, v, scale, mask, config, softcap, sinks, token_major_out=True)[0]
        return _EagerAttention.apply(q, k, v, scale, mask, config, softcap, sinks)


def _plain(t: torch.Tensor) -> bool:
    """A plain tensor on a device with real storage (not meta/fake, not a tensor subclass)."""
    return type(t) is torch.Tensor and t.device.type in ("cuda", "cpu")
