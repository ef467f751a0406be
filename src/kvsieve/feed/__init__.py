"""The `feed` stage: how the (selected) prompt is prefilled into a KV cache.

A feed returns the cache, the last position's logits and the logical position of the next
token. `full.py` runs one pass; chunked feeds with a compressed memory live beside it. A
`PromptState` is a prompt prefix as the one-pass feed left it, which a later request extends
(kvsieve.engine.prefix_cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import Cache, DynamicCache, PreTrainedModel

from kvsieve.compress.stages import PrefixSums
from kvsieve.kv.cache import is_windowed, kv_entries, wrap_cache
from kvsieve.kv.heads import carry_segments
from kvsieve.spec import warn_renamed


@dataclass
class FeedOutput:
    """KV cache after prefill, the logits that give the first new token, and the next position.

    `kept_positions[j]` (kv_heads, n) are the positions, among the keys layer j attended over in
    the feed's last forward pass, of the cache entries; None when the cache is exactly those keys
    (one-pass prefill). Later stages that observed that pass align their scores with it.
    """

    cache: Cache
    last_logits: torch.Tensor
    next_position: int
    details: dict[str, Any] = field(default_factory=dict)
    kept_positions: list[torch.Tensor] | None = None
    token_indices: list[torch.Tensor] | None = None  # chunked feeds: prompt index of every final cache entry
    history: list[dict[str, Any]] = field(default_factory=list)  # chunked feeds: one record per step
    logits: torch.Tensor | None = None  # (L, vocab) of every prompt position, when asked for (one-pass feed)


class Feed(Protocol):
    name: str
    # Whether the prompt goes through the model in one forward pass over every token (the full feed). Such a feed
    # places every prompt position (they must fit the model's trained context), can continue a stored prefix,
    # gives every position's logits, and leaves a cache of exactly the prompt's entries; a chunked feed does none.
    one_pass: bool

    def prefill(self, model: PreTrainedModel, ids: torch.Tensor, *, question: int = 0) -> FeedOutput:
        """Prefill (1, L) `ids`; the last `question` of them are the prompt's question (0: none)."""
        ...


@dataclass
class PromptState:
    """A prompt prefix as the feed left it, ready to be extended by more tokens.

    Exact (the default) it holds an entry per token at positions 0 .. length-1; a compressed
    state (the server's --reuse-budget) holds fewer entries, kept by a policy that saw only the
    prefix's own queries, and the next token still goes at `position`.
    """

    cache: DynamicCache
    position: int  # logical position of the next token
    length: int  # prompt tokens that produced this state
    sums: PrefixSums | None = None  # accumulated attention of its queries, for accumulating policies

    @property
    def kv_entries(self) -> int:
        """Entries per KV head of the budgeted layers (`compress.cache.kv_entries`), the unit of every budget."""
        return kv_entries(self.cache)

    @property
    def compressed(self) -> bool:
        """Whether entries were dropped (a budgeted layer holds fewer entries than tokens)."""
        return kv_entries(self.cache, least=True) < self.length

    @property
    def cuttable(self) -> bool:
        """Whether `clone` can cut it to a shorter prefix: a plain state (no sums, nothing dropped, positions
        0..n-1) whose windowed layers, if any, still hold every token's entry (a sliding layer past its window
        has dropped the entries a shorter prefix's window needs)."""
        return (
            self.sums is None
            and self.position == self.length
            and not self.compressed
            and all(layer.keys.shape[2] == self.length for layer in self._filled() if is_windowed(layer))
        )

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in self._filled() for t in (layer.keys, layer.values)]
        tensors += [t for layers in (self.sums.sums.values() if self.sums else ()) for t in layers.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _filled(self) -> list:
        """The cache layers that hold entries (a select stage's state fills those up to its filter layer)."""
        return [layer for layer in self.cache.layers if layer.is_initialized]

    def clone(self, model: PreTrainedModel, length: int | None = None) -> PromptState:
        """A deep copy, or of the state of the first `length` tokens only (the first entries of every layer:
        a causal model's entry i depends on tokens 0..i only); tensors cloned, so neither copy can change
        the other. A cut state has no sums (they include the queries of the tokens cut off)."""
        whole = length is None or length == self.length
        if not whole and not self.cuttable:
            raise ValueError(
                "Only a plain prefix state (no sums or dropped entries, positions 0..n-1, sliding layers within "
                "their window) can be cut."
            )
        length = self.length if whole else length
        entries = None if whole else length  # a whole state: every layer's entries, windowed ones included
        layers = [
            (layer.keys[:, :, :entries].clone(), layer.values[:, :, :entries].clone()) for layer in self._filled()
        ]
        sums = None
        if self.sums is not None:
            copied = {alpha: {j: t.clone() for j, t in by_layer.items()} for alpha, by_layer in self.sums.sums.items()}
            sums = PrefixSums(self.sums.queries, copied)
        cache = carry_segments(self.cache, wrap_cache(model, layers, length), share=False)
        return PromptState(cache, self.position if whole else length, length, sums)


def __getattr__(name: str) -> object:
    """`Prefilled`, `FeedOutput`'s old name, for one release (CHANGELOG.md)."""
    if name == "Prefilled":
        warn_renamed("kvsieve.feed", "Prefilled", "FeedOutput")
        return FeedOutput
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
