"""Context reuse: the states of recent prompt prefixes, keyed by the token ids that produced them
and the method spec, bounded in bytes with least-recently-used eviction (vLLM's prefix caching).

A `PromptState` is a prefix as the method's feed left it before any compression: its KV cache,
the logical position of the next token and, for policies that score with accumulated attention,
the prefix queries' sums (`PrefixSums`). A request whose prompt starts with a stored prefix runs
only its own new tokens on top of it, and compression and eviction then see the whole prompt
(the question included) exactly as a one-pass prefill does: reuse never changes an answer.
Which methods can start from a prefix, and how many new tokens they need, is `reuse_tail`.
The cache stores its own clone and hands out clones, so a request never changes a stored state.
"""

from __future__ import annotations

import re
from collections import OrderedDict

from transformers import PreTrainedModel

from kvsieve.compress.stages import accumulating
from kvsieve.errors import KvsieveError
from kvsieve.feed import PromptState
from kvsieve.spec import MethodSpec

BLOCK = 16  # tokens: a stored state cut shorter is cut to a multiple of this (no 3-token "hits")
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


def reuse_tail(spec: MethodSpec) -> int | None:
    """The fewest new tokens a request must run on top of a stored prefix for `spec` to give exactly
    what a run of the whole prompt gives; None when the method cannot start from one.

    A select stage (GemFilter) continues its selection pass up to the filter layer, which does not
    depend on the question, and needs its voting queries among the new tokens; its feed and later
    stages then run on the kept tokens afresh. A prefill kernel (CritiPrefill) and a chunked feed
    plan their segments and chunks from the whole length: they do not continue a prefix. After a
    one-pass feed, compression and eviction need their policies' scored queries among the new
    tokens (SnapKV: its window); accumulating ones continue the stored sums.
    """
    if spec.attention is not None:
        return None
    if spec.select is not None:
        return max(1, spec.select.queries)
    if spec.feed is not None and spec.feed.tag != "full":
        return None
    tail = 1  # the last prompt token's logits give the first answer token
    for stage in (spec.compress, spec.evict):
        if stage is not None:
            queries = stage.policy.scored_queries
            if queries is None:
                return None
            tail = max(tail, queries)
    return tail


def prefix_key(spec: MethodSpec) -> str:
    """What a stored prefix state depends on: a select stage's pass up to its filter layer, or the dense
    one-pass feed and the accumulated attention sums its policies need. Methods with the same key
    share states (full attention and SnapKV do; GemFilter presets with one filter layer do)."""
    if spec.select is not None:
        return f"{spec.select.tag} pass to layer {spec.select.layer}"
    policies = [stage.policy for stage in (spec.compress, spec.evict) if stage is not None]
    return "full" + "".join(f"+sums@{alpha:g}" for alpha in accumulating(policies))


class PrefixCache:
    """LRU of prompt states keyed by (`prefix_key`, token ids), at most `max_bytes` in all."""

    def __init__(self, model: PreTrainedModel, max_bytes: int):
        self.model = model
        self.max_bytes = max_bytes
        self.bytes = 0
        self._states: OrderedDict[tuple[str, tuple[int, ...]], PromptState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def lookup(self, key: str, ids: list[int], longest: int) -> PromptState | None:
        """A clone of the stored state that covers the longest start of `ids`, at most `longest` tokens (None if none).

        A state whose ids go on past what `ids` share with them is cut to the shared start, in whole
        blocks of `BLOCK` tokens: entry i of a causal model's cache depends on tokens 0..i only, so the
        first m entries are exactly the state of the first m tokens (vLLM matches prefixes block by
        block the same way). States that carry accumulated attention sums are used whole or not at
        all: their sums include every stored query.
        """
        best, best_length = None, 0
        for entry, state in self._states.items():
            stored_key, stored_ids = entry
            if stored_key != key:
                continue
            shared = _shared_start(stored_ids, ids, longest)
            if shared < len(stored_ids):
                if state.sums is not None:
                    continue
                shared -= shared % BLOCK
            if shared > best_length:
                best, best_length = entry, shared
        if best is None:
            return None
        self._states.move_to_end(best)
        return self._states[best].clone(self.model, best_length)

    def store(self, key: str, ids: list[int], state: PromptState) -> None:
        """Keep a clone of `state` for `ids`, evicting the least recently used states to fit."""
        key = (key, tuple(ids))
        size = state.nbytes
        if size > self.max_bytes:
            return
        if key in self._states:
            self.bytes -= self._states.pop(key).nbytes
        while self.bytes + size > self.max_bytes:
            self.bytes -= self._states.popitem(last=False)[1].nbytes
        self._states[key] = state.clone(self.model)
        self.bytes += size


def _shared_start(stored: tuple[int, ...], ids: list[int], longest: int) -> int:
    """How many first tokens `stored` and `ids` share, at most `longest`."""
    limit = min(len(stored), len(ids), longest)
    for i in range(limit):
        if stored[i] != ids[i]:
            return i
    return limit
