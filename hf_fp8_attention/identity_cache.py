"""A small cache keyed on the identity (and version) of tensors, for values derived from them.

Every layer of a model forward receives the same ``attention_mask``, ``position_ids`` and
``cu_seqlens`` tensor objects. What the attention derives from them on the host (the varlen plan,
the validated sequence lengths) costs device syncs, and a sync per layer stops the host from
running ahead of the GPU. Caching on the tensors' identity computes it once per forward.

A hit needs the very same live tensor objects with unchanged version counters (an in-place write
bumps ``tensor._version``), so a freed tensor whose id is reused, or a tensor modified in place,
is a miss. Entries hold weak references only; the cache never keeps a tensor alive. Inference
tensors (``torch.inference_mode``) carry no version counter and are never cached. A write that
bypasses the version counter (through ``tensor.data``) is not seen: pass a new tensor instead.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Hashable

import torch


def _identity(t: torch.Tensor | None):
    return None if t is None else (id(t), t._version)


class IdentityCache:
    """``get(tensors, extra, compute)``: ``compute()``'s value, reused while ``tensors`` (a tuple of
    tensors or None) are the same live objects, unmodified, and ``extra`` (hashable) is equal.

    Holds at most ``maxsize`` entries (least recently used dropped first).
    """

    def __init__(self, maxsize: int = 8):
        self.maxsize = maxsize
        self._entries: OrderedDict = OrderedDict()

    def get(self, tensors: tuple, extra: Hashable, compute: Callable[[], object]):
        if torch.compiler.is_compiling():  # traced code: no host-side state
            return compute()
        if any(t is not None and t.is_inference() for t in tensors):
            return compute()  # inference tensors have no version counter: in-place writes would go unseen
        key = (tuple(_identity(t) for t in tensors), extra)
        entry = self._entries.get(key)
        if entry is not None:
            refs, value = entry
            if all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, tensors)):
                self._entries.move_to_end(key)
                return value
            del self._entries[key]  # an id reused by a new tensor
        value = compute()
        self._entries[key] = (tuple(None if t is None else weakref.ref(t) for t in tensors), value)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


__all__ = ["IdentityCache"]
