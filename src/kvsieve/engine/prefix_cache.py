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
from dataclasses import replace

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsieve.compress.stages import Compress, accumulating
from kvsieve.engine.pipeline import prefix_states
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


def reuse_tail(spec: MethodSpec, budget: int | float | None = None) -> int | None:
    """The fewest new tokens a request must run on top of a stored prefix for `spec` to give exactly
    what a run of the whole prompt gives; None when the method cannot start from one. `budget`: the
    reuse budget the prefix is stored at (`reuse_compress`).

    A select stage (GemFilter) continues its selection pass up to the filter layer, which does not
    depend on the question, and needs its voting queries among the new tokens; its feed and later
    stages then run on the kept tokens afresh. A prefill kernel (CritiPrefill) and a chunked feed
    plan their segments and chunks from the whole length: they do not continue a prefix. After a
    one-pass feed, compression and eviction need their policies' scored queries among the new
    tokens (SnapKV: its window); accumulating ones continue the stored sums. A prefix stored compressed
    (question-agnostic) is continued by a pass that scores nothing (`score_observers`' blind), so any
    policy continues it from one new token.
    """
    if spec.attention is not None:
        return None
    if spec.select is not None:
        return max(1, spec.select.queries)
    if not spec.one_pass:
        return None
    tail = 1  # the last prompt token's logits give the first answer token
    if reuse_compress(spec, budget) is not None:
        return tail
    for stage in (spec.compress, spec.evict):
        if stage is not None:
            queries = stage.policy.scored_queries
            if queries is None:
                return None
            tail = max(tail, queries)
    return tail


def reuse_compress(spec: MethodSpec, budget: int | float | None) -> Compress | None:
    """How a stored state of `spec`'s prefixes is compressed at reuse budget `budget` (None: kept whole).

    By the method's own scorer (its compress policy, else its eviction policy) over the prefix's
    own queries, before any question is known. Kept whole where there is no scorer (full
    attention), where a select stage needs every key to select from (GemFilter), and where
    positions are re-encoded (StreamingLLM's `reencode` counts on positions 0 .. n-1).
    """
    if budget is None or spec.select is not None:
        return None
    if spec.compress is not None:  # its own settings (per-head budgets) at the reuse budget
        return replace(spec.compress, budget=budget)
    if spec.evict is None or spec.evict.reencodes:
        return None
    return Compress(spec.evict.policy, budget)


def prefix_key(spec: MethodSpec, budget: int | float | None = None) -> str:
    """What a stored prefix state depends on: a select stage's pass up to its filter layer, or the dense
    one-pass feed, the accumulated attention sums its policies need and the reuse compression
    (`reuse_compress`). Methods with the same key share states (full attention and SnapKV do at the
    whole reuse budget; GemFilter presets with one filter layer do)."""
    if spec.select is not None:
        return f"{spec.select.tag} pass to layer {spec.select.layer}"
    policies = [stage.policy for stage in (spec.compress, spec.evict) if stage is not None]
    key = "full" + "".join(f"+sums@{alpha:g}" for alpha in accumulating(policies))
    squeeze = reuse_compress(spec, budget)
    if squeeze is None:
        return key
    return f"{key}+{squeeze.policy!r}@{budget!r}" + (f"+heads@{squeeze.head_floor:g}" if squeeze.head_budgets else "")


def fillable(spec: MethodSpec, budget: int | float | None = None) -> bool:
    """Whether a pass of a context alone can make the prefix state `spec` stores at reuse budget `budget` (`fill`): a
    method that continues a stored prefix from its one-pass feed (a select stage stores its own pass up to the filter
    layer)."""
    return reuse_tail(spec, budget) is not None and spec.select is None


