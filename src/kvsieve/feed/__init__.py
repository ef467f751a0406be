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
    """KV cache after prefill, the logits that give the first new token, and the next position."""

    cache: Cache
    last_logits: torch.Tensor
    next_position: int
    details: dict[str, Any] = field(default_factory=dict)


class Feed(Protocol):
    name: str
    # True when every prompt position must fit in the model's trained context.
    needs_full_context: bool

    def prefill(self, model: PreTrainedModel, ids: torch.Tensor) -> Prefilled: ...
