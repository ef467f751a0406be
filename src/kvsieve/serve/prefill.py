"""How the engine prefills one request: from scratch, or from a cached prompt state plus the new tokens.

Without a prefix cache a request runs exactly as `kvsieve generate` runs it: the whole prompt
through the method's stages (query-aware compression). With one, a chat prompt is split at its
reuse boundary (everything before the last message: the document, the earlier turns) and the
context is prefilled and compressed on its own, scored from its own last window
(query-agnostic, as a state that later questions extend must be). The rest of the prompt is
then *extended* onto that state, the mechanism a chunked feed uses for its next chunk: the new
tokens run on top of the (compressed) cache at its logical position while the method's scorers
watch, and the cache is cut back to the method's budget:

- compress (SnapKV, KNorm, ...): compressed again by the new tokens' own window;
- evict (H2O, A2SF, TOVA, ...): running scores continue (A2SF eq. 5 splits exactly into
  alpha^t * old scores + the new queries' scores; H2O alpha = 1; TOVA the newest row), then
  eviction restarts at the budget;
- chunked feeds (FM / IM / IMDC): the new tokens are one more chunk, and memory + chunk are
  pruned to sinks + memory by the feed's pruner;
- full attention (and CritiPrefill, whose kernel runs the extension): nothing is dropped, so
  reuse is exact prefix caching.

A request that finds a stored state extends it by its new tokens only; fresh requests follow
the same split, so an answer does not depend on whether the cache had the document. GemFilter
chooses tokens with the question's attention, so its requests are recomputed (and say so).
Fractional budgets resolve against the tokens seen so far.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from kvsieve.attention import attention_hooks
from kvsieve.compress.cache import compose_kept, prune_layer, resolve_budget
from kvsieve.compress.policy import Policy
from kvsieve.compress.scorers import keep_indices
from kvsieve.compress.stages import EvictRun, score_observers
from kvsieve.decode import extend
from kvsieve.errors import KvsieveError
from kvsieve.feed.chunked import ChunkedPrefill
from kvsieve.pipeline import prefill
from kvsieve.prompt import Prompt
from kvsieve.serve.batch import wrap_cache
from kvsieve.serve.prefix_cache import PrefixCache, PromptState
from kvsieve.spec import MethodSpec

GEMFILTER_NOTE = "recomputed: the select stage chooses tokens with the question's attention, so no state is reused"


@dataclass
class Prefilled:
    """A request's prompt state, its eviction run for decoding, and what the response reports.

    `to_store`: (token ids, state) pairs for the prefix cache, snapshots sharing the request's
    tensors (which are never changed in place); the engine stores (clones) them after the first
    token is out, so storing costs no time to first token.
    """

    state: PromptState
    evict: EvictRun | None
    info: dict[str, Any] = field(default_factory=dict)
    to_store: list[tuple[list[int], PromptState]] = field(default_factory=list)


def spec_key(spec: MethodSpec) -> str:
    """The spec as canonical JSON: one half of a prefix-cache key."""
    return json.dumps(spec.to_dict(), sort_keys=True)


def prefill_request(
    model: PreTrainedModel,
    spec: MethodSpec,
    ids: list[int],
    *,
    boundary: int,
    tail: int,
    reserve: int,
    cache: PrefixCache | None,
    use_cache: bool,
) -> Prefilled:
    """Prefill `ids` for decoding `reserve` tokens, reusing and filling `cache` where the method allows.

    `boundary`: tokens of reusable context at the start (0: none); `tail`: tokens at the end that
    a select stage always keeps (the question and template suffix).
    """
    start = time.perf_counter()
    if spec.select is not None or cache is None:
        state, evict, stages = _fresh(model, spec, ids, tail, reserve)
        info = {"cache": "off" if cache is None else "recomputed", "cached_tokens": 0, "prefill_tokens": len(ids)}
        if spec.select is not None:  # the full model ran on the kept tokens only
            info["prefill_tokens"] = next(r.details["kept"] for r in stages if r.stage == "select")
            info["note"] = GEMFILTER_NOTE if cache is not None else "select stage: the question decides what is kept"
        return _done(state, evict, spec, stages, info, start)
    hit = cache.lookup(spec_key(spec), ids) if use_cache else None
    to_store = []
    if hit is not None:
        cached, stages = hit.length, []
        state, evict = hit, _extend(model, spec, hit, ids[cached:])
        info = {"cache": "hit", "cached_tokens": cached, "prefill_tokens": len(ids) - cached}
    else:
        cached = 0
        split = boundary if 0 < boundary < len(ids) else len(ids)
        context_tail = tail if split == len(ids) else 0
        state, evict, stages = _fresh(model, spec, ids[:split], context_tail, reserve + len(ids) - split)
        if split < len(ids):
            to_store.append((ids[:split], _snapshot(model, state, evict)))
            evict = _extend(model, spec, state, ids[split:])
        info = {"cache": "miss" if use_cache else "bypassed", "cached_tokens": 0, "prefill_tokens": len(ids)}
    if state.length > cached:
        to_store.append((ids, _snapshot(model, state, evict)))
    return _done(state, evict, spec, stages, info, start, to_store if use_cache else [])


def _done(
    state: PromptState,
    evict: EvictRun | None,
    spec: MethodSpec,
    stages: list,
    info: dict[str, Any],
    start: float,
    to_store: list[tuple[list[int], PromptState]] | None = None,
) -> Prefilled:
    info = {
        "method": spec.name,
        **info,
        "kv_entries": state.kv_entries,
        "prefill_seconds": round(time.perf_counter() - start, 6),
        "stages": [_json_safe(asdict(record)) for record in stages],
    }
    return Prefilled(state, evict, info, to_store or [])


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value if isinstance(value, str | int | float | bool | None) else str(value)


def _snapshot(model: PreTrainedModel, state: PromptState, evict: EvictRun | None) -> PromptState:
    """The state as it is now, sharing its tensors: later steps replace a cache's tensors, never change them."""
    layers = [(layer.keys, layer.values) for layer in state.cache.layers]
    scores = dict(evict.scores) if evict is not None else None
    return PromptState(wrap_cache(model, layers), state.logits, state.position, state.length, scores)


