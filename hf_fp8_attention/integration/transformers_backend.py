"""The Transformers attention backends ``"fp8_delta"`` and ``"fp8_stale"``.

Each name is registered twice, as Transformers requires for a backend that honours padding:

- in ``AttentionMaskInterface`` a mask function returning ``None`` or the 2D padding mask
  ``(B, kv_len)`` bool (Transformers' own ``flash_attention_mask``). A name with no mask function
  would receive ``attention_mask=None`` always, silently losing padding. A dense 4D mask is no input
  for a tiled kernel: causal, sliding window, padding and packing are all handled by the kernel
  through its mask spec (dense causal/window, or varlen ``cu_seqlens``).
- in ``AttentionInterface`` the attention function below: it turns padding (2D mask) and packing
  (``cu_seq_lens_q/k`` kwargs, or ``position_ids`` restarting) into a varlen batch, runs
  :func:`hf_fp8_attention.fp8_attention` (Triton kernels where available, else the PyTorch
  emulation: see :func:`hf_fp8_attention.ops.select_backend`) and re-pads the output.

Decode (``q_len < kv_len`` with a KV cache) runs the same FP8 forward with the causal diagonal
aligned to the end of the keys; with padding (left-padded ``generate``) it goes through varlen.

Packing is read from ``cu_seq_lens_q/k`` kwargs (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``)
or from ``position_ids`` restarting among a row's valid tokens (in any forward whose queries are
all its keys, i.e. also a prefill that fills a KV cache), with or without padding: packed
sequences never see each other (sdpa lets them leak when ``use_cache=True`` or when a padding mask
is also given). A static cache longer than the mask
is cut to the mask's length (as Transformers' flash path does). Planning the varlen batch (and
checking for packing) reads a few values on the host, i.e. device syncs; it is done once per
model forward, since every layer gets the same mask and position tensors (:mod:`..identity_cache`).

Under ``torch.compile`` no tensor value is read on the host (each read would be a graph break), so
a plain batch and a padded one compile with ``fullgraph=True``:

- plain batch: the dense path, as in eager mode;
- padded batch (2D mask): every row becomes three packed sequences, ``[left padding | tokens |
  right padding]``, over the whole flattened batch (static shapes, see
  :func:`.varlen.plan_contiguous_padding`); padded queries' outputs are zeroed. Padding is assumed
  contiguous per row (what tokenizers produce); holes inside a row are not detected there;
- packed batch with ``cu_seq_lens_q/k`` kwargs (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``,
  Transformers' flash-attention kwargs): passed straight to the kernels, no host read;
- packed batch described by ``position_ids`` alone: detecting the restarts needs the host, so it is
  not done under compile: each row is one sequence, and one warning says so (at trace time).
  Pass the ``cu_seq_lens_q/k`` (and ``max_length_q/k``) kwargs to compile packed training.

Meta tensors (shape inference, ``torch.device("meta")`` initialisation) take the dense path and
return a meta output of the right shape and dtype.

The recipe is bound per registered name: ``"fp8_delta"`` / ``"fp8_stale"`` use
``RECIPES[name]``; :func:`register_fp8_attention` adds a name with any :class:`FP8AttentionConfig`.
Transformers does not save the attention implementation with a checkpoint: pass
``attn_implementation=...`` again to ``from_pretrained`` (after ``import hf_fp8_attention``).

Logit soft-capping (Gemma 2's ``softcap`` kwarg) and attention sinks (GPT-OSS's ``s_aux``, one
learned logit per query head) are passed to :func:`hf_fp8_attention.fp8_attention`, which runs
them on either backend.

Anything the FP8 recipe cannot honour raises a clear error rather than being dropped: dropout,
4D or custom mask functions, chunked attention and unsupported head dims. ``output_attentions=True`` gets one warning and ``None`` weights (as sdpa).
"""
from __future__ import annotations

from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.utils import logging

from ..config import RECIPES, FP8AttentionConfig
from ..functional import fp8_attention
from ..identity_cache import IdentityCache
from .varlen import (
    VarlenPlan,
    flatten_batch,
    pack,
    plan_contiguous_padding,
    plan_varlen,
    segments_from_positions,
    unflatten_batch,
    unpack,
)

logger = logging.get_logger(__name__)

DEFAULT_BACKENDS = ("fp8_delta", "fp8_stale")
_BUILTIN_NAMES = ("eager", "sdpa", "flex_attention", "paged|eager")
_CONFIGS: dict[str, FP8AttentionConfig] = {}
_WARNED: set[str] = set()


def _no_host_reads(t: torch.Tensor | None) -> bool:
    """True where tensor values cannot be read on the host: under torch.compile, or meta tensors."""
    return torch.compiler.is_compiling() or (t is not None and t.device.type == "meta")


