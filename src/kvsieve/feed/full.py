"""One-pass prefill: the baseline every other feed is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from kvsieve.decode import extend
from kvsieve.feed import FeedOutput
from kvsieve.spec import component


@component("full", "feed")
@dataclass(frozen=True)
class FullPrefill:
    """Prefill the whole prompt in one forward pass; only the last position's logits are computed."""

    one_pass: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return self.tag

    def prefill(
        self,
        model: PreTrainedModel,
        ids: torch.Tensor,
        cache: Cache | None = None,
        position: int | None = None,
        every_logit: bool = False,
    ) -> FeedOutput:
        """Prefill `ids` (1, L) into `cache` (an empty one the caller may already watch, or a new one), or
        onto a cache that holds a prompt prefix already: then `ids` go at `position` .. `position` + L - 1,
        by default right after the cache's entries (a plain prefix at positions 0 .. P-1; a compressed
        one holds fewer entries than the positions it covers). `every_logit` keeps the (L, vocab) logits
        of every position (prompt log-probabilities), not only the last one's."""
        cache = cache if cache is not None else DynamicCache(config=model.config)
        start = cache.get_seq_length() if position is None else position
        with torch.no_grad():
            logits = extend(model, cache, ids, start, logits_to_keep=0 if every_logit else 1)
        every = logits if every_logit else None
        return FeedOutput(cache=cache, last_logits=logits[-1], next_position=start + ids.shape[1], logits=every)
