"""The public functional API: ``fp8_attention(q, k, v, ...)`` in SDPA layout."""
from __future__ import annotations

import math

import torch

from .config import SUPPORTED_HEAD_DIMS, FP8AttentionConfig
from .identity_cache import IdentityCache
from .masking import MaskSpec
from .ops import FP8AttentionFunction

__all__ = ["SUPPORTED_HEAD_DIMS", "fp8_attention"]
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _autocast(q, k, v):
    """Under ``torch.autocast`` the attention runs in the autocast dtype, as SDPA does.

    This is the common case in mixed-precision training: with fp32 weights, RoPE multiplies the
    bf16 projections by fp32 cos/sin, so q and k arrive in fp32 while v is bf16.
    """
    tensors = (q, k, v)
    if all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        device_type = q.device.type
        # ``meta`` (shape inference, meta-device model init) has no autocast and makes
        # ``torch.is_autocast_enabled`` raise; there is nothing to cast there. (Not
        # ``torch.amp.is_autocast_available``: Dynamo in torch 2.11 cannot trace it, and fullgraph
        # compiles of every model would break.)
        if device_type != "meta" and torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            tensors = tuple(t.to(dtype) for t in tensors)
    return tensors


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fp8_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"fp8_attention: {name} has dtype {t.dtype}; supported: bfloat16, float16, float32")
        if t.dim() != 4:
            raise ValueError(f"fp8_attention: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"fp8_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"fp8_attention: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"fp8_attention: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"fp8_attention: batch sizes differ: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"fp8_attention: head dims differ: q has {q.shape[-1]}, k/v have {k.shape[-1]}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"fp8_attention: head_dim {q.shape[-1]} is not supported (supported: {SUPPORTED_HEAD_DIMS}); "
            "use attn_implementation='sdpa' for this model"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"fp8_attention: query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
        )