def _fresh(
    model: PreTrainedModel, spec: MethodSpec, ids: list[int], tail: int, reserve: int
) -> tuple[PromptState, EvictRun | None, list]:
    """The method's own pipeline (select -> feed -> compress, eviction started) on `ids`."""
    prompt = Prompt(torch.tensor([ids], device=model.device), 0, len(ids) - tail)
    done = prefill(model, prompt, method=spec, reserve=reserve)
    out = done.prefilled
    state = PromptState(out.cache, out.last_logits, out.next_position, len(ids))
    return state, done.state.evict, done.stages


def _with_count(stage: Any, total: int) -> Any:
    """A compress/evict stage whose budget is a token count (a fraction resolved against `total`)."""
    if stage is None or not isinstance(stage.budget, float):
        return stage
    return dataclasses.replace(stage, budget=resolve_budget(stage.budget, total)[0])


def _extend(model: PreTrainedModel, spec: MethodSpec, state: PromptState, ids: list[int]) -> EvictRun | None:
    """Run `ids` on top of `state` (changed in place) and cut the cache back to the method's budget.

    Returns the eviction run that decoding continues with (None without an evict stage).
    """
    total = state.length + len(ids)
    compress, evict = _with_count(spec.compress, total), _with_count(spec.evict, total)
    compress_run = compress.begin() if compress is not None else None
    feed = spec.feed if isinstance(spec.feed, ChunkedPrefill) else None
    feed_scores: dict[int, torch.Tensor] = {}
    evict_scores: dict[int, torch.Tensor] = {}
    if ids:
        observers = [
            *(compress_run.observers() if compress_run is not None else ()),
            *(score_observers(evict.policy, evict_scores) if evict is not None else ()),
            *(score_observers(feed.pruner, feed_scores) if feed is not None else ()),
        ]
        kernel = spec.attention.begin() if spec.attention is not None else None
        with torch.no_grad(), attention_hooks(observers=observers, kernel=kernel):
            logits = extend(model, state.cache, torch.tensor([ids], device=model.device), state.position)
        state.logits, state.position, state.length = logits[-1], state.position + len(ids), total
    kept = _prune_memory(state, feed, feed_scores) if feed is not None and ids else None
    if compress_run is not None and ids:
        compress_run.compress(state.cache, kept)
        kept = compose_kept(kept, compress_run.kept_positions)
    if evict is None:
        return None
    run = evict.begin()
    if ids:
        run.scores = _continue(state.evict_scores, evict_scores, evict.policy, len(ids))
    else:
        run.scores = dict(state.evict_scores or {})
    run.start(state.cache, kept)
    return run


def _continue(
    old: dict[int, torch.Tensor] | None, new: dict[int, torch.Tensor], policy: Policy, steps: int
) -> dict[int, torch.Tensor]:
    """Running eviction scores after `steps` more queries: alpha^steps * old + new for accumulating
    policies (A2SF eq. 5, H2O alpha = 1); the new queries' scores alone for the others (TOVA, KNorm)."""
    alpha = policy.step_alpha
    if alpha is None or not old:
        return new
    merged = {}
    for layer, scores in new.items():
        previous = old.get(layer)
        if previous is not None:
            scores = scores.clone()
            scores[:, : previous.shape[1]] += (float(alpha) ** steps) * previous
        merged[layer] = scores
    return merged


def _prune_memory(state: PromptState, feed: ChunkedPrefill, scores: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The extension as one more chunk of a chunked feed: keep the sinks plus the `memory` best entries."""
    budget = feed.sinks + feed.memory
    kept = []
    for layer, entry in enumerate(state.cache.layers):
        kv_heads, n = entry.keys.shape[1], entry.keys.shape[2]
        if n <= budget:
            kept.append(torch.arange(n, device=entry.keys.device).expand(kv_heads, n))
            continue
        if feed.pruner.position_only:
            layer_scores, recent = torch.zeros(kv_heads, n, device=entry.keys.device), feed.memory
        else:
            layer_scores, recent = scores[layer], _protected_tail(feed.pruner, feed.memory)
        indices = keep_indices(layer_scores, budget, feed.sinks, recent)
        prune_layer(state.cache, layer, indices)
        kept.append(indices)
    return kept


def _protected_tail(pruner: Policy, memory: int) -> int:
    """The newest entries the pruner always keeps, at most the memory (as the chunked feed does)."""
    try:
        return min(pruner.protected(memory)[1], memory)
    except KvsieveError:  # e.g. a SnapKV window larger than the memory: the newest `memory` entries
        return memory
