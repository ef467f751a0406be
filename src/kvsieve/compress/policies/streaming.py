"""StreamingLLM (Xiao et al. 2024): attention sinks plus a window of the most recent tokens.

Positions. By default a kept token keeps the position it was encoded at and a new token
continues at the logical position (as kvpress and SnapKV / H2O do), so the sinks drift ever
farther from the newest tokens and a stream breaks down past the model's trained context.
`reencode=True` follows the paper (section 3.2): positions are assigned by place in the cache,
sinks 0 .. s-1 and the window s .. in time order, and a new token is fed at position = cache
length. The kept post-RoPE keys are re-rotated to their new places after every eviction
(`EvictRun`, by `kvsieve.kv.cache.rerotate_keys`), so no position ever exceeds the
budget and a stream can run past the model's positions. The paper's code re-applies RoPE to
cached pre-RoPE keys; rotating post-RoPE keys is the same in exact arithmetic (R(a + b) =
R(a) R(b)), and in float32 the repeated rotations stay within float rounding, but in bf16 / fp16
every rotation rounds the keys to the model's dtype once more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvsieve.compress.policy import PromptScorer
from kvsieve.errors import KvsieveError
from kvsieve.spec import component, option


@component("streaming", "policy")
@dataclass(frozen=True)
class StreamingLLM(PromptScorer):
    """The first `sinks` tokens plus the most recent ones."""

    sinks: int = option(4, "first tokens always kept (attention sinks)")
    reencode: bool = option(
        False,
        "position by place in the cache (sinks 0..s-1, then the window; new token at the cache length), as in "
        "the paper: lets a stream run past the model's positions; off: tokens keep their positions (kvpress)",
    )
    position_only: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise KvsieveError(f"StreamingLLM sink count must be a whole number >= 0, got {self.sinks!r}.")
        if not isinstance(self.reencode, bool):
            raise KvsieveError(f"StreamingLLM reencode must be true or false, got {self.reencode!r}.")

    def protected(self, budget: int) -> tuple[int, int]:
        if self.sinks > budget:
            raise KvsieveError(f"StreamingLLM keeps {self.sinks} sink tokens, more than the budget {budget}.")
        return self.sinks, budget - self.sinks
