"""H2O (Zhang et al. 2023): heavy hitters by accumulated attention, half the budget for recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.compress.policy import Policy
from kvsieve.compress.scorers import accumulated_attention
from kvsieve.spec import component


@component("h2o", "policy")
@dataclass(frozen=True)
class H2O(Policy):
    """Attention accumulated over all queries (alpha = 1); the newest half of the budget always kept."""

    step_alpha: ClassVar[float] = 1.0

    def prompt_scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        return accumulated_attention(query, key, scaling, alpha=1.0)

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, budget // 2
