"""Physically shrinking a transformers KV cache, per layer and KV head, the buffers eviction decodes in,
and moving cached post-RoPE keys to other positions (chunked feeds, StreamingLLM's re-encoding)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from kvsieve.errors import KvsieveError
from kvsieve.kernels.eviction import evictable_scores, lowest_oldest, steady_eviction
from kvsieve.kv.heads import is_segmented

# rotary(x, position_ids) -> (cos, sin), with an `attention_scaling` attribute: a model's module or `models.Rotary`
RotaryEmbedding = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def filled(layer: CacheLayerMixin) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled layer's keys and values: transformers annotates them `Tensor | None` (None until a layer's first
    update), and kvsieve reads them from layers it filled."""
    return cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)


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


def is_windowed(layer: object) -> bool:
    """Whether a cache layer belongs to a sliding-window attention layer (transformers' DynamicSlidingWindowLayer,
    which `DynamicCache(config=...)` makes for them, or kvsieve's `WindowBuffer`): bounded by its window, it holds
    its entries in time order and is never compressed, evicted or re-encoded (a hybrid model's rule, docs/MODELS.md)."""
    return bool(getattr(layer, "is_sliding", False))


def budgeted_layers(cache: Cache) -> list[int]:
    """The indices of `cache`'s layers that budgets apply to: every layer but the windowed ones."""
    return [j for j, layer in enumerate(cache.layers) if not is_windowed(layer)]


def kv_entries(cache: Cache, least: bool = False) -> int:
    """Entries per KV head in the longest budgeted layer (in the longest layer where every layer is windowed; 0
    for an empty cache): what a cache holds of the prompt. `cache.get_seq_length()` reads layer 0, which on a
    hybrid model may be windowed and count every token it has seen instead. `least`: in the shortest such layer
    instead (budgets chosen across layers leave the layers different counts: entries were dropped where any layer
    holds fewer than the prompt's tokens)."""
    layers = [layer for layer in cache.layers if layer.is_initialized]
    budgeted = [layer for layer in layers if not is_windowed(layer)] or layers
    return (min if least else max)((_entries_per_head(layer, least) for layer in budgeted), default=0)


def _entries_per_head(layer: CacheLayerMixin, least: bool = False) -> int:
    """A layer's entries per KV head; per-head budgets (`SegmentedLayer`): their mean, rounded up (down with
    `least`: below the prompt's length as soon as any head dropped an entry)."""
    if is_segmented(layer):
        return layer.entries // layer.kv_heads if least else -(-layer.entries // layer.kv_heads)
    return layer.keys.shape[2]


def cache_nbytes(cache: Cache) -> int:
    """Bytes a cache's layers hold in keys and values (a segmented layer's buffers, room included)."""
    total = 0
    for layer in cache.layers:
        if is_segmented(layer):
            total += layer.nbytes
        elif layer.is_initialized:
            keys, values = filled(layer)
            total += keys.numel() * keys.element_size() + values.numel() * values.element_size()
    return total


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


