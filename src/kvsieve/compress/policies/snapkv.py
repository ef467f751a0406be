"""SnapKV (Li et al. 2024): the last `window` prompt queries vote; their pooled attention ranks the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvsieve.compress.policy import LayerPass, PromptScorer
from kvsieve.compress.scorers import check_pool_size, window_attention
from kvsieve.errors import KvsieveError
from kvsieve.spec import component, option


@component("snapkv", "policy")
@dataclass(frozen=True)
class SnapKV(PromptScorer):
    """Attention of the last `window` prompt queries, pooled; the window itself is always kept. One-shot."""

    window: int = option(32, "observation window: the last prompt queries that vote (always kept)")
    pool_size: int = option(5, "tokens each vote is pooled over, odd", was="kernel")
    pool: Literal["avg", "max"] = option("avg", "pooling: avg or max")

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise KvsieveError(f"SnapKV window must be a whole number >= 1, got {self.window!r}.")
        check_pool_size(self.pool_size)
        if self.pool not in ("avg", "max"):
            raise KvsieveError(f"SnapKV pooling must be 'avg' or 'max', got {self.pool!r}.")

    @property
    def scored_queries(self) -> int:
        return self.window  # the observation window

    def prompt_scores(self, seen: LayerPass) -> torch.Tensor:
        return window_attention(seen.query, seen.key, seen.scaling, self.window, self.pool_size, self.pool)

    def protected(self, budget: int) -> tuple[int, int]:
        if self.window > budget:
            raise KvsieveError(f"SnapKV window {self.window} exceeds the budget {budget}; lower the window.")
        return 0, self.window
