"""Where the decoding batch keeps its rows' caches: one key and one value table for the global layers, rings for a
hybrid model's sliding ones.

Row b's entries of global layer j are columns 0 .. n - 1 of `keys[slot[j], b]` (and `values`), the tables padded on
the right up to the longest row; a sliding layer's are a ring as wide as its window (`WindowBuffer`: a step's entry
replaces the oldest once the window is full), so the global tables, their padding and their evictions hold the
global layers alone. Each row's own cache object keeps its layers as buffers over its slices (`DecodeBuffer`,
`WindowBuffer`), so a step writes every row's new entry in place and a row's eviction moves its entries there.
`DecodeBatch` (`engine.batch`) decides when the tables are rebuilt; this module only builds and addresses them.
Where a row's KV heads hold their own counts (per-head budgets, `kv.heads.SegmentedLayer`), the global layers' tables
are segmented instead (`segmented`): per layer one flat key and one value buffer, each row's heads a segment of it
with room after their entries, every row's layers `SegmentedLayer`s over their segments, and a step writes each
row's new entries after each of its heads' own; the attention reads the segments (`SegmentedBatchLayer`). Rows of one
count per head are held so too while such a row runs; evicting rows, which move entries in the padded tables, join
only a batch that is not segmented (the scheduler holds them).
A static step (`engine.static_step`) writes through `ScatterLayer`s instead, at columns held in tensors.
"""

from __future__ import annotations

from itertools import accumulate
from typing import cast

import torch
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from kvsieve.kv.cache import DecodeBuffer, WindowBuffer
from kvsieve.kv.heads import SegmentedLayer, is_segmented
from kvsieve.models import architecture


class BatchLayer(DynamicLayer):
    """The transformers cache layer through which the model writes layer j's new entries of every row (in place)."""

    def __init__(self, tables: BatchTables, layer: int):
        super().__init__()
        self.tables, self.layer = tables, layer
        self.lazy_initialization(*tables.of_layer(layer))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys, self.values = self.tables.append(self.layer, key_states, value_states)
        return self.keys, self.values


class SegmentedBatchLayer(DynamicLayer):
    """A global layer of a segmented batch: writes each row's new entry after each of its heads' own, in place, and
    tells the attention where every row's heads lie (`segments`, read after the step's write)."""

    def __init__(self, tables: BatchTables, layer: int):
        super().__init__()
        self.tables, self.layer = tables, layer
        self.flat = tables.flat[tables.slot[layer]]  # the layer's (capacity, d) keys and values
        self.lazy_initialization(self.flat[0], self.flat[1])

    def _rows(self) -> list[SegmentedLayer]:
        return [cast(SegmentedLayer, cache.layers[self.layer]) for cache in self.tables.caches]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows = self._rows()
        index = torch.stack([row.starts + row.lengths for row in rows])  # (rows, kv_heads): each head's next entry
        keys, values = self.flat
        keys[index], values[index] = key_states[:, :, 0], value_states[:, :, 0]
        for row in rows:
            row.advance()
        return keys[None, None], values[None, None]

    @property
    def longest(self) -> int:
        return max(row.longest for row in self._rows())

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows()
        return torch.stack([row.starts for row in rows]), torch.stack([row.lengths for row in rows])


