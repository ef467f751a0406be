"""Runs select -> feed -> compress -> decode and records what each stage did (DESIGN.md's flow).

Each stage is an option object; `None` means the stage's plain default (no selection, one-pass
prefill, no compression). The prefill attention kernel (dense or e.g. CritiPrefill) applies to
every pass that prefills: the selector's scoring pass and the feed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.attention import PrefillKernel, attention_hooks
from kvsieve.compress import Compressor
from kvsieve.compress.cache import compose_kept
from kvsieve.compress.stages import Evict
from kvsieve.decode import Sampling, decode
from kvsieve.errors import KvsieveError
from kvsieve.feed import Feed, Prefilled
from kvsieve.feed.full import FullPrefill
from kvsieve.models import architecture
from kvsieve.prompt import Prompt, build_prompt
from kvsieve.select import Selector


@dataclass
class StageRecord:
    """One stage's method, wall time and details (sizes, chosen layer, ...)."""

    stage: str
    method: str
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    prefill_seconds: float  # time to first token: selection + feed + compression
    decode_seconds: float
    decode_tokens_per_s: float
    prefill_kv_length: int  # cache entries per layer and KV head when the first token was picked
    kv_cache_length: int  # cache entries per layer and KV head when decoding ended
    stages: list[StageRecord]
    selected_indices: list[int] | None = None
    selected_text: str | None = None


def _check_positions(model: PreTrainedModel, positions: int, what: str) -> None:
    max_positions = architecture(model).max_positions
    if positions > max_positions:
        raise KvsieveError(
            f"{what} needs {positions} positions, but this model was trained for {max_positions}. "
            "Shorten the context or lower max_new_tokens, or feed the prompt in chunks with a compressed memory "
            "(--feed imdc, or feed=ChunkedPrefill(...)), which re-encodes positions and accepts any length."
        )


@dataclass
class Prefill:
    """What the stages before decoding produced: the cache to decode from and their records."""

    prefilled: Prefilled
    stages: list[StageRecord]
    seconds: float  # time to first token: selection + feed + compression + first eviction
    kv_length: int  # cache entries per layer and KV head when the first token is picked
    evict_details: dict[str, Any]
    selected: torch.Tensor | None  # GemFilter's kept prompt positions
    ids: torch.Tensor  # the ids the feed prefilled


def prefill(
    model: PreTrainedModel,
    prompt: Prompt,
    *,
    select: Selector | None = None,
    feed: Feed | None = None,
    attention: PrefillKernel | None = None,
    compress: Compressor | None = None,
    evict: Evict | None = None,
    reserve: int = 0,
) -> Prefill:
    """Run select -> feed -> compress (and start `evict`) on `prompt`; `reserve` positions follow it.

    Shared by generation and by evaluations that continue the cache their own way (perplexity).
    """
    feed = feed or FullPrefill()
    if prompt.ids.ndim != 2 or prompt.ids.shape[0] != 1:
        raise KvsieveError(f"kvsieve runs batch size 1; got prompt ids of shape {tuple(prompt.ids.shape)}.")
    if feed.needs_full_context or select is not None:
        # Full prefill and GemFilter's scoring pass both place every prompt token at its position.
        _check_positions(model, prompt.length, f"The prompt ({prompt.length} tokens)")
    stages: list[StageRecord] = []
    ids, selected = prompt.ids, None
    start = time.perf_counter()
    with attention_hooks(kernel=attention):
        if select is not None:
            selection = select.select(model, prompt)
            selected = selection.indices
            ids = prompt.ids[:, selected]
            stages.append(
                StageRecord(
                    "select", select.name, time.perf_counter() - start, {"kept": len(selected), **selection.details}
                )
            )
        if feed.needs_full_context:
            _check_positions(model, ids.shape[1] + reserve, f"Decoding {reserve} new tokens")
        feed_start = time.perf_counter()
        observers = [*(compress.observers() if compress else ()), *(evict.observers() if evict else ())]
        with attention_hooks(observers=observers):
            prefilled = feed.prefill(model, ids)
        stages.append(
            StageRecord(
                "feed", feed.name, time.perf_counter() - feed_start, {"tokens": ids.shape[1], **prefilled.details}
            )
        )
    kept = prefilled.kept_positions  # cache entries among the feed's last attended keys (None: all)
    if compress is not None:
        compress_start = time.perf_counter()
        details = compress.compress(prefilled.cache, kept)
        kept = compose_kept(kept, compress.kept_positions)
        stages.append(StageRecord("compress", compress.name, time.perf_counter() - compress_start, details))
    evict_details = evict.start(prefilled.cache, kept) if evict is not None else {}
    return Prefill(
        prefilled=prefilled,
        stages=stages,
        seconds=time.perf_counter() - start,
        kv_length=prefilled.cache.get_seq_length(),
        evict_details=evict_details,
        selected=selected,
        ids=ids,
    )


def run(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    *,
    select: Selector | None = None,
    feed: Feed | None = None,
    attention: PrefillKernel | None = None,
    compress: Compressor | None = None,
    evict: Evict | None = None,
    sampling: Sampling | None = None,
    stream: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate from an already-built `Prompt` through the chosen stages."""
    sampling = sampling or Sampling()
    sampling.validate()
    done = prefill(
        model,
        prompt,
        select=select,
        feed=feed,
        attention=attention,
        compress=compress,
        evict=evict,
        reserve=sampling.max_new_tokens,
    )
    prefilled = done.prefilled
    decoded = decode(
        model, tokenizer, prefilled.cache, prefilled.last_logits, prefilled.next_position, sampling, stream, evict
    )
    method = "sampling" if sampling.temperature else "greedy"
    stages = [*done.stages, StageRecord("decode", method, decoded.seconds, done.evict_details)]
    return GenerationResult(
        text=decoded.text,
        tokens=decoded.tokens,
        finish_reason=decoded.finish_reason,
        prompt_tokens=prompt.length,
        prefill_seconds=done.seconds,
        decode_seconds=decoded.seconds,
        decode_tokens_per_s=decoded.steps / decoded.seconds if decoded.steps else 0.0,
        prefill_kv_length=done.kv_length,
        kv_cache_length=prefilled.cache.get_seq_length(),
        stages=stages,
        selected_indices=None if done.selected is None else done.selected.tolist(),
        selected_text=None if done.selected is None else tokenizer.decode(done.ids[0]),
    )


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str | None = None,
    *,
    raw: bool = False,
    select: Selector | None = None,
    feed: Feed | None = None,
    attention: PrefillKernel | None = None,
    compress: Compressor | None = None,
    evict: Evict | None = None,
    sampling: Sampling | None = None,
    stream: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Answer `question` about `context` (chat template), or continue `context + question` (raw=True)."""
    prompt = build_prompt(tokenizer, context, question, raw=raw)
    return run(
        model,
        tokenizer,
        prompt,
        select=select,
        feed=feed,
        attention=attention,
        compress=compress,
        evict=evict,
        sampling=sampling,
        stream=stream,
    )
