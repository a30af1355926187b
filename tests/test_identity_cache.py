"""identity_cache.IdentityCache: reuse only for the same live, unmodified tensor objects."""
from __future__ import annotations

import gc

import torch

from hf_fp8_attention.identity_cache import IdentityCache


def _counting():
    calls = []

    def compute(value):
        def run():
            calls.append(value)
            return value
        return run
    return calls, compute


def test_same_objects_hit_and_extra_keys_apart():
    cache, (calls, compute) = IdentityCache(), _counting()
    a, b = torch.arange(4), torch.ones(3)
    assert cache.get((a, b), 1, compute("x")) == "x"
    assert cache.get((a, b), 1, compute("y")) == "x"  # hit: not recomputed
    assert cache.get((a, b), 2, compute("z")) == "z"  # other extra key
    assert cache.get((a, None), 1, compute("w")) == "w"  # None is part of the key
    assert calls == ["x", "z", "w"]


def test_equal_values_in_another_tensor_miss():
    cache, (calls, compute) = IdentityCache(), _counting()
    a = torch.arange(4)
    cache.get((a,), None, compute(1))
    assert cache.get((a.clone(),), None, compute(2)) == 2


def test_in_place_write_misses():
    cache, (calls, compute) = IdentityCache(), _counting()
    a = torch.arange(4)
    cache.get((a,), None, compute(1))
    a[0] = 7  # bumps a._version
    assert cache.get((a,), None, compute(2)) == 2


def test_entries_do_not_keep_tensors_alive_and_reused_ids_miss():
    cache, (calls, compute) = IdentityCache(), _counting()
    a = torch.arange(4)
    ref = __import__("weakref").ref(a)
    cache.get((a,), None, compute(1))
    del a
    gc.collect()
    assert ref() is None  # the cache held no strong reference
    # A new tensor may get the freed id; whatever its id, it must not hit the old entry.
    for _ in range(50):
        b = torch.arange(4)
        assert cache.get((b,), None, compute(2)) == 2
        cache.clear()


def test_size_is_bounded():
    cache, (calls, compute) = IdentityCache(maxsize=2), _counting()
    ts = [torch.zeros(1) for _ in range(3)]
    for i, t in enumerate(ts):
        cache.get((t,), None, compute(i))
    assert cache.get((ts[0],), None, compute("again")) == "again"  # evicted (least recently used)
    assert cache.get((ts[2],), None, compute("no")) == 2


def test_inference_tensors_are_not_cached():
    # torch.inference_mode tensors have no version counter, so an in-place write could not be seen.
    cache, (calls, compute) = IdentityCache(), _counting()
    with torch.inference_mode():
        a = torch.arange(4)
    assert cache.get((a,), None, compute(1)) == 1
    assert cache.get((a,), None, compute(2)) == 2
