"""Launch-configuration autotuning that costs one dict lookup per call once a key is tuned.

``triton.autotune`` rebuilds its key from the kernel's arguments on every launch: tens of
microseconds of host time per call, which short sequences pay in full (the GPU waits for the
host there; see benchmarks/NOTES.md, "Host time"). :class:`LaunchTuner` times every candidate
once per key with ``triton.testing.do_bench``, as the Triton autotuner does, and afterwards only
looks the choice up.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable

import triton
from triton.runtime.errors import OutOfResources

try:  # a candidate that does not compile is skipped, as triton.autotune does
    from triton.runtime.errors import PTXASError
except ImportError:  # older Triton
    PTXASError = OutOfResources
try:
    from triton.compiler.errors import CompileTimeAssertionFailure
except ImportError:
    CompileTimeAssertionFailure = OutOfResources

logger = logging.getLogger(__name__)

_UNUSABLE = (OutOfResources, PTXASError, CompileTimeAssertionFailure)


class LaunchTuner:
    """The fastest of ``candidates`` per key, found on the key's first call.

    Args:
        name: the kernel, for messages.
        candidates: launch configurations (any hashable value the caller's ``launch`` understands).
    """

    def __init__(self, name: str, candidates):
        self.name = name
        self.candidates = tuple(candidates)
        self.choices: dict[Hashable, object] = {}  # key -> chosen candidate (read by the benchmarks)

    def pick(self, key: Hashable, launch: Callable[[object], None], candidates=None):
        """The candidate for ``key``; on a new key, times ``launch(candidate)`` for each candidate first
        (the launches must be idempotent: they run many times). ``candidates``: this key's space, when
        it is not the tuner's own (e.g. per head dim; the key must then tell the spaces apart)."""
        choice = self.choices.get(key)
        if choice is None:
            choice = self.choices[key] = self._tune(key, launch, self.candidates if candidates is None else candidates)
        return choice

    def _tune(self, key, launch, candidates):
        times, errors = {}, []
        for cand in candidates:
            try:
                times[cand] = triton.testing.do_bench(lambda: launch(cand))
            except _UNUSABLE as err:
                errors.append(f"{cand}: {type(err).__name__}")
        if not times:
            raise RuntimeError(f"{self.name}: no launch configuration compiles for {key} ({'; '.join(errors)})")
        choice = min(times, key=times.get)
        logger.info("%s: launch %s for %s (%.3f ms; skipped: %s)", self.name, choice, key, times[choice],
                    ", ".join(errors) or "none")
        return choice


__all__ = ["LaunchTuner"]
