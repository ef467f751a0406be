"""KNorm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression").

Keys with a *low* L2 norm attract the most attention, so the score is minus the key's norm. It
needs no attention at all: neither the prompt's queries nor a decoding step's, which makes it
the cheapest policy. Per KV head, like every kvsieve policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.compress.policy import LayerPass, PromptScorer, Reading
from kvsieve.spec import component


@component("knorm", "policy")
@dataclass(frozen=True)
class KNorm(PromptScorer):
    """Score = -||k||_2 per KV head and token (float32); the same rule after every decoding step."""

    rescores: ClassVar[bool] = True

    @property
    def scored_queries(self) -> int:
        return 0  # none: keys only

    reads: ClassVar[frozenset[Reading]] = frozenset({"keys"})

    def prompt_scores(self, seen: LayerPass) -> torch.Tensor:
        return -seen.key.float().norm(dim=-1)
