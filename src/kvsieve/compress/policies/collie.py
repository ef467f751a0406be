"""The IMDC authors' pruner ("ConvPruner" in ZhiYuanZeng/Collie, `collie/models/mem_perceiver/pruner.py`).

IMDC ("Memorize Step by Step", Zeng et al., EMNLP 2024) prunes [sinks | memory | chunk] after every
chunk. The paper names SnapKV and StreamingLLM as its pruners; the authors' code runs this attention-plus-pooling rule:

- every query of the chunk votes: its softmax attention over all the keys it sees is summed per
  key (per KV head; query head h votes for KV head h // n_rep, where the reference code's
  grouping maps h mod n_kv);
- the sums are average-pooled (5 tokens, stride 1, zero padding) over the keys after the sinks:
  the reference strips the sink tokens before it pools, so sink scores never leak into the first
  memory tokens;
- each pooled sum is divided by the number of queries that can see the key: all q for sinks and
  memory, q - j for the chunk's key at offset j (causal). The reference pools before it divides,
  and so does this;
- nothing is protected: no observation window or recent tail is kept regardless of its score.

Differences from the reference, all at the edges: the visible count uses the actual number of
queries (the reference uses its configured chunk size, wrong for a shorter last chunk or for
IMDC's decremental chunks), and the first chunk's sink queries vote too (the reference drops
their rows along with the sink columns). One-shot: it has no per-step rule, so it compresses a
prompt (`--set compress.policy=collie`) or prunes a chunked feed's memory
(`--set feed.pruner=collie`), but cannot evict while decoding.

Cost: the column sums need every query's attention row. Under kvsieve's dense attention (a chunk
of a chunked feed, a one-pass prompt before a compress stage, a server extension) they come out
of the attention pass itself (`kvsieve.attention.accumulate`, as H2O's do), so pruning adds only
the pooling; under another prefill kernel (CritiPrefill's) a second pass computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvsieve.compress.policy import PromptScorer
from kvsieve.compress.scorers import check_pool_size, visible_mean
from kvsieve.errors import KvsieveError
from kvsieve.spec import component, option


@component("collie", "policy")
@dataclass(frozen=True)
class Collie(PromptScorer):
    """All queries' attention per key, pooled after the sinks, divided by how many queries see it. One-shot."""

    pool_size: int = option(5, "tokens each score is average-pooled over, odd (authors' code: 5)", was="kernel")
    sinks: int = option(4, "first positions left out of the pooling (set it to the feed's sinks, 4)")

    def __post_init__(self) -> None:
        check_pool_size(self.pool_size)
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 0:
            raise KvsieveError(
                f"Collie's sinks (first positions left out of the pooling) must be a whole number >= 0, "
                f"got {self.sinks!r}; use the feed's sink count (feed.sinks, 4 by default)."
            )

    @property
    def summed_alpha(self) -> float:
        return 1.0  # its scores are made from every query's column sums

    def from_sums(self, sums: torch.Tensor, queries: int) -> torch.Tensor:
        """Pooled after the sinks, then divided by how many of the `queries` see each key."""
        return visible_mean(sums, queries, self.pool_size, self.sinks)

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, 0
