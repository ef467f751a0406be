"""The `compress` stage and per-step eviction: shrink the KV cache by a scorer and a budget.

- `scorers.py`: one small function per importance score (window attention, accumulated
  attention with forgetting factor), shared with decoding eviction and chunked feeds;
- `methods.py`: SnapKV, H2O, A2SF, StreamingLLM, local window (scorer + protected positions);
- `cache.py`: budgets and the per-KV-head gather that frees memory;
- `stages.py`: `Compress` (once, after prefill) and `Evict` (while decoding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from transformers import Cache

from kvsieve.attention import Observer


class Compressor(Protocol):
    name: str

    def observers(self) -> Sequence[Observer]:
        """Observers to run during the feed, collecting what scoring needs."""
        ...

    def compress(self, cache: Cache, kept_positions: list[torch.Tensor] | None = None) -> dict[str, Any]:
        """Prune `cache` in place; return what was done (budget, sizes, ...).

        `kept_positions` map cache entries to the feed's last attended keys when the feed pruned
        its own cache (chunked prefill), so observed scores can be aligned with the cache.
        """
        ...
