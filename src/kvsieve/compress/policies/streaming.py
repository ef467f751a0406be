"""StreamingLLM (Xiao et al. 2024): attention sinks plus a window of the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvsieve.compress.policy import Policy
from kvsieve.errors import KvsieveError
from kvsieve.spec import component, option


@component("streaming", "policy")
@dataclass(frozen=True)
class StreamingLLM(Policy):
    """The first `sinks` tokens plus the most recent ones."""

    sinks: int = option(4, "first tokens always kept (attention sinks)")
    position_only: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise KvsieveError(f"StreamingLLM sink count must be a whole number >= 0, got {self.sinks!r}.")

    def protected(self, budget: int) -> tuple[int, int]:
        if self.sinks > budget:
            raise KvsieveError(f"StreamingLLM keeps {self.sinks} sink tokens, more than the budget {budget}.")
        return self.sinks, budget - self.sinks
