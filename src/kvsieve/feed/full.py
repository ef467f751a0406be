"""One-pass prefill: the baseline every other feed is compared with."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvsieve.feed import Prefilled


@dataclass(frozen=True)
class FullPrefill:
    """Prefill the whole prompt in one forward pass; only the last position's logits are computed."""

    name: str = "full"
    needs_full_context: bool = True

    def prefill(self, model: PreTrainedModel, ids: torch.Tensor) -> Prefilled:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return Prefilled(cache=out.past_key_values, last_logits=out.logits[0, -1], next_position=ids.shape[1])
