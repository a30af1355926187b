"""The FP8 attention recipe: one frozen config object holding every knob (docs/design.md §2).

A config is immutable and hashable, so it can key kernel caches and travel through
``torch.library`` custom ops and ``model.config`` unchanged.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass

import torch

# Head dims the kernels and the emulation support (the kernels pad each to a power of two: 80 and
# 96 run as 128 with zero channels, as Phi-2-class models' 80 does; 256 is Gemma 2 / Gemma 3's).
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)


class FP8Format(str, enum.Enum):
    """An 8-bit floating-point format and its largest finite value."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is FP8Format.E4M3 else torch.float8_e5m2

    @property
    def max(self) -> float:
        return _format_max(self)  # 448 for E4M3, 57344 for E5M2

    @property
    def mantissa_bits(self) -> int:
        return 3 if self is FP8Format.E4M3 else 2


@functools.lru_cache(maxsize=None)
def _format_max(fmt: FP8Format) -> float:
    return float(torch.finfo(fmt.dtype).max)  # cached: read on every kernel launch


class DeltaMode(str, enum.Enum):
    """How the backward forms D_i, the per-row correction of dS = P ∘ (dP − D).

    ``MATCHED``: D_i = Σ_j P_ij dP_ij from the backward's own fp32 P and dequantized dP, with the
    backward's own softmax normaliser (Delta-Matching; restores Σ_j dS_ij = 0).
    ``STALE``: D_i = rowsum(dO ∘ O) from the forward output, with the forward's LSE (what
    FlashAttention-style backwards compute; the ablation baseline).
    """

    MATCHED = "matched"
    STALE = "stale"


class BackwardPrecision(str, enum.Enum):
    """Operand precision of the backward matmuls: ``FP8`` (block-scaled) or ``BF16`` (hybrid)."""

    FP8 = "fp8"
    BF16 = "bf16"


class Granularity(str, enum.Enum):
    """How many scales an operand gets, along the axis that is not contracted.

    For the operands of the matmuls that contract over the head dim (Q, K in QKᵀ; dO, V in dO·Vᵀ):
    ``TOKEN``, one scale per token; ``HEAD``, one scale per (sequence, head).
    For the operands contracted over tokens (V in PV, dO in Pᵀ dO, K in dS K, Q in dSᵀ Q):
    ``TILE``, one scale per channel within each tile of ``block_q`` / ``block_k`` tokens;
    ``CHANNEL``, one scale per channel per (sequence, head); ``HEAD``, one per (sequence, head).
    A "sequence" is a batch row, or one packed sequence of a varlen batch: scales never cross a
    sequence boundary.
    """

    TOKEN = "token"
    TILE = "tile"
    CHANNEL = "channel"
    HEAD = "head"


class PScaling(str, enum.Enum):
    """How P is quantized for the PV and Pᵀ dO matmuls.

    ``TILE``: the forward's P per row within each key tile (codes relative to the tile's row
    maximum), the backward's per column within each query tile (an amax per column).
    ``FIXED``: the backward's P = exp(S − LSE) lies in [0, 1] and is cast on the fixed grid
    fp8(448 · P) (scale 1/448, no amax); the forward keeps its tile-relative codes, whose scale
    folds into the online-softmax rescale it does anyway.
    """

    TILE = "tile"
    FIXED = "fixed"


class Backend(str, enum.Enum):
    """Which implementation runs: ``AUTO`` picks Triton kernels on capable GPUs, else emulation."""

    AUTO = "auto"
    TRITON = "triton"
    EMULATION = "emulation"


_TILE_SIZES = (16, 32, 64, 128, 256)
_ROW_GRANULARITIES = (Granularity.TOKEN, Granularity.HEAD)
_COL_GRANULARITIES = (Granularity.TILE, Granularity.CHANNEL, Granularity.HEAD)
_DS_GRANULARITIES = (Granularity.TILE, Granularity.HEAD)
_FIXED_E4M3_ROLES = ("q_format", "k_format", "v_format", "p_format")


