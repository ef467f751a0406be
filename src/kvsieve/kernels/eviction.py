"""A steady evicting row's eviction after a decoding step (`steady_eviction`): kvsieve's CPU kernel (`eviction.cpp`)
where it serves the tensors, PyTorch's operators (which a GPU's captured step records) everywhere else; the one place
that chooses between them. `kvsieve.compress.stages.EvictRun.steady_step` calls it; the scores and ages it reads
are the eviction's (`evictable_scores`, `lowest_oldest`: also what `EvictRun` evicts by outside a steady step).
"""

from __future__ import annotations

import torch

from kvsieve.kernels import native


def evictable_scores(
    scores: torch.Tensor, stamps: torch.Tensor, clock: torch.Tensor, sinks: int, recent: int
) -> torch.Tensor:
    """`scores` (..., n) in float32, +inf where an entry is protected: among the first `sinks` entries ever
    cached or the last `recent` (by their `stamps`, the stamp the next entry gets being `clock`)."""
    evictable = scores.float()
    if sinks or recent:
        evictable = evictable.masked_fill((stamps < sinks) | (stamps >= clock - recent), float("inf"))
    return evictable


def lowest_oldest(evictable: torch.Tensor, age: torch.Tensor, clock: torch.Tensor) -> torch.Tensor:
    """Per row of (rows, n) `evictable` scores, the column of the lowest score, the oldest (smallest `age`, every
    age below `clock`) among equal ones: (rows, 1). One entry per KV head dropped: no ranking needed."""
    lowest = evictable == evictable.amin(1, keepdim=True)
    return torch.where(lowest, age, clock).argmin(1, keepdim=True)


def steady_eviction(
    keys: torch.Tensor,
    values: torch.Tensor,
    row: int,
    scores: list[torch.Tensor],
    carried: list[torch.Tensor],
    stamp_table: torch.Tensor,
    clock: torch.Tensor,
    budget: int,
    sinks: int,
    recent: int,
) -> torch.Tensor:
    """One step's eviction of a row at its `budget` (`EvictRun.steady_step`), in tensors and in place: the new
    entry of every layer (at column `budget` of the tables' row `row`) gets the stamp `clock`, each KV head's
    lowest-scored unprotected entry (the oldest among equals; `scores` empty: the oldest) is the victim, and the
    new entry moves into its slot in the key and value tables, the stamp table and the scores, whose first `budget`
    columns go into `carried`. The same choice and moves as `EvictRun.after_step` on the row's buffers (exactly
    `keep_indices`' complement), on every layer at once: on CUDA it is captured in the step's graph; a CPU with float32
    scores runs the same in one pass of `torch.ops.kvsieve.evict_lowest` where the library is built. Returns the
    victims (layers, kv_heads)."""
    if keys.device.type == "cpu" and all(s.dtype == torch.float32 for s in scores) and native.load():
        return torch.ops.kvsieve.evict_lowest(keys, values, row, scores, carried, stamp_table, clock, budget, sinks,
                                              recent)  # fmt: skip
    layers, heads = stamp_table.shape[:2]
    # the entries' stamps, the new one's (`clock`) last; the table itself is written only where the new entry goes
    ages = torch.cat([stamp_table[:, :, :budget], clock.view(1, 1, 1).expand(layers, heads, 1)], dim=2)
    clock.add_(1)
    stacked = torch.stack(scores) if scores else torch.zeros(ages.shape, device=ages.device)
    evictable = evictable_scores(stacked, ages, clock, sinks, recent).view(layers * heads, budget + 1)
    victims = lowest_oldest(evictable, ages.view(layers * heads, budget + 1), clock).view(layers, heads)
    layer_ids = torch.arange(layers, device=victims.device).view(-1, 1)
    head_ids = torch.arange(heads, device=victims.device).view(1, -1)
    for table in (keys, values):
        table[layer_ids, row, head_ids, victims] = table[layer_ids, row, head_ids, budget]
    stamp_table[layer_ids, head_ids, victims] = ages[:, :, budget]
    if scores:
        stacked[layer_ids, head_ids, victims] = stacked[layer_ids, head_ids, budget]  # (indexing copies)
        for j, tensor in enumerate(carried):
            tensor.copy_(stacked[j, :, :budget])
    return victims