def _warn_compiled_position_ids(_ctx=None) -> None:
    """Once: under torch.compile, position_ids are not checked for packed sequences.

    Called through ``comptime`` while the graph is traced (torch.compile cannot trace a logging
    call: a graph break), so it runs once per compilation and never inside the compiled graph.
    """
    if "compile_position_ids" not in _WARNED:
        _WARNED.add("compile_position_ids")
        logger.warning(
            "FP8 attention under torch.compile does not check position_ids for packed sequences (that reads them "
            "on the host, a graph break): each row is treated as one sequence. For packed batches pass "
            "cu_seq_lens_q/k and max_length_q/k (DataCollatorWithFlattening(return_flash_attn_kwargs=True))."
        )


def fp8_padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function for ``AttentionMaskInterface``: ``None`` or the 2D padding mask ``(B, kv_len)`` bool.

    Causal structure and sliding windows are not encoded here; the attention function applies them
    (from ``module.is_causal`` and the ``sliding_window`` kwarg). Transformers signals a custom mask
    function (``or_mask_function`` / ``and_mask_function``, e.g. bidirectional image tokens) with
    ``use_vmap=True``, and block-wise bidirectional overlays (``block_sequence_ids``) by wrapping the
    mask function in ``or_masks`` (whose inner function is named ``or_mask`` in 5.17 and 5.24); such
    patterns cannot be expressed as causal/window/padding/packing, so they raise.
    """
    if kwargs.get("use_vmap", False) or getattr(mask_function, "__name__", "") == "or_mask":
        raise NotImplementedError(
            "FP8 attention cannot apply this model's custom attention mask pattern (an or/and mask function, "
            "e.g. bidirectional attention over image tokens); its kernels support causal, sliding-window, "
            "padding and packed-sequence masks only. Use attn_implementation='sdpa' for this model."
        )
    kwargs.pop("use_vmap", None)
    if _no_host_reads(attention_mask):
        # flash_attention_mask drops an all-ones mask by reading it (``mask.all()``): a graph break
        # under torch.compile, an error on meta tensors. Keep the mask; the attention copes with it.
        return None if attention_mask is None else attention_mask[:, -kv_length:].bool()
    return flash_attention_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs
    )


def _reject_unsupported(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """Raise for requests the FP8 recipe cannot honour; warn once for output_attentions."""
    if dropout:
        raise NotImplementedError(
            f"FP8 attention does not implement attention dropout (got dropout={dropout}); set the model's "
            "attention_dropout to 0.0 (e.g. config.attention_dropout = 0.0) or use attn_implementation='sdpa'"
        )
    if getattr(getattr(module, "config", None), "attention_chunk_size", None):
        raise NotImplementedError("FP8 attention does not support chunked attention (config.attention_chunk_size)")
    if kwargs.get("output_attentions", False):
        logger.warning_once(
            "FP8 attention does not compute attention weights: output_attentions=True returns None for them. "
            "Use attn_implementation='eager' to inspect attention weights."
        )


def _padding_mask(attention_mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """The 2D mask as ``(B, len)`` bool (``len <= kv_len``), or None when every token is valid."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"FP8 attention received a {attention_mask.dim()}-D attention mask of shape {tuple(attention_mask.shape)}; "
            "it accepts only a 2D padding mask (batch, kv_len) and applies causal/window/packing itself. "
            "Arbitrary custom 4D masks are not supported: use attn_implementation='sdpa' for them."
        )
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(
            f"FP8 attention expects a bool/integer 2D padding mask (1 = token, 0 = padding), got dtype {attention_mask.dtype}"
        )
    if attention_mask.shape[1] > kv_len:
        raise ValueError(
            f"FP8 attention: the 2D attention mask covers {attention_mask.shape[1]} positions but there are only {kv_len} keys"
        )
    valid = attention_mask.bool()
    if _no_host_reads(valid):
        return valid  # no host read: an all-ones mask stays (compiled forwards take the padded path)
    return None if valid.shape[1] == kv_len and bool(valid.all()) else valid


