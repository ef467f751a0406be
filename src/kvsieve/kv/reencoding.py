"""StreamingLLM's positions by place in the cache (its `reencode`), kept for one evicting run.

Every cached entry's RoPE position is its rank in time order among the live entries (0 .. n-1 per KV head), as
in the StreamingLLM paper, rather than its place in the text. After an eviction the kept keys are rotated by
(new rank - old position) with their layer's rotary embedding (R(p + delta) = R(delta) R(p),
`kvsieve.kv.cache.rerotate_keys`), and the next token goes at position n (`EvictRun.position`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import Cache

from kvsieve.kv.cache import DecodeBuffer, moved, rerotate_keys, rotation
from kvsieve.models import Architecture, architecture


@dataclass
class Reencoding:
    """One run's re-encoded positions: `positions` per layer (kv_heads, n), each entry's RoPE position; `arch` the
    model's layers and rotary embeddings once rotating has started (`start`); `turn` this step's rotation, shared by
    the layers of one rotary embedding where they all move by the same deltas."""

    positions: dict[int, torch.Tensor] = field(default_factory=dict)
    arch: Architecture | None = None
    turn: tuple[torch.Tensor, torch.Tensor] | None = None

    def place(self, layer: int, keys: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Where `layer`'s entries (keys (1, kv_heads, n, d)) sit when the run starts, unless it has them already:
        `kept` (kv_heads, n), the positions of the feed's last pass they came from, else 0 .. n-1 (a one-pass
        prefill's keys)."""
        if layer not in self.positions:
            heads, n = keys.shape[1], keys.shape[2]
            everything = torch.arange(n, device=keys.device).expand(heads, n)
            self.positions[layer] = everything if kept is None else kept

    def start(self, model: torch.nn.Module) -> None:
        """Rotate from now on, with `model`'s rotary embeddings."""
        self.arch = architecture(model)

    @property
    def rotating(self) -> bool:
        return self.arch is not None

    def grow(self, cache: Cache) -> None:
        """After a decoding step: its new entries sit at the old length of each layer of `cache`."""
        self.turn = None
        for layer, placed in self.positions.items():
            n = cache.layers[layer].keys.shape[2]
            new = torch.arange(placed.shape[1], n, device=placed.device)
            self.positions[layer] = torch.cat([placed, new.expand(placed.shape[0], -1)], 1)

    def gather(self, layer: int, indices: torch.Tensor) -> None:
        """`layer` kept the entries at `indices` (kv_heads, k), in time order."""
        if layer in self.positions:
            self.positions[layer] = self.positions[layer].gather(1, indices)

    def move(self, layers: list[int], sources: torch.Tensor, targets: torch.Tensor, length: int) -> None:
        """The buffers of `layers` moved entries sources -> targets ((layers x kv_heads, m)) and kept `length`."""
        if self.positions:
            stacked = torch.stack([self.positions[j] for j in layers])
            self.positions = dict(zip(layers, moved(stacked, sources, targets, length), strict=True))

    def rotate(self, cache: Cache, layer: int, stamps: torch.Tensor | None, shared: bool) -> None:
        """Rotate `layer`'s keys to their places in time order, 0 .. n-1 per KV head.

        In a buffer the time order is that of the entries' `stamps` (kv_heads, n); elsewhere the entries are in it.
        `shared`: every layer moves by the same deltas this step (a position-only policy's layers in buffers hold
        the same stamps and positions: both start as 0 .. n-1 and every layer evicts the same entries), so one
        rotation serves them all (of one rotary embedding: a hybrid model's evicted layers are its global ones,
        which share theirs).
        """
        entry = cache.layers[layer]
        heads, n = entry.keys.shape[1], entry.keys.shape[2]
        in_buffer = isinstance(entry, DecodeBuffer)
        if in_buffer:
            places = stamps.argsort(dim=1).argsort(dim=1)
        else:
            places = torch.arange(n, device=entry.keys.device).expand(heads, n)
        delta = places - self.positions[layer]
        rotary = self.arch.rotary(layer)
        if not (in_buffer and shared) or self.turn is None:
            self.turn = rotation(delta, rotary)
        rotated = rerotate_keys(entry.keys, delta, rotary, self.turn)
        if in_buffer:
            entry.keys.copy_(rotated)  # a view of the buffer
        else:
            entry.keys = rotated  # a new tensor: one that others may share is never changed
        self.positions[layer] = places