class BatchTables:
    """The rows' caches (`caches`, one per row, in the batch's order) in shared tables; `cache` is what a batched
    forward pass writes through."""

    def __init__(self, model: PreTrainedModel):
        arch = architecture(model)
        self.config = model.config
        self.windows = arch.windows  # per layer: its sliding window, or None for a global layer
        sliding = [j for j, window in enumerate(arch.windows) if window is not None]
        self.order = [*arch.global_layers, *sliding]
        self.slot = {j: i for i, j in enumerate(arch.global_layers)} | {j: i for i, j in enumerate(sliding)}
        self.caches: list[Cache] = []  # each row's own cache object, its layers buffers over the tables
        self.keys: torch.Tensor | None = None  # (global layers, rows, kv_heads, capacity, d) once a row joins
        self.values: torch.Tensor | None = None
        self.rings: tuple[torch.Tensor, torch.Tensor] | None = None  # (sliding layers, rows, kv_heads, window, d)
        self.cache: DynamicCache | None = None
        self.segmented = False  # the global layers in per-layer flat buffers of segments (`flat`), not in `keys`
        self.flat: list[tuple[torch.Tensor, torch.Tensor]] = []  # per global layer (slot), its keys and values

    @property
    def nbytes(self) -> int:
        """Bytes of the shared key and value tables (global layers; segmented, their flat buffers) and the sliding
        layers' rings, as allocated: their capacity, not only the entries in use."""
        flat = [t for pair in self.flat for t in pair]
        tensors = [t for t in (self.keys, self.values, *(self.rings or ()), *flat) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def has_room(self) -> bool:
        """Whether a segmented batch's every row and head can take one more entry (a padded batch: `DecodeBatch`
        checks its capacity)."""
        return all(
            cast(SegmentedLayer, cache.layers[j]).has_room()
            for cache in self.caches
            for j, window in enumerate(self.windows)
            if window is None
        )

    def of_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s (rows, kv_heads, capacity, d) key and value tables: the global tables' or the rings'."""
        if self.windows[layer] is None:
            keys, values = self.keys, self.values
        else:
            # a sliding layer: the tables hold rings wherever the model has sliding layers
            keys, values = cast(tuple[torch.Tensor, torch.Tensor], self.rings)
        return keys[self.slot[layer]], values[self.slot[layer]]

    def of_row(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `index`'s (global layers, 1, kv_heads, capacity, d) slices of the tables: an eviction moves the entries
        of every global layer of the row at once (`move_entries`)."""
        return self.keys[:, index : index + 1], self.values[:, index : index + 1]

    def rebuild(self, caches: list[Cache], spare: int) -> None:
        """New tables holding `caches` (rows in that order) with room for `spare` more steps; each cache's layers
        become buffers over its slices, their entries copied in."""
        self.caches, self.flat, self.keys, self.values = caches, [], None, None
        if not caches:
            self.rings, self.cache, self.segmented = None, None, False
            return
        # Segmented while some row's heads hold different counts; rows whose heads hold one count go back to the
        # padded tables (where evicting rows can join again).
        self.segmented = any(is_segmented(layer) and not layer.equal for cache in caches for layer in cache.layers)
        globals_ = [j for j in self.order if self.windows[j] is None]
        sliding = [j for j in self.order if self.windows[j] is not None]
        first = caches[0].layers[(globals_ or sliding)[0]]
        heads = first.kv_heads if is_segmented(first) else first.keys.shape[1]
        key_dim, value_dim = first.keys.shape[-1], first.values.shape[-1]
        # Zeros, not empty memory: padding is masked out of the attention weights, but a 0 weight times a NaN
        # left in uninitialised memory would still be NaN.
        if self.segmented:
            self.flat = [self._segments(j, caches, spare) for j in globals_]
        else:
            capacity = max((_count(cache.layers[j]) for cache in caches for j in globals_), default=0) + spare
            self.keys = first.keys.new_zeros(len(globals_), len(caches), heads, capacity, key_dim)
            self.values = first.values.new_zeros(len(globals_), len(caches), heads, capacity, value_dim)
        ring = max((w for w in self.windows if w is not None), default=0)
        ring_keys = first.keys.new_zeros(len(sliding), len(caches), heads, ring, key_dim)
        self.rings = (ring_keys, first.values.new_zeros(len(sliding), len(caches), heads, ring, value_dim))
        for b, cache in enumerate(caches):  # each buffer copies its entries into its slices of the new tables
            cache.layers = [
                layer if self.segmented and self.windows[j] is None  # `_segments` made it
                else self._buffer(j, layer, tuple(table[b : b + 1] for table in self.of_layer(j)))
                for j, layer in enumerate(cache.layers)
            ]  # fmt: skip
        self.cache = DynamicCache(config=self.config)
        self.cache.layers = [
            SegmentedBatchLayer(self, j) if self.segmented and window is None else BatchLayer(self, j)
            for j, window in enumerate(self.windows)
        ]

    def _segments(self, j: int, caches: list[Cache], spare: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global layer `j` of every row in one flat key and one value buffer, each row's heads a segment with
        `spare` free entries after its own; each row's layer becomes a `SegmentedLayer` over its segments."""
        held = [_heads(cache.layers[j]) for cache in caches]  # per row: its heads' entries, head after head
        counts = [count for _, _, row in held for count in row]
        first = [start + i * spare for i, start in enumerate(accumulate(counts, initial=0))][:-1]
        keys = held[0][0].new_zeros(sum(counts) + spare * len(counts), held[0][0].shape[-1])
        values = held[0][1].new_zeros(keys.shape[0], held[0][1].shape[-1])
        index = torch.cat([torch.arange(a, a + n, device=keys.device) for a, n in zip(first, counts, strict=True)])
        keys[index] = torch.cat([k for k, _, _ in held])
        values[index] = torch.cat([v for _, v, _ in held])
        heads = len(held[0][2])
        for b, cache in enumerate(caches):
            span = slice(b * heads, (b + 1) * heads)
            cache.layers[j] = SegmentedLayer.over(keys, values, first[span], counts[span], spare)
        return keys, values

    def _buffer(self, j: int, layer: DynamicLayer, storage: tuple[torch.Tensor, torch.Tensor]) -> DecodeBuffer:
        """Layer `j`'s entries copied into `storage` (its slices of the tables): a `WindowBuffer` for a sliding
        layer (a ring keeps its order), a `DecodeBuffer` for a global one (a segmented layer's heads holding one
        count each)."""
        window, capacity = self.windows[j], storage[0].shape[2]
        if window is None:
            keys, values = layer.padded() if is_segmented(layer) else (layer.keys, layer.values)
            return DecodeBuffer(keys, values, capacity, storage=storage)
        buffer = WindowBuffer(layer.keys, layer.values, window, capacity, storage)
        buffer.oldest = getattr(layer, "oldest", 0)
        return buffer

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's new (rows, kv_heads, 1, d) entry of `layer` at its next column; the live columns of
        every row (the longest row's length wide)."""
        if len(self.caches) == 1:  # one row: its own buffer writes in place
            return self.caches[0].layers[layer].update(keys, values)
        buffers = [cache.layers[layer] for cache in self.caches]
        table_keys, table_values = self.of_layer(layer)
        ends = [buffer.next_column() for buffer in buffers]
        if len(set(ends)) == 1:  # no padding (rows of one length): a plain slice
            table_keys[:, :, ends[0]] = keys[:, :, 0]
            table_values[:, :, ends[0]] = values[:, :, 0]
        else:
            rows = torch.arange(len(ends), device=keys.device)
            columns = torch.tensor(ends, device=keys.device)
            table_keys[rows, :, columns] = keys[:, :, 0]
            table_values[rows, :, columns] = values[:, :, 0]
        for buffer in buffers:
            buffer.advance()
        width = max(buffer.length for buffer in buffers)
        return table_keys[:, :, :width], table_values[:, :, :width]

    def key_lengths(self, device: torch.device) -> list[torch.Tensor] | None:
        """Per layer, each row's key count after this step's entry, or None where no row is padded."""
        per_layer = [[_after_step(cache.layers[j]) for cache in self.caches] for j in range(len(self.windows))]
        if all(len(set(lengths)) == 1 for lengths in per_layer):
            return None
        return [torch.tensor(lengths, device=device) for lengths in per_layer]


def _after_step(layer: DecodeBuffer | SegmentedLayer) -> int:
    """The keys a decoding step's query sees in `layer` once its entry is in: one more, or a full ring's window (a
    segmented layer's attention reads its segments instead: its longest head's)."""
    if isinstance(layer, SegmentedLayer):
        return layer.longest + 1
    return min(layer.length + 1, layer.window) if isinstance(layer, WindowBuffer) else layer.length + 1


def _count(layer: DynamicLayer) -> int:
    """Entries per KV head of a layer whose heads hold one count each."""
    return layer.longest if is_segmented(layer) else layer.keys.shape[2]


def _heads(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A global layer's live entries head after head ((entries, d) keys and values) and each head's count."""
    if is_segmented(layer):
        return *layer.live(), list(layer.counts)
    _, heads, n, _ = layer.keys.shape
    return layer.keys[0].reshape(heads * n, -1), layer.values[0].reshape(heads * n, -1), [n] * heads


class ScatterLayer(DynamicLayer):
    """Layer j of the static step's cache: writes each row's new entry at its column `columns[j, row]` of the
    layer's tables (the global tables, or a hybrid model's rings for a sliding layer) and hands the attention the
    tables' whole capacity.

    The entries go into the whole tables with one `index_put_` (table slot, row and column indices), not into the
    layer's view of them: a compiled graph writes into its inputs in place, but a view of another input is
    copied out and back, the layer's whole table every step (SmolLM2's compiled step with full attention:
    70.2 -> 27.4 ms at 8K, 28.7 -> 24.8 ms at 2K; docs/STUDIES.md)."""

    def __init__(
        self, layer: int, tables: tuple[torch.Tensor, torch.Tensor], slot: int, indices: tuple[torch.Tensor, ...]
    ):
        """Layer `layer`, at slot `slot` of the tables `tables` (keys, values); `indices`: the step's (slots, row_ids,
        columns). The layer holds the step's tensors, not the step: no reference cycle, so a dropped step (its CUDA
        graph, its memory pool, the old tables) is freed at once rather than at the next garbage collection."""
        super().__init__()
        self.layer, self.slot, self.tables, self.indices = layer, slot, tables, indices
        keys, values = tables
        self.lazy_initialization(keys[slot], values[slot])
        self.keys, self.values = keys[slot], values[slot]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        (keys, values), (slots, row_ids, columns) = self.tables, self.indices
        where = (slots[self.layer], row_ids, slice(None), columns[self.layer])  # (rows,) each
        keys[where] = key_states[:, :, 0]
        values[where] = value_states[:, :, 0]
        return keys[self.slot], values[self.slot]  # views made in the graph (`self.keys` alias an input)
