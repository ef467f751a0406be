"""The `feed` stage: how the (selected) prompt is prefilled into a KV cache.

A feed returns the cache, the last position's logits and the logical position of the next
token. `full.py` runs one pass; chunked feeds with a compressed memory live beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import Cache, PreTrainedModel


@dataclass
class Prefilled:
    """KV cache after prefill, the logits that give the first new token, and the next position.

    `kept_positions[j]` (kv_heads, n) are the positions, among the keys layer j attended over in
    the feed's last forward pass, of the cache entries; None when the cache is exactly those keys
    (one-pass prefill). Later stages that observed that pass align their scores with it.
    """

    cache: Cache
    last_logits: torch.Tensor
    next_position: int
    details: dict[str, Any] = field(default_factory=dict)
    kept_positions: list[torch.Tensor] | None = None
    token_indices: list[torch.Tensor] | None = None  # chunked feeds: prompt index of every final cache entry
    history: list[dict[str, Any]] = field(default_factory=list)  # chunked feeds: one record per step


class Feed(Protocol):
    name: str
    # True when every prompt position must fit in the model's trained context.
    needs_full_context: bool

    def prefill(self, model: PreTrainedModel, ids: torch.Tensor) -> Prefilled: ...
