"""Compressed-context reuse: recent prompt states, keyed by the token ids that produced them and
the method spec, bounded in bytes with least-recently-used eviction.

A `PromptState` is everything needed to continue a prompt: its (possibly compressed) KV cache,
the logits of its last token, the logical position of the next token, and the running eviction
scores of methods that evict while decoding. The cache stores its own clone and hands out
clones, so a request that extends or decodes from a state never changes the stored one.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsieve.errors import KvsieveError
from kvsieve.serve.batch import wrap_cache

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'2GB', '512MiB', '1e9' or '0' as a byte count."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    try:
        if not match or unit not in _UNITS:
            raise ValueError
        value = float(match.group(1)) * _UNITS[unit]
    except ValueError:
        raise KvsieveError(f"'{text}' is not a memory size; write e.g. 2GB, 512MB, 1GiB or 0 (off).") from None
    return int(value)


@dataclass
class PromptState:
    """A prefilled prompt, ready to decode from or to extend with more tokens."""

    cache: DynamicCache
    logits: torch.Tensor  # (vocab,) after the last prompt token
    position: int  # logical position of the next token
    length: int  # prompt tokens that produced this state
    evict_scores: dict[int, torch.Tensor] | None = None  # running eviction scores, aligned with the cache

    @property
    def kv_entries(self) -> int:
        """Entries per layer and KV head (layer 0), the unit of every budget."""
        return self.cache.get_seq_length()

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
        tensors += [self.logits, *(self.evict_scores or {}).values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def clone(self, model: PreTrainedModel) -> PromptState:
        """A deep copy: tensors cloned, so neither copy can change the other."""
        layers = [(layer.keys.clone(), layer.values.clone()) for layer in self.cache.layers]
        scores = None if self.evict_scores is None else {j: s.clone() for j, s in self.evict_scores.items()}
        return PromptState(wrap_cache(model, layers), self.logits.clone(), self.position, self.length, scores)


class PrefixCache:
    """LRU of prompt states keyed by (spec JSON, token ids), at most `max_bytes` in all."""

    def __init__(self, model: PreTrainedModel, max_bytes: int):
        self.model = model
        self.max_bytes = max_bytes
        self.bytes = 0
        self._states: OrderedDict[tuple[str, tuple[int, ...]], PromptState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def lookup(self, spec_key: str, ids: list[int]) -> PromptState | None:
        """A clone of the longest stored state whose ids are a prefix of `ids` (None if none)."""
        best = None
        for key in self._states:
            stored_spec, stored_ids = key
            if (
                stored_spec == spec_key
                and len(stored_ids) <= len(ids)
                and (best is None or len(stored_ids) > len(best[1]))
            ):
                if tuple(ids[: len(stored_ids)]) == stored_ids:
                    best = key
        if best is None:
            return None
        self._states.move_to_end(best)
        return self._states[best].clone(self.model)

    def store(self, spec_key: str, ids: list[int], state: PromptState) -> None:
        """Keep a clone of `state` for `ids`, evicting the least recently used states to fit."""
        key = (spec_key, tuple(ids))
        size = state.nbytes
        if size > self.max_bytes:
            return
        if key in self._states:
            self.bytes -= self._states.pop(key).nbytes
        while self.bytes + size > self.max_bytes:
            self.bytes -= self._states.popitem(last=False)[1].nbytes
        self._states[key] = state.clone(self.model)
        self.bytes += size