def _check_softcap(softcap) -> float | None:
    """``softcap`` as a float (None: no cap); a ValueError unless it is a positive finite number."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"fp8_attention: softcap must be a positive finite number or None, got {softcap!r}")
    return float(softcap)


def _check_sinks(sinks, q: torch.Tensor) -> torch.Tensor | None:
    """``sinks`` as fp32 ``(Hq,)`` (a differentiable cast; None: no sinks), after checking that it is
    a floating-point tensor with one logit per query head, on q's device."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"fp8_attention: sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"fp8_attention: sinks must be a floating-point tensor, got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(
            f"fp8_attention: sinks must have shape (num_query_heads,) = ({q.shape[1]},), one logit per query head, "
            f"got shape {tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"fp8_attention: sinks must be on q's device {q.device}, got {sinks.device}")
    return sinks.to(torch.float32)


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k) -> tuple[int, int] | None:
    """Validate packed-batch offsets; return the longest query / key sequence on the host.

    Reading the values costs a device sync; it happens once per pair of cu_seqlens tensors (every
    layer of a model forward passes the same ones: see :mod:`.identity_cache`). None when not
    packed, or under torch.compile (no host reads there; the kernels read the lengths themselves).
    """
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("fp8_attention: pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is None:
        return None
    if q.shape[0] != 1:
        raise ValueError(f"fp8_attention: packed (cu_seqlens) input must have batch size 1, got {q.shape[0]}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"fp8_attention: {name} must be a 1-D int32/int64 tensor")
        if cu.numel() < 2:
            raise ValueError(f"fp8_attention: {name} needs at least 2 entries (0 and the first sequence's end)")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("fp8_attention: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
    if torch.compiler.is_compiling():
        return None  # the value checks read the tensors on the host: eager calls only, no graph break
    totals = (q.shape[2], k.shape[2])
    return _VARLEN_LENGTHS.get((cu_seqlens_q, cu_seqlens_k), totals,
                               lambda: _read_cu_seqlens(cu_seqlens_q, cu_seqlens_k, totals))


_VARLEN_LENGTHS = IdentityCache(maxsize=8)


def _read_cu_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor, totals: tuple[int, int]) -> tuple[int, int]:
    """Check both offset tensors and return their longest sequences, reading the device once."""
    stats = []
    for cu in (cu_q, cu_k):
        lens = cu[1:].long() - cu[:-1].long()
        stats += [cu[0].long(), (lens < 0).any().long(), cu[-1].long(), lens.max()]
    first_q, dec_q, last_q, max_q, first_k, dec_k, last_k, max_k = torch.stack(stats).tolist()
    for name, cu, first, dec, last, total in (("cu_seqlens_q", cu_q, first_q, dec_q, last_q, totals[0]),
                                              ("cu_seqlens_k", cu_k, first_k, dec_k, last_k, totals[1])):
        if first != 0 or dec or last > total:
            raise ValueError(
                f"fp8_attention: {name} must start at 0, be non-decreasing and end at most at the token count {total}, "
                f"got {cu.tolist()}"
            )
    return int(max_q), int(max_k)


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    config: FP8AttentionConfig | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-scaled FP8 attention with a delta-matched (or stale) FP8 backward.

    Args:
        q: ``(B, Hq, Sq, D)`` bf16/fp16/fp32, any strides.
        k, v: ``(B, Hkv, Sk, D)``, same dtype and device; ``Hq`` a multiple of ``Hkv`` (GQA/MQA,
            never repeated in memory).
        causal: mask keys after each query; with ``Sq < Sk`` the diagonal is aligned to the end
            (the queries are the last ``Sq`` tokens, as in KV-cache decoding).
        scale: softmax scale τ, default ``D ** -0.5``.
        window: sliding window: a query at position i sees keys j with ``i - j < window`` (and
            ``j - i < window`` when not causal).
        config: the recipe (:class:`FP8AttentionConfig`); default ``FP8AttentionConfig()``.
        cu_seqlens_q, cu_seqlens_k: packed variable-length batch: ``B == 1`` and these int tensors
            ``(n_seq + 1,)`` give each sequence's token range; sequences do not see each other.
        max_seqlen_q, max_seqlen_k: the longest query / key sequence of a packed batch, when the
            caller knows it on the host. Eager calls read (and check) the lengths themselves; under
            torch.compile, without these the kernels read them from ``cu_seqlens`` (a device sync).
        softcap: logit soft-capping (Gemma 2): each logit s becomes ``softcap * tanh(s / softcap)``
            before the softmax; a positive finite number.
        sinks: attention sinks (GPT-OSS's ``s_aux``): ``(Hq,)`` floating-point, on q's device, one
            learned logit per query head that joins each row's softmax normaliser but has no value
            (not capped); differentiable. A row that sees no key then outputs 0.
    Returns:
        ``(B, Hq, Sq, D)`` in the input dtype (under ``torch.autocast``: the autocast dtype, to
        which q, k, v are cast first, as SDPA does). In eager mode, where q is token-major (a
        ``(B, Sq, Hq, D)`` tensor transposed, as attention layers hand it) and the kernel writes any
        layout, the output is laid out so too, as SDPA's is: transposed back it is contiguous.
    """
    q, k, v = _autocast(q, k, v)
    _check_tensors(q, k, v)
    softcap = _check_softcap(softcap)
    sinks = _check_sinks(sinks, q)
    max_lengths = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q, k)
    config = FP8AttentionConfig() if config is None else config
    if not isinstance(config, FP8AttentionConfig):
        raise TypeError(f"fp8_attention: config must be an FP8AttentionConfig, got {type(config).__name__}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"fp8_attention: scale must be a positive finite number, got {scale!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"fp8_attention: window must be a positive int or None, got {window!r}")
    if causal and cu_seqlens_q is None and q.shape[2] > k.shape[2]:
        raise ValueError(
            f"fp8_attention: causal attention needs q_len <= kv_len (diagonal aligned to the end), "
            f"got q_len={q.shape[2]}, kv_len={k.shape[2]}"
        )
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"fp8_attention: {name} must be a non-negative int or None, got {n!r}")
    if max_lengths is not None:
        max_q, max_k = max_lengths
    elif cu_seqlens_q is not None:  # under torch.compile: the caller's values, if any
        max_q, max_k = max_seqlen_q, max_seqlen_k
    else:
        max_q = max_k = None
    if cu_seqlens_q is not None:  # the canonical mask: int32, contiguous, on the inputs' device (cast once)
        cu_seqlens_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
        cu_seqlens_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    mask = MaskSpec(causal=bool(causal), window=window, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=max_q, max_seqlen_k=max_k)
    return FP8AttentionFunction.apply(q, k, v, float(scale), mask, config, softcap, sinks)