def _packed_segments(position_ids, valid, batch, q_len, kv_len, device) -> torch.Tensor | None:
    """``(B, kv_len)`` packed-sequence ids when ``position_ids`` restart among a row's valid tokens, else None.

    Packing is read only when the queries are all the keys (``q_len == kv_len``: training, or a
    prefill): when decoding against a longer cache the positions cover the new queries alone, and
    restarting positions there are an error rather than a guess.
    """
    if position_ids is None:
        return None
    if position_ids.dim() != 2 or position_ids.shape[-1] != q_len or position_ids.shape[0] not in (1, batch):
        logger.warning_once(
            f"FP8 attention: position_ids of shape {tuple(position_ids.shape)} are not (batch, {q_len}); they are "
            "not used to detect packed sequences (pass cu_seq_lens_q/k for packed batches)"
        )
        return None
    if valid is None:  # every token valid: no mask to read on the host
        segments = segments_from_positions(position_ids.to(device), None, batch=batch)
    else:
        segments = segments_from_positions(position_ids, valid.to(device)[:, kv_len - q_len :])
    if segments is not None and q_len != kv_len:
        raise ValueError(
            f"FP8 attention: position_ids restart inside a row (packed sequences) while q_len={q_len} differs from "
            f"kv_len={kv_len} (KV cache); packed sequences are supported without a cache only"
        )
    return segments


def _explicit_cu_seqlens(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None:
        raise ValueError("FP8 attention: pass both cu_seq_lens_q and cu_seq_lens_k, or neither")
    return cu_q.to(torch.int32), cu_k.to(torch.int32)


# Every layer of a forward gets the same attention_mask and position_ids objects: the plan below
# reads them on the host (device syncs), so it is made once per forward, not once per layer.
_MASK_PLANS = IdentityCache(maxsize=4)


def _mask_plan(attention_mask, position_ids, batch, q_len, kv_len, device) -> tuple[int, VarlenPlan | None]:
    """``(keys to keep, varlen plan)`` of one forward's padding and packing; plan None: dense path.

    Keys beyond the 2D mask's length (a static cache longer than the tokens seen so far) are cut.
    """
    valid = _padding_mask(attention_mask, kv_len)
    if valid is not None:
        kv_len = valid.shape[1]
    segments = _packed_segments(position_ids, valid, batch, q_len, kv_len, device)
    if valid is None and segments is None:
        return kv_len, None
    if valid is None:
        valid = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    return kv_len, plan_varlen(valid.to(device), q_len, segments)


def fp8_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    fp8_config: FP8AttentionConfig,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """FP8 attention with Transformers' attention-function signature.

    Args:
        module: the attention module (read: ``is_causal``).
        query: ``(B, Hq, Sq, D)``, any strides; key, value: ``(B, Hkv, Sk, D)`` (GQA not repeated).
        attention_mask: None or the 2D padding mask ``(B, Sk)`` from :func:`fp8_padding_mask`.
        dropout, scaling, is_causal: as for sdpa (dropout must be 0).
        fp8_config: the recipe, bound at registration.
        kwargs: ``sliding_window``, ``position_ids (B, Sq)``, ``cu_seq_lens_q/k`` (packed batches),
            ``softcap`` (float), ``s_aux`` (the sinks, ``(Hq,)``), ...
    Returns:
        ``(B, Sq, Hq, D)`` contiguous in the query dtype, and ``None`` (no attention weights).
    """
    batch, _, q_len, _ = query.shape
    _reject_unsupported(module, dropout, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = kwargs.get("sliding_window")
    window = int(window) if window is not None else None
    call = dict(causal=causal, scale=scaling, window=window, config=fp8_config, softcap=kwargs.get("softcap"),
                sinks=kwargs.get("s_aux"))

    if query.device.type == "meta":
        # Shape inference / meta-device init: no values to read; the output shape does not depend
        # on padding or packing.
        valid = _padding_mask(attention_mask, key.shape[2])
        if valid is not None and valid.shape[1] < key.shape[2]:
            key, value = key[:, :, : valid.shape[1]], value[:, :, : valid.shape[1]]
        return fp8_attention(query, key, value, **call).transpose(1, 2).contiguous(), None

    explicit = _explicit_cu_seqlens(kwargs)
    if explicit is not None:
        if attention_mask is not None:
            raise ValueError("FP8 attention got both cu_seq_lens_q/k and a padding mask; pass one of them")
        # The collator's max_length_q/k kwargs are the longest sequences; fp8_attention derives them
        # from cu_seqlens itself (a host read in eager mode, none under compile).
        out = fp8_attention(query, key, value, cu_seqlens_q=explicit[0], cu_seqlens_k=explicit[1], **call)
        return out.transpose(1, 2).contiguous(), None

    position_ids = kwargs.get("position_ids")
    if torch.compiler.is_compiling():
        return _compiled_forward(query, key, value, attention_mask, position_ids, call), None
    kv_len, plan = _MASK_PLANS.get(
        (attention_mask, position_ids), (batch, q_len, key.shape[2], query.device),
        lambda: _mask_plan(attention_mask, position_ids, batch, q_len, key.shape[2], query.device),
    )
    if kv_len < key.shape[2]:
        # A static cache is longer than the tokens seen so far: its tail holds no keys yet.
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    if plan is None:
        out = fp8_attention(query, key, value, **call)  # dense path: plain causal (+ window)
        return out.transpose(1, 2).contiguous(), None
    if plan.has_holes and window is not None:
        raise NotImplementedError(
            "FP8 attention: the padding mask has holes inside a sequence and this layer uses a sliding window; "
            "the window would count the removed positions differently from Transformers' mask. Use contiguous "
            "(left or right) padding, or attn_implementation='sdpa'"
        )
    if plan.idx_q.numel() == 0:
        # Every query is padding: attention contributes nothing (zeros, as for any padded query).
        return query.new_zeros(batch, q_len, query.shape[1], value.shape[-1]), None
    out = fp8_attention(
        pack(query, plan.idx_q),
        pack(key, plan.idx_k),
        pack(value, plan.idx_k),
        cu_seqlens_q=plan.cu_seqlens_q,
        cu_seqlens_k=plan.cu_seqlens_k,
        **call,
    )
    return unpack(out, plan.idx_q, batch, q_len), None


def _compiled_forward(query, key, value, attention_mask, position_ids, call) -> torch.Tensor:
    """The attention under torch.compile: no tensor value is read on the host (no graph break).

    A padding mask becomes the static varlen layout of :func:`plan_contiguous_padding` (left or
    right padding; holes inside a row are not detected). Packing is taken from ``cu_seq_lens_q/k``
    kwargs only (handled by the caller): detecting it from ``position_ids`` restarting needs a host
    read, so it is not done here, and one warning says so.
    """
    batch, _, q_len, _ = query.shape
    if position_ids is not None:
        from torch._dynamo.comptime import comptime

        comptime(_warn_compiled_position_ids)
    valid = _padding_mask(attention_mask, key.shape[2])
    if valid is None:
        return fp8_attention(query, key, value, **call).transpose(1, 2).contiguous()
    valid = valid.to(query.device)
    kv_len = valid.shape[1]
    if kv_len < key.shape[2]:
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]
    cu_q, cu_k, query_valid = plan_contiguous_padding(valid, q_len)
    out = fp8_attention(flatten_batch(query), flatten_batch(key), flatten_batch(value),
                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **call)
    return unflatten_batch(out, batch, query_valid)


def _bind(name: str, config: FP8AttentionConfig) -> Callable:
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        return fp8_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, fp8_config=config, **kwargs
        )

    attention.__name__ = attention.__qualname__ = f"fp8_attention_forward[{name}]"
    attention.__doc__ = f"FP8 attention with the recipe registered as {name!r}: {config}"
    return attention


