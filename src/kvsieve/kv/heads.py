"""Per-head budgets that free memory: a cache layer whose KV heads each hold their own number of entries.

AdaKV's allocation (`head_counts`) gives the heads of a layer different counts. A padded (1, kv_heads, n, d) layer
would hold every head at the longest one's count (on SmolLM2 at a quarter of a 4K passkey prompt, SnapKV's scores
give the longest head 1.2 to 2.4 times the layer's mean), so the memory would not follow the budget. A
`SegmentedLayer` holds each head's entries in a segment of one flat buffer instead: the layer holds the sum of the
heads' counts (plus the room for the tokens that follow), and attention reads each segment where it lies
(`kvsieve.kernels.attention.segment_attention`: the CPU's kernel for a decoding step, one call per layer).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, TypeVar

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

from kvsieve.errors import KvsieveError

CacheT = TypeVar("CacheT", bound=Cache)
ROOM = 128  # free entries after each head's segment when a layer is (re)allocated, for the tokens that follow


def head_counts(scores: torch.Tensor, budget: int, floor: float, protected: torch.Tensor) -> torch.Tensor:
    """AdaKV's per-head counts for one layer (Feng et al., 2024, Algorithm 1): the layer's `budget` x kv_heads entries
    taken as one top-k over every head's `scores` (kv_heads, n), each head first given `floor` x `budget` entries
    (the safeguard that keeps a head from starving). `protected` (n,) marks entries every head keeps (sinks, the
    window): they count against its share. Returns (kv_heads,) counts summing to budget x kv_heads (each at most n).
    """
    kv_heads, n = scores.shape
    minimum = max(int(protected.sum()), min(budget, round(floor * budget)))
    pooled = scores.float().masked_fill(protected, float("inf")).flatten()
    extra = kv_heads * (budget - minimum)
    counts = torch.full((kv_heads,), minimum, dtype=torch.long, device=scores.device)
    if extra <= 0:
        return counts
    # Each head's best `minimum` entries are already counted: the pooled top-k runs over the rest.
    ranked = pooled.view(kv_heads, n).sort(dim=1, descending=True).values[:, minimum:]
    winners = ranked.flatten().topk(extra).indices // (n - minimum)
    return counts + torch.bincount(winners, minlength=kv_heads)


class SegmentedLayer(DynamicLayer):
    """One global layer's entries, KV head g's `counts[g]` entries in time order in a segment of `key_buffer` /
    `value_buffer` ((capacity, d)) from `starts[g]` on, with free entries after each segment up to the next one.

    `update` writes a pass's new entries after each head's own (the question, a decoding step), allocating anew only
    when a head's room runs out (then with `ROOM` free entries after each). The counts and starts are kept on the host
    as well as in tensors (`segments()`, what the attention reads), so that a decoding step reads nothing back from
    the device. `keys` / `values` are the buffers viewed as (1, 1, capacity, d): one sequence, so that the engine's
    checks of batch size hold, but not a (1, kv_heads, n, d) layer; the attention reads the segments, handed to it
    with the cache (`kvsieve.models.with_cache`).
    """

    is_sliding = False

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], room: int = ROOM):
        """Per KV head its (n_g, d) keys and values, in time order; `room` free entries after each."""
        super().__init__()
        if not keys or len(keys) != len(values):
            raise KvsieveError("A segmented layer needs one key and one value tensor per KV head.")
        self._allocate(torch.cat(keys), torch.cat(values), [k.shape[0] for k in keys], room)

    @classmethod
    def kept(
        cls, keys: torch.Tensor, values: torch.Tensor, kept: list[torch.Tensor], room: int = ROOM
    ) -> SegmentedLayer:
        """The entries `kept[g]` (ascending positions) of KV head g of a (1, kv_heads, n, d) layer."""
        return cls(
            [keys[0, g, index] for g, index in enumerate(kept)],
            [values[0, g, index] for g, index in enumerate(kept)],
            room,
        )

    @classmethod
    def over(
        cls, key_buffer: torch.Tensor, value_buffer: torch.Tensor, first: list[int], counts: list[int], room: int
    ) -> SegmentedLayer:
        """A layer over segments of buffers it shares (the decoding batch's, `kvsieve.kv.tables`): head g's
        `counts[g]` entries from `first[g]` on, `room` free entries after them."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer.key_buffer, layer.value_buffer = key_buffer, value_buffer
        layer.counts, layer.first = list(counts), list(first)
        layer.ends = [a + n + room for a, n in zip(first, counts, strict=True)]
        layer.starts = torch.tensor(first, device=key_buffer.device)
        layer.lengths = torch.tensor(counts, device=key_buffer.device)
        layer.keys, layer.values = key_buffer[None, None], value_buffer[None, None]
        layer.dtype, layer.device, layer.is_initialized = key_buffer.dtype, key_buffer.device, True
        return layer

    def has_room(self, steps: int = 1) -> bool:
        """Whether every head can take `steps` more entries without a new allocation."""
        return all(a + n + steps <= end for a, n, end in zip(self.first, self.counts, self.ends, strict=True))

    def advance(self, steps: int = 1) -> None:
        """Make the entries that `steps` steps wrote after each head's own (the batch writes them) live."""
        self.counts = [n + steps for n in self.counts]
        self.lengths = self.lengths + steps

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, counts: list[int], room: int) -> None:
        """New buffers holding the heads' live entries, `keys` / `values` ((sum of `counts`, d), head after head),
        each head's followed by `room` free entries."""
        device = keys.device
        self.counts = list(counts)
        self.first = [start + g * room for g, start in enumerate(accumulate(counts, initial=0))][:-1]
        self.ends = [start + count + room for start, count in zip(self.first, counts, strict=True)]
        self.key_buffer = keys.new_zeros(self.ends[-1], keys.shape[-1])
        self.value_buffer = values.new_zeros(self.ends[-1], values.shape[-1])
        index = torch.cat([torch.arange(a, a + n, device=device) for a, n in zip(self.first, counts, strict=True)])
        self.key_buffer[index] = keys
        self.value_buffer[index] = values
        self.starts = torch.tensor(self.first, device=device)
        self.lengths = torch.tensor(counts, device=device)
        self.keys, self.values = self.key_buffer[None, None], self.value_buffer[None, None]
        self.dtype, self.device, self.is_initialized = keys.dtype, device, True

    @property
    def kv_heads(self) -> int:
        return len(self.counts)

    @property
    def entries(self) -> int:
        """Live entries over all heads."""
        return sum(self.counts)

    @property
    def nbytes(self) -> int:
        """Bytes of the layer's segments, room included (all of its buffers where it owns them; its share of the
        decoding batch's where it lies in them)."""
        per_entry = sum(t.shape[-1] * t.element_size() for t in (self.key_buffer, self.value_buffer))
        return sum(end - a for a, end in zip(self.first, self.ends, strict=True)) * per_entry

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts, lengths), each (1, kv_heads): where each head's live entries lie (the attention's view)."""
        return self.starts[None], self.lengths[None]

    def head(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KV head g's live (n_g, d) keys and values."""
        span = slice(self.first[g], self.first[g] + self.counts[g])
        return self.key_buffer[span], self.value_buffer[span]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a pass's (1, kv_heads, q, d) entries after each head's own; the buffers (the attention reads
        `segments`)."""
        batch, kv_heads, q, _ = key_states.shape
        if batch != 1 or kv_heads != self.kv_heads:
            raise KvsieveError(
                f"A segmented layer holds one sequence of {self.kv_heads} KV heads; got {batch} x {kv_heads} entries."
            )
        if not self.has_room(q):
            self._allocate(*self.live(), self.counts, max(ROOM, q))
        index = (self.starts + self.lengths)[:, None] + torch.arange(q, device=self.device)  # (kv_heads, q)
        self.key_buffer[index] = key_states[0]
        self.value_buffer[index] = value_states[0]
        self.advance(q)
        return self.key_buffer[None, None], self.value_buffer[None, None]

    @property
    def equal(self) -> bool:
        """Whether every head holds as many entries (then a (1, kv_heads, n, d) layer holds it as well)."""
        return len(set(self.counts)) == 1

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's live entries, head after head: (entries, d) keys and values."""
        heads = [self.head(g) for g in range(self.kv_heads)]
        return torch.cat([k for k, _ in heads]), torch.cat([v for _, v in heads])

    def detached(self) -> SegmentedLayer:
        """A copy of the live entries without room (a cache kept after its answer)."""
        copy = SegmentedLayer.__new__(SegmentedLayer)
        DynamicLayer.__init__(copy)
        copy._allocate(*self.live(), self.counts, 0)
        return copy

    def shared(self) -> SegmentedLayer:
        """A layer over the same buffers and live entries without room of its own: its first `update` copies them
        out (copy on write), so a stored prefix's entries are never written by the prompts that continue it."""
        view = SegmentedLayer.__new__(SegmentedLayer)
        DynamicLayer.__init__(view)
        view.__dict__.update(self.__dict__)
        view.ends = [a + n for a, n in zip(self.first, self.counts, strict=True)]
        return view

    @property
    def longest(self) -> int:
        """The longest head's live entries (known on the host)."""
        return max(self.counts)

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        """The longest head's entries (transformers' question: how far the sequence reaches in this layer)."""
        return self.longest

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The live entries as a (1, kv_heads, longest, d) layer, each head's zero-padded after its own: what the
        per-head counts mean, for tests and for comparing with a masked full cache (it holds the padding)."""
        keys = self.key_buffer.new_zeros(1, self.kv_heads, max(self.counts), self.key_buffer.shape[-1])
        values = self.value_buffer.new_zeros(1, self.kv_heads, max(self.counts), self.value_buffer.shape[-1])
        for g in range(self.kv_heads):
            k, v = self.head(g)
            keys[0, g, : k.shape[0]], values[0, g, : v.shape[0]] = k, v
        return keys, values


def is_segmented(layer: object) -> bool:
    """Whether a cache layer holds its KV heads' entries in segments of their own (`SegmentedLayer`)."""
    return isinstance(layer, SegmentedLayer)


def carry_segments(source: Cache, target: CacheT, share: bool) -> CacheT:
    """`target` (a copy of `source` made from its layers' `keys` / `values`) with each of `source`'s segmented
    layers in place of the wrong one such a copy makes: `shared` (copy on write) or a copy of its own."""
    for j, layer in enumerate(source.layers):
        if is_segmented(layer):
            target.layers[j] = layer.shared() if share else layer.detached()
    return target
