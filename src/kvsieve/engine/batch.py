"""Continuous batching: the decoding steps of every running request as one forward pass.

A request that decodes alone keeps its own cache and steps it as `kvsieve.decode.step` does
(eviction in place in preallocated buffers: the fastest batch-1 path). Once a second request
joins, the rows share padded buffers as follows.

Requests differ in cache length (per layer, after their own compression), logical position,
method and eviction budget. The batch keeps, per layer, one key and one value buffer
(rows, kv_heads, capacity, head_dim) in which each row's cache is right-aligned and left-padded:
the live columns are lo .. hi - 1, and row b of layer j holds its entries in columns
starts[j][b] .. hi - 1. A step then

1. feeds each row's next token at its own logical position (position ids per row),
2. writes the new keys and values into column hi of the buffers, in place (a transformers cache
   layer over the buffer: no copy of the caches per step, which at 8 requests of 2K tokens would
   cost several times the forward pass), while kvsieve's attention masks every row's padding
   (`attention_hooks(key_starts=...)`) and the rows' eviction observers each see their own query
   and unpadded keys,
3. lets each row's eviction prune its own cache (a view of its columns); what a row keeps is
   written back right-aligned and its start moves right,
4. moves lo past the columns that are padding in every row.

Rows join and leave between steps; only then are the buffers rebuilt (one copy). A full buffer
is reallocated with room for `SPARE` more steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import Cache, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from kvsieve.attention import attention_hooks
from kvsieve.compress.cache import wrap_cache
from kvsieve.compress.stages import EvictRun
from kvsieve.decode import step
from kvsieve.models import with_cache

SPARE = 128  # columns of room for new tokens when a buffer is (re)allocated


class _Columns:
    """One layer of the batch: key/value buffers with room on the right, live columns lo .. hi - 1."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, starts: list[int]):
        self._allocate(keys, values, starts)

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, starts: list[int]) -> None:
        """Copy (rows, kv_heads, width, d) entries into new buffers with SPARE free columns on the right."""
        rows, heads, width, dim = keys.shape
        self.k = keys.new_empty(rows, heads, width + SPARE, dim)
        self.v = values.new_empty(rows, heads, width + SPARE, dim)
        self.k[:, :, :width], self.v[:, :, :width] = keys, values
        self.lo, self.hi, self.starts = 0, width, starts  # starts: absolute buffer columns, one per row

    def keys(self) -> torch.Tensor:
        return self.k[:, :, self.lo : self.hi]

    def values(self) -> torch.Tensor:
        return self.v[:, :, self.lo : self.hi]

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row i's own entries (views)."""
        start = self.starts[i]
        return self.k[i : i + 1, :, start : self.hi], self.v[i : i + 1, :, start : self.hi]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new (rows, kv_heads, t, d) entries at column hi; returns the live keys and values."""
        t = keys.shape[2]
        if self.hi + t > self.k.shape[2]:
            self._allocate(self.keys(), self.values(), [s - self.lo for s in self.starts])
        self.k[:, :, self.hi : self.hi + t], self.v[:, :, self.hi : self.hi + t] = keys, values
        self.hi += t
        return self.keys(), self.values()

    def trim(self) -> None:
        self.lo = min(self.starts)


class _BatchLayer(DynamicLayer):
    """The transformers cache layer the model writes a step's keys and values through (in place)."""

    def __init__(self, columns: _Columns):
        super().__init__()
        self.columns = columns
        self.lazy_initialization(columns.k, columns.v)
        self.keys, self.values = columns.keys(), columns.values()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys, self.values = self.columns.append(key_states, value_states)
        return self.keys, self.values


@dataclass
class Row:
    """One request in the batch: the token it feeds next, that token's logical position, its eviction."""

    token: int
    position: int
    evict: EvictRun | None = None