def register_fp8_attention(name: str, config: FP8AttentionConfig | str) -> str:
    """Register an FP8 attention backend under ``name`` with Transformers; returns ``name``.

    ``config`` is an :class:`FP8AttentionConfig` or the name of a recipe in :data:`RECIPES`.
    Afterwards ``from_pretrained(..., attn_implementation=name)``, ``from_config(...)`` and
    ``model.set_attn_implementation(name)`` use it. Re-registering a name replaces its recipe.
    Example::

        register_fp8_attention("fp8_delta_pow2", FP8AttentionConfig(pow2_scales=True))
    """
    if not isinstance(name, str) or not name or name.strip() != name:
        raise ValueError(f"register_fp8_attention: name must be a non-empty string without surrounding spaces, got {name!r}")
    if "flash" in name or "/" in name or ":" in name or name in _BUILTIN_NAMES:
        raise ValueError(
            f"register_fp8_attention: {name!r} is reserved by Transformers (names containing 'flash', '/' or ':' "
            f"and the built-ins {_BUILTIN_NAMES} are treated specially); choose another name"
        )
    if isinstance(config, str):
        config = FP8AttentionConfig.from_recipe(config)
    if not isinstance(config, FP8AttentionConfig):
        raise TypeError(f"register_fp8_attention: config must be an FP8AttentionConfig or recipe name, got {type(config).__name__}")
    _CONFIGS[name] = config
    AttentionMaskInterface.register(name, fp8_padding_mask)
    AttentionInterface.register(name, _bind(name, config))
    return name


def registered_fp8_config(name: str) -> FP8AttentionConfig:
    """The recipe registered under ``name`` (KeyError naming the known names otherwise)."""
    try:
        return _CONFIGS[name]
    except KeyError:
        raise KeyError(f"no FP8 attention backend named {name!r}; registered: {sorted(_CONFIGS)}") from None


def register_default_backends() -> None:
    """Register ``"fp8_delta"`` (the product) and ``"fp8_stale"`` (the ablation baseline)."""
    for name in DEFAULT_BACKENDS:
        register_fp8_attention(name, RECIPES[name])
