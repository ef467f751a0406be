"""One-pass prefill: the baseline every other feed is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import Cache, PreTrainedModel

from kvsieve.feed import Prefilled
from kvsieve.spec import component


@component("full", "feed")
@dataclass(frozen=True)
class FullPrefill:
    """Prefill the whole prompt in one forward pass; only the last position's logits are computed."""

    needs_full_context: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return self.tag

    def prefill(self, model: PreTrainedModel, ids: torch.Tensor, cache: Cache | None = None) -> Prefilled:
        """Prefill `ids` (1, L) into `cache` (an empty one the caller may already watch, or a new one), or
        onto a cache that holds a prompt prefix already (its entries at positions 0 .. P-1): then `ids`
        go at P .. P + L - 1."""
        start = cache.get_seq_length() if cache is not None else 0
        with torch.no_grad():
            out = model(input_ids=ids.to(model.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return Prefilled(cache=out.past_key_values, last_logits=out.logits[0, -1], next_position=start + ids.shape[1])
