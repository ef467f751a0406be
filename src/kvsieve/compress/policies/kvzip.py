"""KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arXiv
2505.23416): a cached entry is worth what the model needs of it to repeat the context, whatever is asked later.

After the context's prefill the model reads a "repeat the previous context" prompt followed by the context again, in
chunks of `chunk` tokens (2K in the paper), each chunk's pass on top of the context's cache and then dropped; an
entry's score is the largest attention any repeating query pays it (over the chunk's queries and the KV head's query
heads). As in the authors' code (and kvpress's), that attention is a softmax over the first `sinks` entries, the chunk
being repeated and the pass's own keys (`Reread.within`), not over the whole context: an entry is scored by the pass
that repeats it, and a chunk's scores do not shrink because other chunks exist. The pass's hidden states still attend
to every entry. A chunk after the first starts its prompt with the previous chunk's last `overlap` tokens (the paper's
"starting with ..."). The first `sinks` positions are kept.

The passes are the policy's second pass (`reads` "second_pass"): `kvsieve.feed.reconstruction` runs them, and the
scores are each key's largest attention (`reads` "attention_max"), which kvsieve's attention takes from its own
logits while it computes the pass (`kvsieve.attention.AttentionMaxima`, supplied by `score_observers`), so the keys'
logits are computed once; `prompt_scores` computes the same from a pass's queries and keys where no dense pass runs
(a soft-capped layer). The prompt's own pass scores nothing. Their cost against a full prefill is measured by `kvsieve
bench` (docs/PERFORMANCE.md).

The paper selects globally across heads and layers: `across_layers` gives each layer its share of one ranking of
every layer's entries, and the stage's `head_budgets` with no floor shares a layer's among its KV heads by one ranking
of their entries, held per head in `kvsieve.kv.heads`. The `kvzip` preset keeps one budget per layer and KV head, as
every kvsieve scorer does by default: on SmolLM2 it kept needles the global selection lost (docs/METHODS.md).

`pool_size` (not the paper's; 1, none, by default) makes an entry's score the best of its `pool_size` neighbours'
(max-pooled, `compress.scorers.pool_scores`): SmolLM2 writes a number one token a digit, so a 7-digit needle needs
seven entries kept, and an answer one digit short scores nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsieve.compress.policy import LayerPass, PromptScorer, Reading, Reread
from kvsieve.compress.scorers import attention_probs, check_pool_size, pool_scores
from kvsieve.errors import KvsieveError
from kvsieve.spec import component, option

ROWS = 256  # repeating queries scored at a time (their attention is rows x keys per head)


@component("kvzip", "policy")
@dataclass(frozen=True)
class KVzip(PromptScorer):
    """The largest attention an entry receives while the model repeats the context (its second pass)."""

    reads: ClassVar[frozenset[Reading]] = frozenset({"attention_max", "second_pass"})

    chunk: int = option(2048, "context tokens repeated by one reconstruction pass (paper: 2048)")
    overlap: int = option(8, "the previous chunk's last tokens that open the next chunk's prompt (paper: 8)")
    sinks: int = option(4, "first positions always kept (paper: 4)")
    across_layers: bool = option(False, "rank every layer's entries together, budgets per layer (paper: yes)")
    pool_size: int = option(1, "neighbours an entry's score is the best of, odd (1: none, the paper's)")
    first: str = option("\n\nRepeat the previous context exactly.", "the first chunk's prompt (paper's)")
    later: str = option(
        "\n\nRepeat the part of the previous context exactly, starting with", "a later chunk's prompt (paper's)"
    )

    def __post_init__(self) -> None:
        for name, least in (("chunk", 1), ("overlap", 0), ("sinks", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise KvsieveError(f"KVzip's {name} must be a whole number >= {least}, got {value!r}.")
        check_pool_size(self.pool_size)

    @property
    def budgets_per_layer(self) -> bool:
        return self.across_layers

    def protected(self, budget: int) -> tuple[int, int]:
        return min(self.sinks, budget), 0

    def allocate(self, scores: dict[int, torch.Tensor], budget: int, layers: list[int]) -> dict[int, int] | None:
        """With `across_layers`, the paper's selection across layers: the budgeted layers' entries (sinks apart) are
        ranked together, and a layer keeps, per KV head, its share of the best budget x layers x heads of them (the
        mean over its heads, which the stage's `head_budgets` then shares among them by the same scores), sinks
        included, at least 1 more."""
        if not self.across_layers or not layers:
            return None
        ranked = [scores[j][:, self.sinks :].float() for j in layers]
        heads = ranked[0].shape[0]
        pooled = torch.cat([r.flatten() for r in ranked])
        wanted = min(max(0, budget - self.sinks) * len(layers) * heads, pooled.numel())
        if wanted == 0:
            return dict.fromkeys(layers, budget)
        threshold = pooled.topk(wanted).values[-1]
        return {
            j: self.sinks + max(1, round(float((r >= threshold).sum()) / heads))
            for j, r in zip(layers, ranked, strict=True)
        }

    def from_second_pass(self, best: torch.Tensor) -> torch.Tensor:
        """Each entry's score the best of its `pool_size` neighbours' best (kv_heads, n)."""
        return best if self.pool_size == 1 else pool_scores(best, self.pool_size, "max")

    def prompt_scores(self, seen: LayerPass) -> torch.Tensor:
        """(kv_heads, n): the largest attention each key receives from the pass's queries, over the KV head's
        query heads (float32)."""
        kv_heads, n = seen.key.shape[0], seen.key.shape[1]
        heads, q = seen.query.shape[0], seen.query.shape[1]
        best = torch.zeros(kv_heads, n, dtype=torch.float32, device=seen.key.device)
        for start in range(0, q, ROWS):  # queries start .. stop of the last q see the keys up to n - q + stop
            stop = min(start + ROWS, q)
            visible = n - q + stop
            probs = attention_probs(seen.query[:, start:stop], seen.key[:, :visible], seen.scaling)
            rows = probs.view(kv_heads, heads // kv_heads * (stop - start), visible).amax(1)
            best[:, :visible] = torch.maximum(best[:, :visible], rows)
        return best

    def second_pass(self, ids: torch.Tensor, encode: Callable[[str], list[int]]) -> list[Reread]:
        """The passes that repeat the context `ids` (1, n): per chunk, its prompt then the chunk's ids, (1, m) each,
        scored within the sinks and the chunk it repeats."""
        passes = []
        position = torch.arange(ids.shape[1], device=ids.device)
        for start in range(0, ids.shape[1], self.chunk):
            part = ids[:, start : start + self.chunk]
            if start == 0:
                opening = torch.tensor([encode(self.first)], dtype=ids.dtype, device=ids.device)
            else:
                prompt = torch.tensor([encode(self.later)], dtype=ids.dtype, device=ids.device)
                opening = torch.cat([prompt, ids[:, max(0, start - self.overlap) : start]], dim=1)
            within = (position < self.sinks) | ((position >= start) & (position < start + part.shape[1]))
            passes.append(Reread(torch.cat([opening, part], dim=1), within))
        return passes
