"""PyTorch emulation of the block-scaled FP8 attention recipe, forward and backward (docs/design.md §2).

This is the ground truth the Triton kernels are tested against and the path CPU users get. Every
FP8 matmul is emulated as an fp32 matmul of fake-quantized operands (``dequantize(quantize(x))``):
FP8 products are exact in fp32, so this equals a scaled FP8 MMA with fp32 accumulation up to the
order of the fp32 additions. Scales are shared over the same tiles the kernels use
(``config.block_q`` queries, ``config.block_k`` keys), tiles starting at each sequence's start.

Shapes: q ``(B, Hq, Sq, D)``; k, v ``(B, Hkv, Sk, D)`` with ``Hq = G * Hkv`` (GQA: the G query heads
of a kv head are folded into the query axis, so k and v are never repeated in memory); output
``(B, Hq, Sq, D)`` in the input dtype, LSE ``(B, Hq, Sq)`` fp32 (``-inf`` for rows with no key).

Logit modifiers (docs/design.md, "Soft-capping and attention sinks"): ``softcap`` c replaces every
logit s by c·tanh(s / c) before the softmax (masked keys stay masked); ``sinks`` ``(Hq,)`` fp32 adds
one logit σ_h per query head to each row's normaliser only (no value; it is not capped). A row with
no visible key then puts all its mass on the sink: output 0, LSE σ_h, finite gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .config import BackwardPrecision, DeltaMode, FP8AttentionConfig, Granularity, PScaling
from .masking import MaskSpec, dense_mask
from .quant import compute_scales, fake_quantize
from .transforms import hadamard_block, key_mean, query_key_means, rotate


@dataclass
class BackwardInternals:
    """What the backward formed, for diagnostics. Shapes ``(B, Hkv, G, Sq, Sk)`` / ``(B, Hkv, G, Sq)``.

    ``ds`` is the fp32 gradient of the softmax's input, P ∘ (dP − D): the dS quantized for the
    dQ/dK matmuls, or with a soft-cap c the dS̃ that is multiplied by 1 − (s̃/c)² first (the zero
    row sum is dS̃'s). With sinks, ``p_sink`` ``(B, Hkv, G, Sq)`` is each row's sink probability
    and ``ds_sink`` = −P_sink ∘ D its sink entry (the extended row sum Σ_j ds_ij + ds_sink is zero);
    both None without sinks.
    """

    p: torch.Tensor
    dp: torch.Tensor
    delta: torch.Tensor
    ds: torch.Tensor
    p_sink: torch.Tensor | None = None
    ds_sink: torch.Tensor | None = None


def _grouped(x: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """``(B, Hq, S, D)`` -> ``(B, Hkv, G, S, D)`` view (G query heads per kv head)."""
    b, hq, s, d = x.shape
    return x.reshape(b, n_kv_heads, hq // n_kv_heads, s, d)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every matmul of the emulation goes through here (``a (.., M, K) @ b (.., K, N)``): the one
    place a model of the hardware's accumulation can replace (tests/hopper_accumulator.py)."""
    return a @ b


def _scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (B, Hkv, G, Sq, D) @ b (B, Hkv, Sk, D)ᵀ -> (B, Hkv, G, Sq, Sk)`` without repeating b."""
    bsz, hkv, g, sq, d = a.shape
    return _matmul(a.reshape(bsz, hkv, g * sq, d), b.transpose(-1, -2)).reshape(bsz, hkv, g, sq, b.shape[-2])


def _rows_times(m: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``m (B, Hkv, G, Sq, Sk) @ b (B, Hkv, Sk, D) -> (B, Hkv, G, Sq, D)``."""
    bsz, hkv, g, sq, sk = m.shape
    return _matmul(m.reshape(bsz, hkv, g * sq, sk), b).reshape(bsz, hkv, g, sq, b.shape[-1])


def _cols_times(m: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``m (B, Hkv, G, Sq, Sk)ᵀ @ a (B, Hkv, G, Sq, D) -> (B, Hkv, Sk, D)``, summed over the G heads."""
    bsz, hkv, g, sq, sk = m.shape
    return _matmul(m.reshape(bsz, hkv, g * sq, sk).transpose(-1, -2), a.reshape(bsz, hkv, g * sq, a.shape[-1]))


def _masked_logits(qs, ks, scale, causal, window, *, shift=None, softcap=None) -> torch.Tensor:
    """fp32 logits ``τ Q Kᵀ`` ``(B, Hkv, G, Sq, Sk)`` with invisible keys set to -inf.

    ``shift (B, Hkv, G, Sq)``: added to each row before the cap (K-smoothing's τ q_i·μ, see
    :func:`smoothing_shift`); ``softcap`` c: each logit becomes c·tanh(s / c). The mask is applied
    last, so a masked key stays -inf (tanh would bound it at -c).
    """
    logits = _scores(qs, ks) * scale
    if shift is not None:
        logits = logits + shift[..., None]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    mask = dense_mask(qs.shape[-2], ks.shape[-2], causal=causal, window=window, device=qs.device)
    return logits if mask is None else logits.masked_fill(~mask, float("-inf"))


def smoothing_shift(q: torch.Tensor, k: torch.Tensor, scale: float, mask: MaskSpec, config: FP8AttentionConfig,
                    softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor | None:
    """τ q_i·μ ``(B, Hq, Sq)`` fp32: what K-smoothing took off row i of S, when it must be put back.

    Softmax does not see a row constant, so plain smoothed logits are used as they are. With a cap
    c·tanh((s − τ q·μ) / c) is not the capped logit minus a constant, and with a sink the constant
    would move every logit against σ_h, which it does not shift: with either, the constant is added
    back before the cap (from the unquantized q: the constant is exact; μ per sequence and kv head,
    :func:`..transforms.query_key_means`, which the kernels' launchers call too). The rotation
    changes no logit and needs nothing. None when nothing is to be added.
    """
    if not config.smooth_k or (softcap is None and sinks is None):
        return None
    return query_key_means(q, k, mask.cu_seqlens_q, mask.cu_seqlens_k) * scale


def stale_lse(lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scale: float, mask: MaskSpec,
              config: FP8AttentionConfig, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The forward's LSE ``(B, Hq, Sq)`` fp32 in the frame of the backward's logits, which the
    stale delta normalises them by (the matched delta forms its own normaliser and never reads it).

    With K-smoothing and neither a cap nor sinks the forward's logits lack the row constant
    τ q_i·μ (:func:`smoothing_shift`), and so does its LSE. The FP8 backward's logits lack it too;
    the hybrid backward's bf16 logits are not smoothed, so for it the constant is added back:
    without it its P rows would be off by a factor exp(τ q_i·μ) (on a pretrained model's keys,
    whose mean is large, gradients of 1e18). Rows with no key keep -inf.
    """
    unsmoothed_logits = config.backward is BackwardPrecision.BF16 and config.delta is DeltaMode.STALE
    if not unsmoothed_logits or not config.smooth_k or softcap is not None or sinks is not None:
        return lse
    return lse + query_key_means(q, k, mask.cu_seqlens_q, mask.cu_seqlens_k) * scale


def check_dq_in_stats(config: FP8AttentionConfig, softcap: float | None, sinks: torch.Tensor | None) -> None:
    """A ValueError for ``dq_in_stats`` with a soft-cap or sinks (its one sweep has neither the cap's
    slope nor the sink's normaliser)."""
    if config.dq_in_stats and config.backward is BackwardPrecision.FP8 and (softcap is not None or sinks is not None):
        raise ValueError("FP8AttentionConfig.dq_in_stats: calls with a soft-cap or sinks are not supported")


def _rows_of(x: torch.Tensor | None, hkv: int) -> torch.Tensor | None:
    """A per-row value ``(B, Hq, S)`` viewed ``(B, Hkv, G, S)``."""
    return None if x is None else _grouped(x[..., None], hkv)[..., 0]


def _sink_logits(sinks: torch.Tensor | None, b: int, hkv: int, sq: int) -> torch.Tensor | None:
    """The sinks ``(Hq,)`` as one logit per query row, ``(B, Hkv, G, Sq)`` fp32 (a broadcast view)."""
    if sinks is None:
        return None
    return sinks.float().reshape(1, hkv, -1, 1).expand(b, hkv, sinks.shape[0] // hkv, sq)


def _sink_grad(ds_sink: torch.Tensor) -> torch.Tensor:
    """dσ_h = Σ over the batch and rows of one query head of ``ds_sink (B, Hkv, G, Sq)``: ``(Hq,)``
    fp32 (a fixed-order reduction: deterministic)."""
    return ds_sink.sum(dim=(0, 3)).reshape(-1)


def _probabilities(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(logits - lse)``, exactly 0 where a key is masked (also on rows with no key)."""
    return torch.where(logits == float("-inf"), 0.0, torch.exp(logits - lse[..., None]))


class RowNormaliser(NamedTuple):
    """Per query row of fp32 logits ``(..., Sk)``: ``m`` the max (0 on rows with no key), ``l`` =
    Σ_j exp(s_j − m) (0 on rows with no key) and ``lse`` = m + log l (-inf there).

    The forward normalises its rows by l, as the kernel's O = acc / l does, rather than through
    exp(m_tile − lse): at logits beyond ~1e7 fp32 cannot hold lse = m + log l apart from m, and rows
    normalised through it summed to up to their number of keys (fp16 inputs of 6e4 gave inf
    outputs)."""

    m: torch.Tensor
    l: torch.Tensor
    lse: torch.Tensor


def row_normaliser(logits: torch.Tensor, sink: torch.Tensor | None = None) -> RowNormaliser:
    """:class:`RowNormaliser` of fp32 ``logits (..., Sk)`` (-inf where a key is masked).

    ``sink (...)``: one more logit per row in the normaliser only: m = max(max_j s_j, σ),
    l = Σ_j exp(s_j − m) + exp(σ − m). A NaN sink makes its rows NaN.
    """
    if logits.shape[-1] == 0:  # no keys at all (an empty packed sequence)
        m = logits.new_full(logits.shape[:-1], float("-inf"))
    else:
        m = logits.amax(dim=-1)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(m == float("-inf"), 0.0, m)
    l = torch.exp(logits - m[..., None]).sum(dim=-1)  # masked keys: exp(-inf) = 0
    if sink is not None:
        l = l + torch.exp(sink - m)
    lse = torch.where(l == 0, float("-inf"), m + torch.log(l))
    return RowNormaliser(m, l, lse)


def _forward_p(logits: torch.Tensor, norm: RowNormaliser, config: FP8AttentionConfig) -> torch.Tensor:
    """The forward's P as the PV matmul sees it: quantized per row within each key tile.

    Within a key tile the codes are ``fp8(FMAX · exp(s − m_tile))`` with ``m_tile`` the row's maximum
    logit in that tile, and the tile's row scale is ``exp(m_tile − m) / (l · FMAX)`` (= exp(m_tile −
    LSE) / FMAX, see :class:`RowNormaliser`). The codes do not depend on the kernel's running
    maximum, so the kernel's online softmax reproduces them exactly.
    """
    fmt = config.p_format
    bc = config.block_k
    sk = logits.shape[-1]
    n_tiles = -(-sk // bc)
    padded = torch.nn.functional.pad(logits, (0, n_tiles * bc - sk), value=float("-inf"))
    tiles = padded.reshape(*logits.shape[:-1], n_tiles, bc)
    m_tile = tiles.amax(dim=-1, keepdim=True)
    empty = m_tile == float("-inf")
    codes = fp8_round(fmt.max * torch.exp(tiles - torch.where(empty, 0.0, m_tile)), fmt)
    l = torch.where(norm.l == 0, 1.0, norm.l)[..., None, None]
    tile_scale = torch.where(empty, 0.0, torch.exp(m_tile - norm.m[..., None, None]) / (l * fmt.max))
    return (codes * tile_scale).reshape(padded.shape)[..., :sk]


def fp8_round(x: torch.Tensor, fmt) -> torch.Tensor:
    """fp32 ``x`` (within ±FMAX) rounded onto ``fmt``'s grid: the cast of P's codes."""
    return x.to(fmt.dtype).float()


def _fq_head(x, fmt, config):
    """One scale per (sequence, head): amax over the tokens and channels of ``x (..., S, D)``."""
    flat = x.reshape(*x.shape[:-2], -1)
    return fake_quantize(flat, dim=-1, block=None, fmt=fmt, pow2=config.pow2_scales).reshape(x.shape)


def _fq_row(x, fmt, granularity, config):
    """The operand of a head-dim contraction: one scale per token (TOKEN) or per (sequence, head)
    (HEAD: amax over the sequence's tokens and channels). ``x (..., S, D)``."""
    if granularity is Granularity.HEAD:
        return _fq_head(x, fmt, config)
    return fake_quantize(x, dim=-1, block=None, fmt=fmt, pow2=config.pow2_scales)


def _fq_col(x, fmt, block, config):
    """The operand of a token contraction ``x (..., S, D)``: per channel within each ``block``
    tokens (TILE), per channel over the sequence (CHANNEL), or one scale per (sequence, head)."""
    granularity = config.channel_scales
    if granularity is Granularity.HEAD:
        return _fq_head(x, fmt, config)
    block = block if granularity is Granularity.TILE else None
    return fake_quantize(x, dim=-2, block=block, fmt=fmt, pow2=config.pow2_scales)


def qk_transformed(qg: torch.Tensor, k: torch.Tensor,
                   config: FP8AttentionConfig) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The operands of S = QKᵀ (F1 and B1) before they are quantized, and the factor the logits take.

    ``qg (B, Hkv, G, Sq, D)``, ``k (B, Hkv, Sk, D)`` of one sequence. K-smoothing subtracts the keys'
    channel mean, the rotation multiplies both by the ±1 Hadamard matrix (module
    :mod:`..transforms`); returns fp32 ``(q_t, k_t, factor)`` with QKᵀ = factor · q_t k_tᵀ (factor
    1/block with the rotation, else 1).
    """
    q_t, k_t, factor = qg.float(), k.float(), 1.0
    if config.hadamard:
        # K rotated first, then the rotated mean subtracted: the kernels' order (kernels/sequence_stats.py).
        q_t, k_t = rotate(q_t), rotate(k_t)
        factor = 1.0 / hadamard_block(qg.shape[-1])
    if config.smooth_k:
        k_t = k_t - (rotate(key_mean(k)) if config.hadamard else key_mean(k))
    return q_t, k_t, factor


def qk_operands(qg: torch.Tensor, k: torch.Tensor, config: FP8AttentionConfig) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The fake-quantized operands of S = QKᵀ (F1 and B1) and the factor the logits take: those of
    :func:`qk_transformed`, quantized as ``config`` says; fp32 ``(q_op, k_op, factor)`` with QKᵀ =
    factor · q_op k_opᵀ up to the quantization error.
    """
    q_t, k_t, factor = qk_transformed(qg, k, config)
    q_op = _fq_row(q_t, config.q_format, config.qdo_scales, config)
    k_op = _fq_row(k_t, config.k_format, config.kv_scales, config)
    return q_op, k_op, factor


def _dense_forward(q, k, v, scale, causal, window, config, softcap, sinks, shift):
    """One sequence; ``shift (B, Hq, Sq)`` or None: :func:`smoothing_shift`'s rows of it."""
    hkv = k.shape[1]
    qs, ks, factor = qk_operands(_grouped(q, hkv), k, config)
    vs = _fq_col(v, config.v_format, config.block_k, config)
    logits = _masked_logits(qs, ks, scale * factor, causal, window, shift=_rows_of(shift, hkv), softcap=softcap)
    norm = row_normaliser(logits, _sink_logits(sinks, q.shape[0], hkv, q.shape[2]))
    out = _rows_times(_forward_p(logits, norm, config), vs)
    return out.reshape(q.shape).to(q.dtype), norm.lse.reshape(q.shape[:-1])


def _backward_p(p: torch.Tensor, config: FP8AttentionConfig) -> torch.Tensor:
    """The backward's P as B3 (dV = Pᵀ dO) sees it: per column within each query tile (TILE), or
    on the fixed grid fp8(FMAX · P) / FMAX (FIXED; P <= 1, so no code saturates)."""
    fmt = config.p_format
    if config.p_scales is PScaling.FIXED:
        return fp8_round(p * fmt.max, fmt) / fmt.max
    return fake_quantize(p, dim=-2, block=config.block_q, fmt=fmt, pow2=config.pow2_scales)


def ds_head_bound(p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Per query row, a bound on |dS_ij| = P_ij |dP_ij − D_i| formed from the statistics alone:
    max_j P_ij |dP_ij| + |D_i| · max_j P_ij, ``(..., Sq)`` of ``p``, ``dp`` ``(..., Sq, Sk)`` and
    ``delta`` ``(..., Sq)`` (0 on rows with no key; NaN kept). With a soft-cap it bounds dS too: the
    cap's slope 1 − (s̃/c)² lies in [0, 1]."""
    if p.shape[-1] == 0:
        return p.new_zeros(p.shape[:-1])
    return (p * dp.abs()).amax(dim=-1) + delta.abs() * p.amax(dim=-1)


def _fq_ds_head(ds: torch.Tensor, p: torch.Tensor, dp: torch.Tensor, delta: torch.Tensor,
                config: FP8AttentionConfig) -> torch.Tensor:
    """dS ``(B, Hkv, G, Sq, Sk)`` fake-quantized with one scale per (sequence, query head), the
    scale of the largest row bound (:func:`ds_head_bound`) over the sequence's rows."""
    if ds.numel() == 0:
        return ds
    amax = ds_head_bound(p, dp, delta).amax(dim=-1, keepdim=True)[..., None]  # (B, Hkv, G, 1, 1)
    fmt = config.ds_format
    scale = compute_scales(amax, fmt, config.pow2_scales)
    # The bound is >= |dS|, so the clamp only guards fp32 rounding of a bound that is tight.
    return fp8_round((ds / scale).clamp(-fmt.max, fmt.max), fmt) * scale


def _dq_from_stats(p: torch.Tensor, dp: torch.Tensor, k_col: torch.Tensor, dog: torch.Tensor, v: torch.Tensor,
                   config: FP8AttentionConfig) -> torch.Tensor:
    """dQ / τ ``(B, Hkv, G, Sq, D)`` as ``dq_in_stats`` forms it in the statistics sweep (the config's
    docstring): A − D'·B from P, dP ``(B, Hkv, G, Sq, Sk)``, K's token-contraction operand ``k_col``
    ``(B, Hkv, Sk, D)`` and the dP operands' inputs ``dog (B, Hkv, G, Sq, D)``, ``v (B, Hkv, Sk, D)``."""
    if k_col.shape[-2] == 0:  # an empty packed sequence, or rows without keys: dQ is zero
        return dog.new_zeros(p.shape[:-1] + k_col.shape[-1:])
    do_op = _fq_row(dog, config.do_format, config.qdo_scales, config)
    v_op = _fq_row(v.float(), config.v_format, config.kv_scales, config)
    # |P_ij dP_ij| <= |dP_ij| <= ||dO_i|| ||V_j|| <= ||dO_i|| sqrt(d) amax(V) (P <= 1), known before
    # the sweep; rounded up to a power of two, the kernels' order of summation does not change it.
    v_amax = v_op.flatten(-2).abs().amax(-1)[..., None, None, None]
    bound = do_op.norm(dim=-1, keepdim=True) * (v_op.shape[-1] ** 0.5) * v_amax / config.ds_format.max
    row_scale = torch.where(bound > 0, torch.exp2(torch.ceil(torch.log2(torch.where(bound > 0, bound, 1.0)))), 1.0)
    fmt = config.ds_format
    a_op = fp8_round((p * dp / row_scale).clamp(-fmt.max, fmt.max), fmt) * row_scale
    p_hat = fp8_round(p * config.p_format.max, config.p_format) / config.p_format.max
    p_hat_sum = p_hat.sum(dim=-1, keepdim=True)
    # D' makes the row sums of the effective dS = fq(P dP) − D' P̂ vanish. A row whose P̂ codes all
    # round to 0 (uniform attention over ~2^17 keys or more) keeps A alone.
    d_prime = torch.where(p_hat_sum > 0, a_op.sum(dim=-1, keepdim=True) / torch.where(p_hat_sum > 0, p_hat_sum, 1.0), 0.0)
    return _rows_times(a_op, k_col) - d_prime * _rows_times(p_hat, k_col)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """The value a bf16 MMA operand holds, in fp32."""
    return x.to(torch.bfloat16).float()


def _backward_lse(logits: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """The matched backward's own LSE' ``(...)`` of ``logits (..., Sk)``, the sink (one logit per
    row) in the normaliser."""
    if sink is None:
        return torch.logsumexp(logits, dim=-1)
    return torch.logsumexp(torch.cat([logits, sink[..., None]], dim=-1), dim=-1)


def _cap_derivative(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """d s̃ / d s = 1 − (s̃ / c)² of the capped ``logits`` s̃ ``(..., Sk)``; 0 at masked keys (-inf),
    whose dS̃ is 0 (a product with -inf there would be NaN)."""
    return torch.where(logits == float("-inf"), 0.0, 1.0 - (logits / softcap) ** 2)


def _dense_backward(q, k, v, out, lse, dout, scale, causal, window, config, softcap, sinks, shift, want_internals):
    """One sequence; ``shift``: as for :func:`_dense_forward` (read by the FP8 backward only: the
    hybrid one's bf16 logits are not smoothed)."""
    hkv = k.shape[1]
    qg, dog = _grouped(q, hkv), _grouped(dout, hkv)
    fp8 = config.backward is BackwardPrecision.FP8
    if fp8:
        # B1 and B2: identical quantization to F1, so the logits are bit-identical to the forward's.
        qs, ks, factor = qk_operands(qg, k, config)
        shift = _rows_of(shift, hkv)
        dp = _scores(_fq_row(dog, config.do_format, config.qdo_scales, config),
                     _fq_row(v, config.v_format, config.kv_scales, config))
    else:
        qs, ks, factor, shift = _bf16(qg), _bf16(k), 1.0, None
        dp = _scores(_bf16(dog), _bf16(v))
    logits = _masked_logits(qs, ks, scale * factor, causal, window, shift=shift, softcap=softcap)
    sink = _sink_logits(sinks, q.shape[0], hkv, q.shape[2])
    matched = config.delta is DeltaMode.MATCHED
    in_stats = fp8 and config.dq_in_stats
    # Matched: the backward's own normaliser, so its P rows sum to 1 (essential in hybrid mode,
    # where these logits differ from the forward's). Stale: the forward's LSE (hybrid: in the
    # unsmoothed frame, emulated_backward's stale_lse) and rowsum(dO ∘ O). dq_in_stats: the forward's
    # LSE (the one sweep has no normaliser of its own before it needs P) and D = Σ P dP / Σ P.
    # (Through LSE', as the kernels form it: their P and so their dS codes are the emulation's.)
    lse_b = _backward_lse(logits, sink) if matched and not in_stats else _rows_of(lse, hkv)
    p = _probabilities(logits, lse_b)
    if in_stats:
        p_sum = p.sum(dim=-1)
        delta = torch.where(p_sum > 0, (p * dp).sum(dim=-1) / torch.where(p_sum > 0, p_sum, 1.0), 0.0)
    elif matched:
        delta = (p * dp).sum(dim=-1)  # over the keys: the sink has no value, dP_sink = 0
    else:
        delta = (dog.float() * _grouped(out, hkv).float()).sum(dim=-1)
    ds = p * (dp - delta[..., None])  # the softmax input's gradient (dS̃ with a cap)
    p_sink = ds_sink = None
    if sink is not None:
        p_sink = _probabilities(sink[..., None], lse_b)[..., 0]
        ds_sink = -p_sink * delta
    ds_logits = ds if softcap is None else ds * _cap_derivative(logits, softcap)
    if fp8:
        pow2, bq, bk = config.pow2_scales, config.block_q, config.block_k
        # B3 dV = Pᵀ dO: contraction over queries -> P per column within each query tile (or the
        # fixed grid), dO by config.channel_scales.
        dv = _cols_times(_backward_p(p, config), _fq_col(dog, config.do_format, bq, config))
        # B4 dQ = dS K: contraction over keys -> dS per row within each key tile (or one scale per
        # head, below), K (untransformed) by config.channel_scales.
        # B5 dK = dSᵀ Q: contraction over queries -> dS per column within each query tile (or per
        # head), Q by config.channel_scales.
        if config.ds_scales is Granularity.HEAD:
            ds_q = ds_k = _fq_ds_head(ds_logits, p, dp, delta, config)
        else:
            ds_k = fake_quantize(ds_logits, dim=-2, block=bq, fmt=config.ds_format, pow2=pow2)
            ds_q = None if in_stats else fake_quantize(ds_logits, dim=-1, block=bk, fmt=config.ds_format, pow2=pow2)
        k_col = _fq_col(k, config.k_format, bk, config)
        if in_stats:  # dQ from the statistics sweep's sums, not from a quantized dS
            dq = _dq_from_stats(p, dp, k_col, dog, v, config)
        else:
            dq = _rows_times(ds_q, k_col)
        dk = _cols_times(ds_k, _fq_col(qg, config.q_format, bq, config))
    else:
        dv = _cols_times(_bf16(p), _bf16(dog))
        dq = _rows_times(_bf16(ds_logits), _bf16(k))
        dk = _cols_times(_bf16(ds_logits), _bf16(qg))
    grads = ((dq * scale).reshape(q.shape).to(q.dtype), (dk * scale).to(k.dtype), dv.to(v.dtype))
    if sink is not None:
        grads += (_sink_grad(ds_sink),)
    internals = None
    if want_internals:
        internals = BackwardInternals(p=p, dp=dp, delta=delta, ds=ds, p_sink=p_sink, ds_sink=ds_sink)
    return grads, internals


def emulated_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    config: FP8AttentionConfig,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention forward. Returns ``out (B, Hq, Sq, D)`` (q's dtype) and ``lse (B, Hq, Sq)`` fp32.

    ``softcap``, ``sinks (Hq,)``: the logit modifiers of the module docstring (LSE includes the
    sink). With ``mask.is_varlen`` the batch must be 1 and the token axis holds the packed
    sequences; tokens outside every sequence get output 0 and LSE -inf.
    """
    mods = (softcap, sinks)
    shift = smoothing_shift(q, k, scale, mask, config, softcap, sinks)
    if not mask.is_varlen:
        return _dense_forward(q, k, v, scale, mask.causal, mask.window, config, *mods, shift)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for qs, qe, ks, ke in mask.sequence_bounds():
        out[:, :, qs:qe], lse[:, :, qs:qe] = _dense_forward(
            q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], scale, mask.causal, mask.window, config, *mods,
            None if shift is None else shift[:, :, qs:qe],
        )
    return out, lse


def emulated_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None,
    lse: torch.Tensor,
    dout: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    config: FP8AttentionConfig,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_internals: bool = False,
):
    """FP8 (or hybrid bf16) attention backward with the matched or stale delta.

    Args:
        q, k, v: the forward's inputs (shapes in the module docstring).
        out: the forward output ``(B, Hq, Sq, D)``; only the stale delta reads it (None is fine
            for ``delta="matched"``).
        lse: the forward's LSE ``(B, Hq, Sq)`` fp32.
        dout: ``(B, Hq, Sq, D)`` gradient of the output.
        softcap, sinks: the forward's logit modifiers (module docstring).
    Returns:
        ``(dq, dk, dv)`` in the inputs' dtypes, followed with ``sinks`` by their gradient
        ``dsinks (Hq,)`` fp32 (summed over the batch and the packed sequences); with
        ``return_internals`` also a list of :class:`BackwardInternals` (one per packed sequence;
        one entry for a dense batch).
    """
    if config.delta is DeltaMode.STALE and out is None:
        raise ValueError("the stale delta rowsum(dO ∘ O) needs the forward output `out`")
    check_dq_in_stats(config, softcap, sinks)
    args = (scale, mask.causal, mask.window, config, softcap, sinks)
    shift = smoothing_shift(q, k, scale, mask, config, softcap, sinks)
    lse = stale_lse(lse, q, k, scale, mask, config, softcap, sinks)
    if not mask.is_varlen:
        grads, internals = _dense_backward(q, k, v, out, lse, dout, *args, shift, return_internals)
        return (grads, [internals]) if return_internals else grads
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32, device=q.device)
    all_internals = []
    for qs, qe, ks, ke in mask.sequence_bounds():
        sq, sk = slice(qs, qe), slice(ks, ke)
        out_i = None if out is None else out[:, :, sq]
        part, internals = _dense_backward(
            q[:, :, sq], k[:, :, sk], v[:, :, sk], out_i, lse[:, :, sq], dout[:, :, sq], *args,
            None if shift is None else shift[:, :, sq], return_internals,
        )
        dq[:, :, sq], dk[:, :, sk], dv[:, :, sk] = part[:3]
        if dsinks is not None:
            dsinks += part[3]  # sequences in order: deterministic
        all_internals.append(internals)
    grads = (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
    return (grads, all_internals) if return_internals else grads
