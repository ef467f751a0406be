"""Physically shrinking a transformers KV cache, per layer and KV head."""

from __future__ import annotations

import torch
from transformers import Cache

from kvsieve.errors import KvsieveError


def resolve_budget(value: int | float, total: int) -> tuple[int, str | None]:
    """A budget as a count (>= 1) or a fraction of `total` (0, 1] -> (count, note).

    A budget at or above `total` keeps everything; the note says so instead of failing.
    """
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise KvsieveError(f"Budget {value} is not a fraction in (0, 1]; give a fraction or a token count.")
        count = max(1, round(value * total))
    else:
        if value < 1:
            raise KvsieveError(f"Budget must be at least 1 token, got {value}.")
        count = value
    if count >= total:
        return count, f"budget {count} >= {total} cached tokens: everything kept"
    return count, None


def prune_layer(cache: Cache, layer: int, indices: torch.Tensor) -> None:
    """Keep, per KV head, the cache entries at `indices` (kv_heads, budget) of layer `layer`.

    The old tensors are replaced, so the memory is really freed (no masks).
    """
    entry = cache.layers[layer]
    _, kv_heads, _, dim = entry.keys.shape
    if indices.shape[0] != kv_heads:
        raise KvsieveError(f"Got indices for {indices.shape[0]} KV heads, the cache has {kv_heads}.")
    gather = indices[None, :, :, None].expand(1, kv_heads, indices.shape[1], dim)
    entry.keys = entry.keys.gather(2, gather)
    entry.values = entry.values.gather(2, gather)


def compose_kept(first: list[torch.Tensor] | None, then: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the positions kept by two prunings in a row, as positions of the first one's input.

    `first[j]` (kv_heads, n1) indexes the original entries, `then[j]` (kv_heads, n2) indexes
    `first`'s result; None for `first` means nothing was pruned before.
    """
    if first is None:
        return then
    return [a.gather(1, b) for a, b in zip(first, then, strict=True)]