def _coerce_enum(enum_cls, value, field_name: str):
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"FP8AttentionConfig.{field_name}={value!r} is not one of {choices}") from None


@dataclass(frozen=True)
class FP8AttentionConfig:
    """Every knob of the block-scaled FP8 attention recipe.

    Formats per tensor role: Q, K, V and P are E4M3 (the recipe fixes them); dO and dS default to
    E4M3 and may be E5M2 (wider range, less precision) for gradients with large dynamic range.

    Tiles: ``block_q`` (B_r) and ``block_k`` (B_c) are the query and key tile sizes. They set the
    blocks over which the channel-wise scales of V/K/Q/dO and the row/column scales of P and dS are
    shared, so the kernels and the emulation must use the same values to agree closely. The GPU
    kernels need blocks of at least 32 tokens (FP8 tensor-core matmuls contract over 32 or more);
    16-token blocks run only in the emulation.

    ``pow2_scales`` rounds every scale up to a power of two (exact dequantization, as in MXFP8).
    The forward's P is the exception: it is always quantized against its tile row maximum (its scale
    is an fp32 factor folded into the online-softmax rescale, where a power of two buys nothing).

    Scale granularity (:class:`Granularity`): ``qdo_scales`` for Q and dO and ``kv_scales`` for K
    and V in the matmuls contracted over the head dim (QKᵀ, dO·Vᵀ): ``"token"`` or ``"head"``;
    ``channel_scales`` for the operands contracted over tokens (V in PV, dO in Pᵀ dO, K in dS K, Q
    in dSᵀ Q): ``"tile"``, ``"channel"`` or ``"head"``. ``p_scales``: :class:`PScaling`.
    ``ds_scales`` for dS in dQ = dS K and dK = dSᵀ Q: ``"tile"``, per row within each key tile (dQ)
    and per column within each query tile (dK); ``"head"``, one scale per (sequence, query head)
    for both, taken from a bound the statistics pass forms before any dS exists,
    max_i [max_j P_ij |dP_ij| + |D_i| max_j P_ij] ≥ max |dS| (so no code saturates). With it both
    matmuls accumulate on the tensor cores without a rescale per tile.

    Exact transforms of the QKᵀ operands (QKᵀ's softmax is unchanged, so only the quantization
    error changes): ``smooth_k`` subtracts the keys' channel mean over each (sequence, kv head)
    before K is quantized for QKᵀ (each row of S shifts by a constant); ``hadamard`` rotates Q
    and K along the head dim by a ±1 Hadamard matrix (block-diagonal, blocks of the largest power of
    two dividing the head dim, at most 128: 80 -> 16, 96 -> 32, 256 -> two of 128), folding its
    1/block into the softmax scale.

    ``dq_in_stats`` forms dQ in the backward's statistics sweep instead of a sweep of its own:
    dS = P ∘ (dP − D), so dQ_i = A_i − D'_i B_i with A = fq(P ∘ dP) K (one power-of-two scale per
    query row, from the bound ‖dO_i‖ √d amax(V) ≥ |dP_ij| that holds before the sweep) and
    B = P̂ K (P on the fixed grid), both accumulated over the keys before D is known, and
    D'_i = Σ_j fq(P ∘ dP)_ij / Σ_j P̂_ij, so that the dS dQ is formed from sums to zero over each row.
    P is normalised by the forward's LSE and the dK / dV launch's D_i = Σ_j P_ij dP_ij / Σ_j P_ij
    (zero row sums for any normaliser). One launch and one matmul-equivalent fewer: 1-5% of the
    backward at head dim 128 on the H200, nothing or a loss at 64 (benchmarks/NOTES.md). Needs the
    matched delta, the FP8 backward, ``kv_scales="head"``, ``p_scales="fixed"`` and sequence-wide
    channel scales (not ``"tile"``); calls with a soft-cap or sinks are refused.

    ``delta`` picks Delta-Matching (``"matched"``) or the stale rowsum(dO ∘ O) (``"stale"``);
    ``backward`` picks FP8 backward matmuls (``"fp8"``) or the hybrid bf16 backward (``"bf16"``).
    ``backend`` forces the Triton kernels or the PyTorch emulation; ``"auto"`` chooses by device.
    """

    q_format: FP8Format = FP8Format.E4M3
    k_format: FP8Format = FP8Format.E4M3
    v_format: FP8Format = FP8Format.E4M3
    p_format: FP8Format = FP8Format.E4M3
    do_format: FP8Format = FP8Format.E4M3
    ds_format: FP8Format = FP8Format.E4M3
    block_q: int = 128
    block_k: int = 128
    pow2_scales: bool = False
    qdo_scales: Granularity = Granularity.TOKEN
    kv_scales: Granularity = Granularity.HEAD
    channel_scales: Granularity = Granularity.CHANNEL
    p_scales: PScaling = PScaling.FIXED
    ds_scales: Granularity = Granularity.HEAD
    smooth_k: bool = True
    hadamard: bool = True
    dq_in_stats: bool = False
    delta: DeltaMode = DeltaMode.MATCHED
    backward: BackwardPrecision = BackwardPrecision.FP8
    backend: Backend = Backend.AUTO

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name.endswith("_format"):
                object.__setattr__(self, f.name, _coerce_enum(FP8Format, getattr(self, f.name), f.name))
        object.__setattr__(self, "delta", _coerce_enum(DeltaMode, self.delta, "delta"))
        object.__setattr__(self, "backward", _coerce_enum(BackwardPrecision, self.backward, "backward"))
        object.__setattr__(self, "backend", _coerce_enum(Backend, self.backend, "backend"))
        object.__setattr__(self, "p_scales", _coerce_enum(PScaling, self.p_scales, "p_scales"))
        for name, allowed in (("qdo_scales", _ROW_GRANULARITIES), ("kv_scales", _ROW_GRANULARITIES),
                              ("channel_scales", _COL_GRANULARITIES), ("ds_scales", _DS_GRANULARITIES)):
            value = _coerce_enum(Granularity, getattr(self, name), name)
            if value not in allowed:
                choices = ", ".join(repr(g.value) for g in allowed)
                raise ValueError(f"FP8AttentionConfig.{name}={value.value!r} is not one of {choices}")
            object.__setattr__(self, name, value)
        for name in _FIXED_E4M3_ROLES:
            if getattr(self, name) is not FP8Format.E4M3:
                raise ValueError(
                    f"FP8AttentionConfig.{name} must be 'e4m3' (the recipe fixes Q, K, V and P to E4M3); "
                    "only do_format and ds_format may be 'e5m2'"
                )
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value not in _TILE_SIZES:
                raise ValueError(f"FP8AttentionConfig.{name}={value!r} must be one of {_TILE_SIZES}")
        for name in ("pow2_scales", "smooth_k", "hadamard", "dq_in_stats"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FP8AttentionConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.dq_in_stats:
            conflicts = [f"{name}={value!r}" for name, value, ok in (
                ("delta", self.delta.value, self.delta is DeltaMode.MATCHED),
                ("backward", self.backward.value, self.backward is BackwardPrecision.FP8),
                ("kv_scales", self.kv_scales.value, self.kv_scales is Granularity.HEAD),
                ("p_scales", self.p_scales.value, self.p_scales is PScaling.FIXED),
                ("channel_scales", self.channel_scales.value, self.channel_scales is not Granularity.TILE),
            ) if not ok]
            if conflicts:
                raise ValueError(
                    "FP8AttentionConfig.dq_in_stats=True needs delta='matched', backward='fp8', kv_scales='head', "
                    f"p_scales='fixed' and channel_scales 'channel' or 'head'; got {', '.join(conflicts)}"
                )

    def replace(self, **changes) -> "FP8AttentionConfig":
        """A copy with some fields changed (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_recipe(cls, name: str, **overrides) -> "FP8AttentionConfig":
        """A named recipe (see :data:`RECIPES`), optionally with fields overridden."""
        if name not in RECIPES:
            raise ValueError(f"unknown FP8 attention recipe {name!r}; known: {', '.join(sorted(RECIPES))}")
        return RECIPES[name].replace(**overrides) if overrides else RECIPES[name]


# The first release's recipe: per-token scales for the head-dim contractions, per-tile channel
# scales for the token contractions, P and dS per tile, no transforms. Kept so that every
# comparison can be rerun.
_TILE_RECIPE = dict(kv_scales=Granularity.TOKEN, channel_scales=Granularity.TILE, p_scales=PScaling.TILE,
                    ds_scales=Granularity.TILE, smooth_k=False, hadamard=False)
# fp8_delta's first v2 form: K and V per token too, P and dS per tile. On the real-activation fixture
# its gradients' errors are 11-20% below fp8_delta's on one layer, up to 12% on the other; its kernels
# are the Triton launches, about 0.6x cuDNN's fwd+bwd against fp8_delta's 0.8-1.0x (no Gluon kernel
# runs per-key or per-tile factors; benchmarks/NOTES.md, "Recipe v2").
_TOKEN_RECIPE = dict(kv_scales=Granularity.TOKEN, p_scales=PScaling.TILE, ds_scales=Granularity.TILE)
# One scale per (sequence, head) for Q, K, V, dO and dS everywhere, P on the fixed grid: the fewest
# per-element operations in the kernels, and every backward matmul accumulates in place.
_FAST_RECIPE = dict(qdo_scales=Granularity.HEAD, kv_scales=Granularity.HEAD, channel_scales=Granularity.HEAD,
                    p_scales=PScaling.FIXED, ds_scales=Granularity.HEAD)

RECIPES: dict[str, FP8AttentionConfig] = {
    # The product: per-token Q and dO, per-(sequence, head) K and V for QKᵀ / dO·Vᵀ, per-(sequence,
    # head) channel scales, P on the fixed grid, dS one scale per query head, K-smoothing and
    # Hadamard rotation for QKᵀ, Delta-Matching.
    "fp8_delta": FP8AttentionConfig(),
    # The ablation baseline: the same FP8 matmuls with the stale delta rowsum(dO ∘ O).
    "fp8_stale": FP8AttentionConfig(delta=DeltaMode.STALE),
    # Per-tensor scales, fixed-grid P: the speed recipe, still delta-matched.
    "fp8_delta_fast": FP8AttentionConfig(**_FAST_RECIPE),
    "fp8_stale_fast": FP8AttentionConfig(**_FAST_RECIPE, delta=DeltaMode.STALE),
    # The first release's recipe (per-tile channel scales, no transforms).
    "fp8_delta_tile": FP8AttentionConfig(**_TILE_RECIPE),
    "fp8_stale_tile": FP8AttentionConfig(**_TILE_RECIPE, delta=DeltaMode.STALE),
    # Per-token K and V, P and dS per tile: the most accurate recipe, and the slowest.
    "fp8_delta_token": FP8AttentionConfig(**_TOKEN_RECIPE),
    "fp8_stale_token": FP8AttentionConfig(**_TOKEN_RECIPE, delta=DeltaMode.STALE),
    # FP8 forward, bf16 backward (what many systems ship), with either delta.
    "hybrid_delta": FP8AttentionConfig(backward=BackwardPrecision.BF16),
    "hybrid_stale": FP8AttentionConfig(backward=BackwardPrecision.BF16, delta=DeltaMode.STALE),
    # MXFP8-like: power-of-two scales, exact dequantization.
    "fp8_delta_pow2": FP8AttentionConfig(pow2_scales=True),
    # Wider-range gradients: dO and dS in E5M2.
    "fp8_delta_e5m2_grads": FP8AttentionConfig(do_format=FP8Format.E5M2, ds_format=FP8Format.E5M2),
}
