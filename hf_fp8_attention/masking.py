"""Which keys each query may see: causal (diagonal aligned to the end), sliding window, varlen.

Every implementation (emulation, exact reference, Triton kernels) follows these rules:

- Query ``i`` of a sequence with ``q_len`` queries and ``kv_len`` keys sits at position
  ``i + kv_len - q_len`` (KV-cache decode: the queries are the last tokens).
- ``causal``: key ``j`` is visible iff ``j <= pos(i)``.
- ``window=w``: key ``j`` is visible iff ``pos(i) - j < w`` (and, when not causal, also
  ``j - pos(i) < w``): ``w`` keys up to and including the diagonal, as Mistral's ``sliding_window``.
- Varlen (packed) batches: ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32, ``(n_seq + 1,)``, starting at 0)
  delimit independent sequences along the token axis; no sequence sees another. Tiles restart at
  every sequence start.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# "No sliding window" as the int the custom ops and the kernels take (MaskSpec.window is None).
# The kernels read their ``window`` argument only when compiled with HAS_WINDOW.
NO_WINDOW = -1


@dataclass(frozen=True)
class MaskSpec:
    """The masking request of one attention call (see the module docstring for the rules).

    The canonical description every implementation reads: ``cu_seqlens_q`` / ``cu_seqlens_k`` are
    int32, contiguous and on the inputs' device (``functional.fp8_attention`` casts them, once).
    """

    causal: bool = False
    window: int | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    # Varlen: the longest query / key sequence, when the caller knows it on the host (the kernels
    # size their grids by it; without it they read it from cu_seqlens, a device sync).
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def window_arg(self) -> int:
        """``window`` as an int argument: :data:`NO_WINDOW` (-1) when there is none."""
        return NO_WINDOW if self.window is None else int(self.window)

    def sequence_bounds(self) -> list[tuple[int, int, int, int]]:
        """``[(q_start, q_end, k_start, k_end), ...]`` of each packed sequence (varlen only)."""
        cq = self.cu_seqlens_q.tolist()
        ck = self.cu_seqlens_k.tolist()
        return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def varlen_max_lengths(mask: MaskSpec) -> tuple[int, int]:
    """``(max_seqlen_q, max_seqlen_k)`` of a varlen mask: the host values it carries, else read from
    ``cu_seqlens`` (one device sync; 0 for a batch with no sequence)."""
    if mask.max_seqlen_q is not None and mask.max_seqlen_k is not None:
        return mask.max_seqlen_q, mask.max_seqlen_k
    cu_q, cu_k = mask.cu_seqlens_q, mask.cu_seqlens_k
    if cu_q.numel() < 2:
        return 0, 0
    lens = torch.stack([(cu_q[1:] - cu_q[:-1]).max(), (cu_k[1:] - cu_k[:-1]).max()])
    max_q, max_k = (int(x) for x in lens.tolist())
    return max_q, max_k


def dense_mask(q_len: int, kv_len: int, *, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """Boolean ``(q_len, kv_len)`` mask, True where a query may attend; None when nothing is masked."""
    if not causal and window is None:
        return None
    pos_q = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    pos_k = torch.arange(kv_len, device=device)[None, :]
    allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        allowed &= pos_k <= pos_q
    if window is not None:
        allowed &= (pos_q - pos_k) < window
        if not causal:
            allowed &= (pos_k - pos_q) < window
    return allowed
