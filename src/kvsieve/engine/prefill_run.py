"""A request's prefill as the engine runs it: the method's stages on the prompt, from a stored prefix where one
fits, storing the prompt's reusable prefix for later requests; or only the select stage (--upstream).

The request (`engine.request`) runs one of these in its budgeted slices (`engine.slices`); what the prefix
cache did is returned beside the prefill, for the request's `Started` event and the server's metrics.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import PreTrainedModel

from kvsieve.decode import Sampling
from kvsieve.engine.events import Selected
from kvsieve.engine.pipeline import PrefillResult, prefill, select_tokens
from kvsieve.engine.prefix_cache import BLOCK, PrefixCache, prefix_key, reuse_compress, reuse_tail
from kvsieve.prompt import Prompt
from kvsieve.spec import MethodSpec


def prefill_with_reuse(
    model: PreTrainedModel,
    prompt: Prompt,
    spec: MethodSpec,
    sampling: Sampling,
    cache: PrefixCache | None,
    *,
    boundary: int = 0,
    use_cache: bool = True,
) -> tuple[PrefillResult, dict[str, Any]]:
    """The method's stages on `prompt`, from a stored prefix where one fits (`reuse_tail`), and what the prefix
    cache did (`cache`: off, bypassed, not reusable, hit or miss; `cached_tokens`; `query_aware`; ...).

    boundary: tokens of reusable context at the start of the prompt (a chat's earlier messages), where the
        prefix state is stored; use_cache: look up and store prefix states (off: the whole prompt runs)."""
    tail = reuse_tail(spec, cache.budget if cache is not None else None)
    status, hit, keep, squeeze, key = "off", None, 0, None, None
    wants_prompt = sampling.prompt_logprobs is not None  # a reused prefix computed no logits
    ids = prompt.ids[0].tolist()
    if cache is not None and (not use_cache or wants_prompt):
        status = "bypassed"
    elif cache is not None and tail is None:
        status = "not reusable"
    elif cache is not None and tail is not None:
        longest = prompt.length - tail
        key, squeeze = prefix_key(spec, cache.budget), reuse_compress(spec, cache.budget)
        hit = cache.lookup(key, ids, longest)
        split = _split(boundary, longest, tail)
        status = "hit" if hit is not None else "miss"
        if split > (hit.length if hit is not None else 0):
            keep = split
    context = hit.compressed and hit.kv_entries if hit is not None else False  # the run prunes the hit's cache
    done = prefill(
        model,
        prompt,
        spec,
        reserve=sampling.max_new_tokens,
        prefix=hit,
        keep=keep,
        store_with=squeeze if keep else None,
        prompt_logits=wants_prompt,
    )
    if done.stored is not None:
        context = done.stored.compressed and done.stored.kv_entries
    reuse: dict[str, Any] = {
        "cache": status,
        "cached_tokens": hit.length if hit is not None else 0,
        # Whether the compression that chose the answer's context saw the question: not when the context
        # came from a state compressed without it (--reuse-budget), which then holds `context_entries`.
        "query_aware": not context,
    }
    if cache is not None:  # what stored contexts keep: every entry, or a budget (the server's --reuse-budget)
        kept_as = reuse_compress(spec, cache.budget)
        reuse["reuse_budget"] = "whole" if kept_as is None else kept_as.budget
    if context:
        reuse["context_entries"] = context
    if done.stored is not None and key is not None:  # a state is stored only where it was looked up (a miss)
        cache.store(key, ids[:keep], done.stored)
        done.stored = None  # the cache holds its own copy
    return done, reuse


def _split(boundary: int, longest: int, tail: int) -> int:
    """Where a request stores its prefix state: the context's end (`boundary`) when the method's scored queries fit
    after it; else whole blocks before it, by the method's tail, so that every question of that context, whatever
    its length, finds the same state whole (a hybrid model's state past its sliding window cannot be cut shorter);
    without a boundary, whole blocks: a prompt one token longer then finds the same state rather than storing a copy
    one token longer."""
    if 0 < boundary <= longest:
        return boundary
    split = max(0, boundary - tail) if boundary > 0 else longest
    return split - split % BLOCK


def select_stage_only(model: PreTrainedModel, prompt: Prompt, spec: MethodSpec) -> Selected:
    """Only the select stage (and its kernel): the kept token ids; without a select stage the whole prompt."""
    start, ids, details = time.perf_counter(), prompt.ids[0].tolist(), {}
    if spec.select is not None:
        indices, record, _ = select_tokens(model, prompt, spec.select, spec.attention)
        ids = [ids[i] for i in indices.tolist()]
        details = {k: v for k, v in record.details.items() if isinstance(v, int | float | str)}
    info = {
        "method": spec.name,
        "prompt_tokens": prompt.length,
        "selected_tokens": len(ids),
        "select_seconds": round(time.perf_counter() - start, 6),
        **details,
    }
    return Selected(ids, info)


def prefill_tokens(done: PrefillResult, prompt_length: int, cached_tokens: int) -> int:
    """Tokens the full model prefilled: the kept ones after a select stage, the new ones after a reused prefix."""
    if done.state.selected is not None:
        return len(done.state.selected)
    return prompt_length - cached_tokens
