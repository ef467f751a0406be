"""The `compress` stage: shrink the KV cache after prefill (interface; methods come with scorers).

A compressor may observe attention during the feed (e.g. SnapKV's window queries) and then
prunes the cache in place, per layer and KV head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from transformers import Cache

from kvsieve.attention import Observer


class Compressor(Protocol):
    name: str

    def observers(self) -> Sequence[Observer]:
        """Observers to run during the feed, collecting what scoring needs."""
        ...

    def compress(self, cache: Cache) -> dict[str, Any]:
        """Prune `cache` in place; return what was done (sizes kept per layer, ...)."""
        ...
