"""TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"): keep what the newest query attends to.

The score of a cached token is the attention the *last* query pays it, averaged over all query
heads of the layer (the paper's choice: one ranking per layer, shared by every KV head). After
prefill the last prompt token is that query; while decoding, each new token's row replaces the
previous scores (no accumulation), which is TOVA's per-step rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.compress.policy import LayerPass, PromptScorer
from kvsieve.compress.scorers import attention_probs
from kvsieve.spec import component


@component("tova", "policy")
@dataclass(frozen=True)
class TOVA(PromptScorer):
    """The newest query's attention, averaged over the layer's heads; replaced at every step."""

    rescores: ClassVar[bool] = True

    @property
    def scored_queries(self) -> int:
        return 1  # the last query

    @property
    def step_reads_attention(self) -> bool:
        return True

    def prompt_scores(self, seen: LayerPass) -> torch.Tensor:
        row = attention_probs(seen.query[:, -1:], seen.key, seen.scaling)[:, 0]
        return self.row_scores(None, row, seen.key.shape[0])

    def row_scores(self, previous: torch.Tensor | None, row: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """The last query's attention (h, n), averaged over the heads, for every KV head (`previous` unused)."""
        return row.mean(0).expand(kv_heads, -1)