class DecodeBatch:
    """The running requests' caches: one request's own, or several left-padded per layer in shared
    buffers, stepped together."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.rows: list[Row] = []
        self.layers: list[_Columns] = []
        self.lone: Cache | None = None  # the only row's own cache, until a second row joins

    def __len__(self) -> int:
        return len(self.rows)

    def entries(self, index: int) -> int:
        """KV entries per layer and KV head that row `index` holds (layer 0)."""
        if self.lone is not None:
            return self.lone.get_seq_length()
        return self.layers[0].hi - self.layers[0].starts[index]

    def add(self, row: Row, cache: Cache) -> None:
        """Join `row`, whose own cache (batch 1) was prefilled for it (and is taken over by the batch)."""
        if not self.rows:
            if row.evict is not None:
                row.evict.buffer(cache)
            self.lone, self.rows = cache, [row]
            return
        if self.lone is not None:  # a second row: the first one's cache moves into the shared buffers
            if self.rows[0].evict is not None:
                self.rows[0].evict.unbuffer(self.lone)
            self.layers = [_Columns(layer.keys, layer.values, [0]) for layer in self.lone.layers]
            self.lone = None
        for j, layer in enumerate(cache.layers):
            columns = self.layers[j]
            keys, values, starts = columns.keys(), columns.values(), [s - columns.lo for s in columns.starts]
            width, length = keys.shape[2], layer.keys.shape[2]
            grow = max(length - width, 0)  # every present row gains `grow` columns of padding on the left
            keys, values = F.pad(keys, (0, 0, grow, 0)), F.pad(values, (0, 0, grow, 0))
            pad = width + grow - length
            keys = torch.cat([keys, F.pad(layer.keys, (0, 0, pad, 0))])
            values = torch.cat([values, F.pad(layer.values, (0, 0, pad, 0))])
            self.layers[j] = _Columns(keys, values, [s + grow for s in starts] + [pad])
        self.rows.append(row)

    def remove(self, rows: list[Row]) -> None:
        """Leave: the rows' caches are freed."""
        keep = [i for i, row in enumerate(self.rows) if all(row is not r for r in rows)]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.layers, self.lone = [], None
            return
        index = torch.tensor(keep, device=self.layers[0].k.device)
        for j, columns in enumerate(self.layers):
            starts = [columns.starts[i] for i in keep]
            lo = min(starts)
            keys = columns.k[:, :, lo : columns.hi].index_select(0, index)
            values = columns.v[:, :, lo : columns.hi].index_select(0, index)
            self.layers[j] = _Columns(keys, values, [s - lo for s in starts])

    def step(self) -> torch.Tensor:
        """One forward pass for every row; returns (rows, vocab) logits of the next tokens."""
        device = self.model.device
        ids = torch.tensor([[row.token] for row in self.rows], device=device)
        if self.lone is not None:
            (row,) = self.rows
            with torch.no_grad(), attention_hooks(observers=row.evict.step_observers() if row.evict else ()):
                logits = step(self.model, self.lone, ids, row.position, row.evict)
            row.position += 1
            return logits[None]
        positions = torch.tensor(
            [[row.evict.position(self.entries(i), row.position) if row.evict else row.position]
             for i, row in enumerate(self.rows)],
            device=device,
        )  # fmt: skip
        key_starts = [torch.tensor([s - c.lo for s in c.starts], device=device) for c in self.layers]
        cache = DynamicCache(config=self.model.config)
        cache.layers = [_BatchLayer(columns) for columns in self.layers]
        observers = [self._observe] if any(row.evict is not None for row in self.rows) else []
        with torch.no_grad(), attention_hooks(observers=observers, key_starts=key_starts):
            out = self.model(
                input_ids=ids, position_ids=positions, **with_cache(self.model, cache), use_cache=True, logits_to_keep=1
            )
        for row in self.rows:
            row.position += 1
        self._evict()
        for columns in self.layers:
            columns.trim()
        return out.logits[:, -1]

    def _observe(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        """Each row's eviction observes its own query and its own (unpadded) keys."""
        columns = self.layers[layer]
        for i, row in enumerate(self.rows):
            if row.evict is not None:
                row.evict.observe(layer, query[i : i + 1], key[i : i + 1, :, columns.starts[i] - columns.lo :])

    def _evict(self) -> None:
        """Run each row's per-step eviction on a view of its columns; write back what it keeps."""
        for i, row in enumerate(self.rows):
            if row.evict is None:
                continue
            views = [columns.row(i) for columns in self.layers]
            own = wrap_cache(self.model, views)
            row.evict.after_step(own)
            for columns, layer, (before, _) in zip(self.layers, own.layers, views, strict=True):
                if layer.keys is before:
                    continue  # this layer was within the budget
                start = columns.hi - layer.keys.shape[2]
                columns.k[i, :, start : columns.hi] = layer.keys[0]
                columns.v[i, :, start : columns.hi] = layer.values[0]
                columns.starts[i] = start