def fill_prefix_caches(model: PreTrainedModel, ids: list[int], entries: list[tuple[PrefixCache, MethodSpec]]) -> int:
    """Store in each entry's cache the state of `ids` that its method would store there (`prefix_key`,
    `reuse_compress` at the cache's reuse budget), prefilling `ids` once per kind of exact state rather than once
    per entry; the number of prefills run.

    A sweep of reuse budgets and policies over one context (`kvsieve ruler`, both of its modes) then starts
    every configuration from a stored state: methods whose exact states are the same (`prefix_key` without a reuse
    budget: the same accumulated sums) share one pass, each compressing its own copy by its own policy's scores of
    it (`pipeline.prefix_states`). Every state is the one the method's first request would have stored itself."""
    groups: dict[str, list[tuple[PrefixCache, MethodSpec]]] = {}
    stored = set()  # (cache, key): methods whose states are the same (full attention and SnapKV's exact one) store once
    for cache, spec in entries:
        if not fillable(spec, cache.budget):
            raise KvsieveError(f"Method '{spec.name}' does not store prefix states a pass of the context can fill.")
        if (id(cache), prefix_key(spec, cache.budget)) not in stored:
            stored.add((id(cache), prefix_key(spec, cache.budget)))
            groups.setdefault(prefix_key(spec), []).append((cache, spec))
    tokens = torch.tensor([ids], device=model.device)
    for members in groups.values():
        alphas = accumulating([stage.policy for stage in (members[0][1].compress, members[0][1].evict) if stage])
        squeezes = [reuse_compress(spec, cache.budget) for cache, spec in members]
        states = prefix_states(model, tokens, DynamicCache(config=model.config), 0, None, alphas, squeezes)
        for (cache, spec), state in zip(members, states, strict=True):
            cache.store(prefix_key(spec, cache.budget), ids, state)
    return len(groups)


def parse_reuse_budget(text: str) -> int | float | None:
    """--reuse-budget: 'whole' (None), a count of entries ('2048') or a fraction of the context ('0.5')."""
    if text.strip().lower() in ("whole", "all", "none", ""):
        return None
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        value = 0
    if isinstance(value, float) and value == 1.0:
        return None
    if value <= 0 or (isinstance(value, float) and value > 1):
        raise KvsieveError(
            f"--reuse-budget '{text}' is not 'whole', a count of KV entries (e.g. 2048) or a fraction of the "
            "context in (0, 1] (e.g. 0.5)."
        )
    return value


class PrefixCache:
    """LRU of prompt states keyed by (`prefix_key`, token ids), at most `max_bytes` in all.

    `budget` is the reuse budget: None stores every entry of a prefix (exact, as vLLM's prefix
    caching), a count or fraction stores it compressed by `reuse_compress`."""

    def __init__(self, model: PreTrainedModel, max_bytes: int, budget: int | float | None = None):
        self.model = model
        self.max_bytes = max_bytes
        self.budget = budget
        self.bytes = 0
        self._states: OrderedDict[tuple[str, tuple[int, ...]], PromptState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def lookup(self, key: str, ids: list[int], longest: int) -> PromptState | None:
        """A clone of the stored state that covers the longest start of `ids`, at most `longest` tokens (None if none).

        A state whose ids go on past what `ids` share with them is cut to the shared start, in whole
        blocks of `BLOCK` tokens: entry i of a causal model's cache depends on tokens 0..i only, so the
        first m entries are exactly the state of the first m tokens (vLLM matches prefixes block by
        block the same way). States that carry accumulated attention sums, or were compressed, are used
        whole or not at all: their sums include every stored query, their entries were chosen by all of them;
        so are those of a hybrid model whose sliding layers went past their window (`PromptState.cuttable`).
        """
        best, best_length = None, 0
        for entry, state in self._states.items():
            stored_key, stored_ids = entry
            if stored_key != key:
                continue
            shared = _shared_start(stored_ids, ids, longest)
            if shared < len(stored_ids):
                if not state.cuttable:
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
        entry = (key, tuple(ids))
        size = state.nbytes
        if size > self.max_bytes:
            return
        if entry in self._states:
            self.bytes -= self._states.pop(entry).nbytes
        while self.bytes + size > self.max_bytes:
            self.bytes -= self._states.popitem(last=False)[1].nbytes
        self._states[entry] = state.clone(self.model)
        self.bytes += size


def _shared_start(stored: tuple[int, ...], ids: list[int], longest: int) -> int:
    """How many first tokens `stored` and `ids` share, at most `longest`."""
    limit = min(len(stored), len(ids), longest)
    for i in range(limit):
        if stored[i] != ids[i]:
            return i
    return limit
