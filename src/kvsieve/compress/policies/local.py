"""Local window: only the most recent tokens (the simplest baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvsieve.compress.policy import PromptScorer
from kvsieve.spec import component


@component("local", "policy")
@dataclass(frozen=True)
class LocalWindow(PromptScorer):
    """Keep the newest `budget` tokens."""

    position_only: ClassVar[bool] = True

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, budget
