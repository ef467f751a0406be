"""How an evicting run works in the engine's decoding batch: in preallocated buffers, in place.

`EvictRun` (`kvsieve.compress.stages`) takes these methods: once the batch has put a row's cache into `DecodeBuffer`
layers (`in_place`), a step writes its entries where the buffers end and an eviction moves at most the evicted
entries per KV head (`EntryTables`), in every evicted layer at once. A row at its budget that evicts one entry per KV
head every step is *steady*: its eviction is one operator for all layers (`steady_step`,
`kvsieve.kernels.eviction.steady_eviction`), which the engine's static and CUDA-captured steps run too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import Cache

from kvsieve.kv.cache import EntryTables, moved

if TYPE_CHECKING:
    from kvsieve.kv.reencoding import Reencoding


class InPlaceEviction:
    """The in-buffer half of `EvictRun`, whose fields it reads: `config`, `scores`, `budget`, `steps`, `layers`,
    `reencoding`, `buffers` (the row's `EntryTables`, set by `in_place`), its `observed` (a layer's scores, by the
    policy) and its `_reencode` (StreamingLLM's rotation)."""

    config: Any  # the run's `Evict` (`kvsieve.compress.stages`, which imports this module)
    scores: dict[int, torch.Tensor]
    budget: int
    steps: int
    layers: list[int]
    reencoding: Reencoding | None
    buffers: EntryTables | None

    def in_place(self, cache: Cache, tables: tuple[torch.Tensor, torch.Tensor]) -> None:
        """`cache`'s layers are now `DecodeBuffer`s holding its entries in time order (the engine's decoding batch
        put them there): give the entries their stamps (0 .. n - 1) in a table as wide as the buffers, so that
        evictions compact the buffers in place. `tables` are the (layers, 1, kv_heads, capacity, d) key and value
        tables whose slices the evicted layers' buffers are (`self.layers`, in that order): an eviction moves every
        layer's entries at once. A model whose layers are all windowed evicts nothing.
        """
        if not self.layers:
            return
        first = cache.layers[self.layers[0]]
        self.buffers = EntryTables(tables, first.keys.shape[1], first.keys.shape[2], first.capacity)

    def retable(self, tables: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The batch moved the row's entries into new `tables` (as `in_place`'s), or None: the row left it."""
        if self.buffers is not None:
            self.buffers.tables = tables

    def steady(self, cache: Cache) -> bool:
        """Whether the row can take static steps (`kvsieve.engine.static_step`): it evicts in buffers, one entry per
        KV head every step, without re-encoding, and `cache` is at the budget in every layer it evicts from (a hybrid
        model's global layers)."""
        return (
            self.config.interval == 1
            and not self.config.reencodes
            and self.buffers is not None
            and all(cache.layers[j].length == self.budget for j in self.layers)
        )

    def carried_scores(self) -> list[torch.Tensor]:
        """The running scores, per evicted layer in order, moved into tensors of their own: a static step's observers
        read them and its eviction (`steady_step`) writes the survivors back into them every step."""
        self.scores = {j: scores.clone() for j, scores in self.scores.items()}
        return [self.scores[j] for j in sorted(self.scores)]

    def steady_step(self, keys: torch.Tensor, values: torch.Tensor, row: int, carried: list[torch.Tensor]) -> None:
        """A static step's eviction of this steady row (`engine.static_step`): every layer's new entry sits at
        column `budget` of the batch tables `keys`/`values` (layers, rows, kv_heads, capacity, d), in row `row`, and
        the step's observers left its running scores in `scores` (per layer (kv_heads, budget + 1)). One entry per
        KV head goes, in place (`kvsieve.kernels.eviction.steady_eviction`: a CPU's kernel or PyTorch's operators),
        and the surviving scores go into `carried` (per layer (kv_heads, budget), the tensors the step read them
        from), where `scores` then points."""
        self.steps += 1
        self._evict_newest(keys, values, row, carried)

    def _one_over(self, cache: Cache) -> bool:
        """Whether this step's eviction is a steady one (`steady_step`): the cache in buffers, one entry per KV head
        over the budget in every layer (the step's own, without stamp yet), to be evicted now, no re-encoding, and
        every layer's running scores taken over the new entry too."""
        if self.buffers is None or self.reencoding is not None or self.steps % self.config.interval != 0:
            return False
        if self.buffers.stamps.shape[2] != self.budget:
            return False
        if any(cache.layers[j].length != self.budget + 1 for j in self.layers):
            return False
        return self.config.policy.position_only or (
            len(self.scores) == len(self.layers)
            and all(scores.shape[-1] == self.budget + 1 for scores in self.scores.values())
        )

    def _evict_newest(
        self, keys: torch.Tensor, values: torch.Tensor, row: int, carried: list[torch.Tensor] | None
    ) -> None:
        """`steady_step`'s eviction (the step already counted); `carried` None: new tensors."""
        scores = [] if self.config.policy.position_only else [self.scores[j] for j in self.layers]
        scores = [s if s.stride(-1) == 1 else s.contiguous() for s in scores]  # TOVA's rows of heads: stride 0, kept
        if carried is None:
            carried = [s.new_empty(s.shape[0], self.budget) for s in scores]
        sinks, recent = self.config.policy.protected(self.budget)
        self.buffers.evict_newest(keys, values, row, scores, carried, self.budget, sinks, recent)
        if scores:
            self.scores = dict(zip(self.layers, carried, strict=True))

    def _evict_in_buffers(self, cache: Cache) -> None:
        """Evict down to the budget in every layer's buffer at once (`EntryTables.evict_lowest`): all layers of a
        buffered run hold the same number of entries, so their scores are stacked and the victims chosen in one pass
        over (layers x KV heads) rows; the running scores and positions move as the entries did."""
        layers, policy = self.layers, self.config.policy
        if cache.layers[layers[0]].keys.shape[2] <= self.budget:
            return
        scores = torch.stack([self.observed(j, cache.layers[j].keys) for j in layers])
        sources, targets = self.buffers.evict_lowest(scores, self.budget, *policy.protected(self.budget))
        for layer in layers:
            cache.layers[layer].truncate(self.budget)
        if not policy.position_only:
            self.scores = dict(zip(layers, moved(scores, sources, targets, self.budget), strict=True))
        if self.reencoding is not None:
            self.reencoding.move(layers, sources, targets, self.budget)
            if self.reencoding.rotating:
                for layer in layers:
                    self._reencode(cache, layer)