def rotation(delta: torch.Tensor, rotary_emb: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (1, kv_heads, k, rot) in float32 that move keys by `delta` (kv_heads, k) positions.

    They come from the layer's rotary embedding (`models.Architecture.rotary`; a hybrid model's local and global
    layers have different ones) called with the deltas as position ids, divided by its `attention_scaling`
    (YaRN-style scaling is already in the keys). The sin's first half is negated: the Llama layout's
    rotate_half(x) * sin, (-x2, x1) * (s1, s2), is then roll(x, rot / 2) * (-s1, s2), so a move is two products and
    a sum (`rerotate_keys`), the same values to the bit (a negation is exact).
    """
    probe = torch.empty(0, dtype=torch.float32, device=delta.device)
    cos, sin = rotary_emb(probe, delta)  # (kv_heads, k, rot)
    scale = float(getattr(rotary_emb, "attention_scaling", 1.0) or 1.0)
    half = sin.shape[-1] // 2
    signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return cos[None].float() / scale, signed[None].float() / scale


def rotation_table(low: int, high: int, rotary_emb: RotaryEmbedding, device: torch.device) -> torch.Tensor:
    """(high - low, 2 rot) float32: `rotation`'s cos and signed sin of every delta low .. high - 1, side by side.

    Moves by many deltas known to lie in that range (a chunked feed's memories, every layer at once) read their angles
    with one index each (`table_turn`) instead of computing one angle per key, so the angles take memory in the range,
    not in layers x heads x keys. Each angle is computed alone (an outer product of delta and frequency, then cos and
    sin), so a table's are the same to the bit as `rotation`'s.
    """
    cos, sin = rotation(torch.arange(low, high, device=device)[None], rotary_emb)  # (1, 1, n, rot)
    return torch.cat([cos, sin], dim=-1)[0, 0]


def table_turn(table: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rerotate_keys`'s turn (cos, sin: (1, kv_heads, k, rot)) for deltas given as `offsets` (kv_heads, k) into a
    `rotation_table` (delta - low)."""
    rot = table.shape[-1] // 2
    both = table[offsets][None]
    return both[..., :rot], both[..., rot:]


def rerotate_keys(
    keys: torch.Tensor,
    delta: torch.Tensor,
    rotary_emb: RotaryEmbedding,
    turn: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Move post-RoPE keys (1, kv_heads, k, d) by `delta` (kv_heads, k) positions: R(p + delta) = R(delta) R(p).

    `turn` is `rotation(delta, rotary_emb)` when the caller already has it (several layers moved
    by the same deltas). Computed in at least float32. Partial rotary embeddings (cos narrower
    than d) rotate only the leading dimensions.
    """
    cos, sin = turn if turn is not None else rotation(delta, rotary_emb)
    compute = torch.promote_types(keys.dtype, torch.float32)  # at least float32; float64 stays float64
    cos, sin = cos.to(compute), sin.to(compute)
    rot = cos.shape[-1]
    k = keys.to(compute)
    part = k[..., :rot]
    turned = part * cos + part.roll(rot // 2, dims=-1) * sin
    if rot < k.shape[-1]:  # a partial rotary embedding: the other dimensions carry no position
        turned = torch.cat([turned, k[..., rot:]], dim=-1)
    return turned.to(keys.dtype)


def compose_kept(first: list[torch.Tensor] | None, then: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the positions kept by two prunings in a row, as positions of the first one's input.

    `first[j]` (kv_heads, n1) indexes the original entries, `then[j]` (kv_heads, n2) indexes
    `first`'s result; None for `first` means nothing was pruned before.
    """
    if first is None:
        return then
    return [a.gather(1, b) for a, b in zip(first, then, strict=True)]


def newest_first(scores: torch.Tensor, age: torch.Tensor, count: int) -> torch.Tensor:
    """Integer ranks (kv_heads, n) whose top `count` are the best `count` scores, ties won by larger `age`.

    Better than the `count`-th best score: above every age (always in); tied with it: the age;
    worse: below every age. Bounds are tensors, so no value is read back to the host.
    """
    threshold = torch.topk(scores, count, dim=1).values[:, -1:]
    return torch.where(scores > threshold, age.amax() + 1, torch.where(scores == threshold, age, age.amin() - 1))


class DecodeBuffer(DynamicLayer):
    """A transformers cache layer in preallocated buffers, for decoding in place (with or without eviction).

    The live entries are columns 0 .. length - 1 of (batch, kv_heads, capacity, d) key and value
    buffers. A decoding step writes its entries in place after them (no copy of the cache per
    step), and an eviction (`move_entries` on the tables, then `truncate`) fills the holes below the
    new length with the surviving entries above it, so at most the evicted count moves per KV head.
    The entries are then no longer in time order; attention does not care (keys carry their RoPE
    positions), and `EvictRun` tracks each entry's age itself.

    `storage` gives preallocated (key, value) buffers of the full capacity: in the engine's decoding
    batch, one row's slice of one layer of tables that hold every layer and row
    (`kvsieve.engine.batch`), so that an eviction moves the entries of all the row's layers at once.
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        capacity: int,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        super().__init__()
        self.lazy_initialization(keys, values)
        batch, kv_heads, length, dim = keys.shape
        if storage is None:
            storage = (
                keys.new_empty(batch, kv_heads, max(capacity, length), dim),
                values.new_empty(batch, kv_heads, max(capacity, length), values.shape[-1]),
            )
        self._keys, self._values = storage
        self._keys[:, :, :length], self._values[:, :, :length] = keys, values
        self.truncate(length)

    @property
    def capacity(self) -> int:
        return self._keys.shape[2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[2]
        if end > self.capacity:  # the decoding batch makes room before a step; a buffer never grows alone
            raise KvsieveError(f"A decode buffer of {self.capacity} entries cannot take {end}.")
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.truncate(end)
        return filled(self)

    def truncate(self, length: int) -> None:
        """Keep entries 0 .. length - 1 live."""
        self.length = length
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    def next_column(self) -> int:
        """The column a decoding step's new entry goes to (the engine's batch writes it there itself)."""
        return self.length

    def advance(self, steps: int = 1) -> None:
        """Make the entries that `steps` decoding steps wrote, each at the `next_column()` of its time, live."""
        self.truncate(self.length + steps)

    def detached(self) -> DecodeBuffer:
        """A buffer of its own holding a copy of the live entries in time order (a row leaving the batch)."""
        return DecodeBuffer(self.keys, self.values, self.length)


class WindowBuffer(DecodeBuffer):
    """A sliding layer's decode buffer: a ring of `window` entries.

    Until it is full a step appends; then the step's entry replaces the oldest, so the buffer always holds
    exactly what a decoding step's query sees in a sliding layer (itself and the W - 1 tokens before it). One
    query attends to all of them whatever their order (keys carry their RoPE positions), so no decoding path
    (the batch's padded step, the CPU's kernels) needs a window mask, and the layer's memory stays at W entries
    however long the answer. It starts from its entries in time order (transformers' sliding layer keeps the
    last W - 1); `in_order()` gives them back in time order.
    """

    is_sliding = True

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        window: int,
        capacity: int | None = None,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        keys, values = keys[:, :, -window:], values[:, :, -window:]
        super().__init__(keys, values, window if capacity is None else capacity, storage)
        if self.capacity < window:
            raise KvsieveError(f"A window buffer of {window} entries needs as many columns, got {self.capacity}.")
        self.window = window
        self.oldest = 0  # the column of the oldest entry once the ring is full

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.length + key_states.shape[2] <= self.window:
            return super().update(key_states, value_states)
        if key_states.shape[2] != 1:
            raise KvsieveError(
                f"A full window buffer takes one decoding step's entry at a time, got {key_states.shape[2]}."
            )
        column = self.next_column()
        self._keys[:, :, column : column + 1] = key_states
        self._values[:, :, column : column + 1] = value_states
        self.advance()
        return filled(self)

    def next_column(self) -> int:
        return self.length if self.length < self.window else self.oldest

    def advance(self, steps: int = 1) -> None:
        growth = min(steps, self.window - self.length)  # the ring fills first (its oldest entry stays at column 0)
        self.truncate(self.length + growth)
        self.oldest = (self.oldest + steps - growth) % self.window

    def in_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The live (keys, values), oldest first."""
        if self.length < self.window or self.oldest == 0:
            return filled(self)
        order = torch.arange(self.window, device=self.keys.device).roll(-self.oldest)
        return self.keys[:, :, order], self.values[:, :, order]

    def detached(self) -> WindowBuffer:
        return WindowBuffer(*self.in_order(), self.window)


class EntryTables:
    """What a row's in-place eviction works on (`EvictRun.in_place`): the key and value `tables` of every layer it
    evicts at once ((layers, 1, kv_heads, capacity, d), the row's slices of the engine's batch tables, which the
    batch hands over anew when it rebuilds them, `EvictRun.retable`), the entries' ages in a stamp table as wide
    (`stamps` is its first n columns, one per live entry), and `clock`, the stamp the next new entry gets (a 0-d
    tensor: a captured step reads and advances it). After an eviction the entries are no longer in time order in
    the buffers; their stamps still tell their age (sinks, recent entries, the oldest among equal scores)."""

    def __init__(self, tables: tuple[torch.Tensor, torch.Tensor], heads: int, length: int, capacity: int):
        self.tables = tables
        layers, device = tables[0].shape[0], tables[0].device
        self.stamp_table = torch.empty(layers, heads, capacity, dtype=torch.long, device=device)
        self.stamp_table[:, :, :length] = torch.arange(length, device=device)
        self.stamps = self.stamp_table[:, :, :length]
        self.clock = torch.tensor(length, device=device)

    def stamp(self, length: int) -> None:
        """Give the entries a step appended (the buffers now hold `length`) the next stamps, in place."""
        old = self.stamps.shape[2]
        if length == old:
            return
        self.room(length)
        table = self.stamp_table
        table[:, :, old:length] = self.clock + torch.arange(length - old, device=table.device)
        self.stamps = table[:, :, :length]
        self.clock.add_(length - old)

    def room(self, length: int) -> None:
        """A stamp table at least `length` wide: a new one, twice as long, only if the buffers outgrew it."""
        table, old = self.stamp_table, self.stamps.shape[2]
        if length > table.shape[2]:
            table = table.new_empty(*table.shape[:2], max(length, 2 * table.shape[2]))
            table[:, :, :old] = self.stamps
            self.stamp_table, self.stamps = table, table[:, :, :old]

    def evict_lowest(
        self, scores: torch.Tensor, budget: int, sinks: int, recent: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drop, in every layer's buffer at once, the n - budget lowest `scores` ((layers, kv_heads, n), the live
        entries') per KV head among the unprotected entries, the oldest among equal scores (exactly `keep_indices`'
        complement), and move the survivors into the holes below `budget` in the tables and the stamps. Returns the
        moves (sources, targets), each (layers x kv_heads, n - budget), for the caller's own per-entry tensors
        (`moved`). The caller truncates its buffers to `budget`."""
        stamps = self.stamps
        n = stamps.shape[2]
        drop, rows = n - budget, stamps.shape[0] * stamps.shape[1]
        evictable = evictable_scores(scores, stamps, self.clock, sinks, recent).view(rows, n)
        age = stamps.view(rows, n)
        if drop == 1:  # the lowest score, the oldest among equals: no ranking needed
            victims = lowest_oldest(evictable, age, self.clock)
        else:
            victims = torch.topk(newest_first(-evictable, -age, drop), drop, dim=1).indices
        sources, targets = compaction(victims, n)  # (rows, drop) each
        for table in self.tables:
            move_entries(table, sources, targets)
        self.stamps = moved(stamps, sources, targets, budget)
        return sources, targets

    def evict_newest(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        row: int,
        scores: list[torch.Tensor],
        carried: list[torch.Tensor],
        budget: int,
        sinks: int,
        recent: int,
    ) -> None:
        """A steady row's eviction (`kvsieve.kernels.eviction.steady_eviction`, its arguments): the new entry at
        column `budget` of every layer replaces each KV head's victim, in the tables and the stamps."""
        self.room(budget + 1)
        steady_eviction(keys, values, row, scores, carried, self.stamp_table, self.clock, budget, sinks, recent)
        self.stamps = self.stamp_table[:, :, :budget]


def moved(table: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor, length: int) -> torch.Tensor:
    """A (layers, kv_heads, n) table (or a view) with entry sources[r, i] of row r (layer x KV head) copied to
    targets[r, i] in place, as `move_entries` moves the buffers' entries; its first `length` columns."""
    flat = table.view(-1, table.shape[-1])
    flat.scatter_(1, targets, flat.gather(1, sources))
    return table[:, :, :length]


def move_entries(buffer: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor) -> None:
    """In a (..., capacity, d) buffer whose leading dimensions flatten to the R rows of `sources` and
    `targets` (R, m), copy entry sources[r, i] of row r to targets[r, i]; every entry is read first.

    A row is one KV head of one layer: here one decoding row's slice (layers, 1, kv_heads, capacity, d) of
    the engine's batch tables. With several rows that slice is not one block of memory; the moves then go
    through advanced indexing into it (still one read and one write).
    """
    leading = buffer.shape[:-2]
    if leading.numel() != sources.shape[0]:
        raise KvsieveError(f"Got moves for {sources.shape[0]} rows, the buffer has {leading.numel()}.")
    if buffer.is_contiguous():
        flat = buffer.view(-1, *buffer.shape[-2:])
        read = sources[:, :, None].expand(-1, -1, flat.shape[-1])
        flat.scatter_(1, targets[:, :, None].expand_as(read), flat.gather(1, read))
        return
    grid = torch.meshgrid(*(torch.arange(n, device=buffer.device) for n in leading), indexing="ij")
    rows = [index.reshape(-1, 1) for index in grid]
    buffer[(*rows, targets)] = buffer[(*rows, sources)]


def compaction(victims: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Moves (sources, targets), each (kv_heads, m), that drop the `victims` (kv_heads, m) of `length` entries.

    Survivors at or above `length - m` move into the victims' places below it, so entries
    0 .. length - m - 1 are then exactly the survivors. Pairs beyond a head's survivor count copy
    one dropped entry onto another (harmless: both lie above the new length).
    """
    kv_heads, m = victims.shape
    if m == 1:  # one victim per head: the newest entry takes its place (itself when it is the victim)
        return victims.new_full((kv_heads, 1), length - 1), victims
    targets = victims.sort(dim=1).values  # holes below the new length first
    dropped = torch.zeros(kv_heads, length, dtype=torch.bool, device=victims.device)
    dropped.scatter_(1, victims, True)
    order = torch.sort(dropped[:, length - m :].to(torch.uint8), dim=1, stable=True).indices  # survivors first
    return order + (length - m), targets


def wrap_cache(
    model: PreTrainedModel, layers: list[tuple[torch.Tensor, torch.Tensor]], seen: int | None = None
) -> DynamicCache:
    """A DynamicCache of `model` holding exactly these (keys, values) tensors in its first layers (no copy);
    the layers after them, if any, stay empty. A windowed layer (`is_windowed`) is told it has seen `seen`
    tokens (None: as many as it holds), which is what transformers' sliding layer counts."""
    cache = DynamicCache(config=model.config)
    for layer, (keys, values) in zip(cache.layers[: len(layers)], layers, strict=True):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        if is_windowed(layer):
            layer.cumulative_length = keys.shape[2] if seen is None else seen
    return cache
