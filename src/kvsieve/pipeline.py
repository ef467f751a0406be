"""Runs select -> feed -> compress -> decode and records what each stage did (DESIGN.md's flow).

Each stage is an immutable option object (a `MethodSpec` bundles them under a name); `None` means
the stage's plain default (no selection, one-pass prefill, dense attention, no compression).
What a run learns lives in a `RunState` that is passed along and returned, so one configuration
can serve concurrent requests. The prefill attention kernel (dense or e.g. CritiPrefill) applies
to every pass that prefills: the selector's scoring pass and the feed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.attention import ATTENTION_NAME, attention_hooks
from kvsieve.compress.cache import compose_kept, resolve_budget
from kvsieve.compress.stages import Compress, CompressRun, Evict, EvictRun
from kvsieve.decode import Sampling, decode
from kvsieve.errors import KvsieveError
from kvsieve.feed import Feed, Prefilled
from kvsieve.feed.full import FullPrefill
from kvsieve.models import architecture
from kvsieve.prompt import Prompt, build_prompt
from kvsieve.select import Selector
from kvsieve.spec import MethodSpec


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
    state: RunState | None = field(default=None, repr=False)  # what the run learned (tensors; not in to_dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: everything but the per-run state."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "state"}
        data["stages"] = [asdict(stage) for stage in self.stages]
        return data


def _check_positions(model: PreTrainedModel, positions: int, what: str, evict: Evict | None = None) -> None:
    max_positions = architecture(model).max_positions
    if positions > max_positions:
        streaming = evict is not None and hasattr(evict.policy, "reencode")
        raise KvsieveError(
            f"{what} needs {positions} positions, but this model was trained for {max_positions}. "
            "Shorten the context or lower max_new_tokens, or feed the prompt in chunks with a compressed memory "
            "(--method imdc, or feed=ChunkedPrefill(...)), which re-encodes positions and accepts any length."
            + (
                " To decode a stream past the trained positions with StreamingLLM, re-encode its positions "
                "(--set evict.policy.reencode=true): kept positions break down there (docs/STUDIES.md)."
                if streaming
                else ""
            )
        )


def _decode_positions(prompt: int, reserve: int, evict: Evict | None) -> int:
    """Positions a one-pass prefill of `prompt` tokens and `reserve` decoding steps use.

    Re-encoding eviction feeds every token at the cache's length, which stays within the
    budget (plus the interval's growth), so a stream can outlast the model's positions.
    """
    if evict is None or not evict.reencodes:
        return prompt + reserve
    budget, _ = resolve_budget(evict.budget, max(prompt, 1))
    return max(prompt, min(prompt + reserve, budget + evict.interval))


def check_prepared(model: PreTrainedModel) -> None:
    """Refuse a model whose attention does not run through kvsieve (its stages would see nothing)."""
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        raise KvsieveError(
            f"This model's attention runs through '{model.config._attn_implementation}', not kvsieve's, so no stage "
            "could observe or change it. Load it with kvsieve.load_model(...), or call kvsieve.prepare(model) once "
            "on a model you loaded yourself."
        )


@dataclass
class RunState:
    """What one run learned, returned rather than stored in the (immutable) stage objects.

    selected: GemFilter's kept prompt positions; prefilled: the feed's output (cache, kept
    positions, chunk history); compress / evict: the per-run state of those stages (their
    scores, resolved budget, kept positions); kernel: the prefill attention kernel's state.
    """

    selected: torch.Tensor | None = None
    prefilled: Prefilled | None = None
    compress: CompressRun | None = None
    evict: EvictRun | None = None
    kernel: Any = None


@dataclass
class Prefill:
    """What the stages before decoding produced: the cache to decode from and their records."""

    prefilled: Prefilled
    stages: list[StageRecord]
    seconds: float  # time to first token: selection + feed + compression + first eviction
    kv_length: int  # cache entries per layer and KV head when the first token is picked
    evict_details: dict[str, Any]
    ids: torch.Tensor  # the ids the feed prefilled
    state: RunState

    @property
    def selected(self) -> torch.Tensor | None:
        return self.state.selected


def _resolve_stages(method: MethodSpec | str | None, stages: dict[str, Any]) -> dict[str, Any]:
    """The stage objects of `method`, or the ones given one by one (not both)."""
    if method is None:
        return stages
    given = [name for name, value in stages.items() if value is not None]
    if given:
        raise KvsieveError(
            f"Give either a method or stage objects, not both (got method and {', '.join(given)}); "
            "change a method's stages with its settings instead, e.g. method.with_setting('compress.budget', 512)."
        )
    from kvsieve.registry import method as lookup

    return lookup(method).stages()


def prefill(
    model: PreTrainedModel,
    prompt: Prompt,
    *,
    method: MethodSpec | str | None = None,
    select: Selector | None = None,
    feed: Feed | None = None,
    attention: Any = None,
    compress: Compress | None = None,
    evict: Evict | None = None,
    reserve: int = 0,
) -> Prefill:
    """Run select -> feed -> compress (and start `evict`) on `prompt`; `reserve` positions follow it.

    Stages come from `method` (a registered name or a MethodSpec) or are given one by one; the
    stage objects are never changed, so one configuration may serve concurrent runs. Shared by
    generation and by evaluations that continue the cache their own way (perplexity).
    """
    stages = _resolve_stages(
        method, {"select": select, "feed": feed, "attention": attention, "compress": compress, "evict": evict}
    )
    select, attention, compress, evict = (stages.get(k) for k in ("select", "attention", "compress", "evict"))
    feed = stages.get("feed") or FullPrefill()
    if evict is not None and evict.reencodes and not feed.needs_full_context:
        raise KvsieveError(
            f"{evict.name}'s reencode starts from a one-pass prefill, whose keys sit at positions 0 .. n-1; the "
            f"{feed.name} feed leaves its cache in its own position frame. Drop evict.policy.reencode, or use the "
            "full feed (a chunked feed already re-encodes positions while it prefills)."
        )
    check_prepared(model)
    if prompt.ids.ndim != 2 or prompt.ids.shape[0] != 1:
        raise KvsieveError(f"kvsieve runs batch size 1; got prompt ids of shape {tuple(prompt.ids.shape)}.")
    if feed.needs_full_context or select is not None:
        # Full prefill and GemFilter's scoring pass both place every prompt token at its position.
        _check_positions(model, prompt.length, f"The prompt ({prompt.length} tokens)")
    state = RunState(
        compress=compress.begin() if compress is not None else None,
        evict=evict.begin() if evict is not None else None,
        kernel=attention.begin() if attention is not None else None,
    )
    records: list[StageRecord] = []
    ids = prompt.ids.to(model.device)
    start = time.perf_counter()
    with attention_hooks(kernel=state.kernel):
        if select is not None:
            selection = select.select(model, Prompt(ids, prompt.context_start, prompt.context_len))
            state.selected = selection.indices
            ids = ids[:, selection.indices]
            records.append(
                StageRecord(
                    "select", select.name, time.perf_counter() - start, {"kept": ids.shape[1], **selection.details}
                )
            )
        if feed.needs_full_context:
            _check_positions(
                model, _decode_positions(ids.shape[1], reserve, evict), f"Decoding {reserve} new tokens", evict
            )
        feed_start = time.perf_counter()
        runs = [run for run in (state.compress, state.evict) if run is not None]
        observers = [observer for run in runs for observer in run.observers()]
        if isinstance(feed, FullPrefill) and runs:
            # One pass: the first pruning stage cuts each layer right after its attention (lower peak).
            cache = DynamicCache(config=model.config)
            with attention_hooks(last_pass=observers, finishers=[runs[0].finisher(cache)]):
                prefilled = feed.prefill(model, ids, cache=cache)
        else:
            with attention_hooks(last_pass=observers):
                prefilled = feed.prefill(model, ids)
        records.append(
            StageRecord(
                "feed", feed.name, time.perf_counter() - feed_start, {"tokens": ids.shape[1], **prefilled.details}
            )
        )
    state.prefilled = prefilled
    kept = prefilled.kept_positions  # cache entries among the feed's last attended keys (None: all)
    if state.compress is not None:
        compress_start = time.perf_counter()
        details = state.compress.compress(prefilled.cache, kept)
        kept = compose_kept(kept, state.compress.kept_positions)
        records.append(StageRecord("compress", compress.name, time.perf_counter() - compress_start, details))
    evict_details = state.evict.start(prefilled.cache, kept, model) if state.evict is not None else {}
    return Prefill(
        prefilled=prefilled,
        stages=records,
        seconds=time.perf_counter() - start,
        kv_length=prefilled.cache.get_seq_length(),
        evict_details=evict_details,
        ids=ids,
        state=state,
    )


def run(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    *,
    method: MethodSpec | str | None = None,
    select: Selector | None = None,
    feed: Feed | None = None,
    attention: Any = None,
    compress: Compress | None = None,
    evict: Evict | None = None,
    sampling: Sampling | None = None,
    stream: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate from an already-built `Prompt` through `method`'s stages (or stages given one by one)."""
    sampling = sampling or Sampling()
    sampling.validate()
    done = prefill(
        model,
        prompt,
        method=method,
        select=select,
        feed=feed,
        attention=attention,
        compress=compress,
        evict=evict,
        reserve=sampling.max_new_tokens,
    )
    prefilled = done.prefilled
    decoded = decode(
        model,
        tokenizer,
        prefilled.cache,
        prefilled.last_logits,
        prefilled.next_position,
        sampling,
        stream,
        done.state.evict,
    )
    kind = "sampling" if sampling.temperature else "greedy"
    stages = [*done.stages, StageRecord("decode", kind, decoded.seconds, done.evict_details)]
    selected = done.state.selected
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
        selected_indices=None if selected is None else selected.tolist(),
        selected_text=None if selected is None else tokenizer.decode(done.ids[0]),
        state=done.state,
    )


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str | None = None,
    *,
    raw: bool = False,
    method: MethodSpec | str | None = None,
    select: Selector | None = None,
    feed: Feed | None = None,
    attention: Any = None,
    compress: Compress | None = None,
    evict: Evict | None = None,
    sampling: Sampling | None = None,
    stream: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Answer `question` about `context` (chat template), or continue `context + question` (raw=True).

    `method` is a registered name ("snapkv") or a MethodSpec (`kvsieve.method("snapkv", {...})`);
    alternatively pass the stage objects one by one.
    """
    prompt = build_prompt(tokenizer, context, question, raw=raw)
    return run(
        model,
        tokenizer,
        prompt,
        method=method,
        select=select,
        feed=feed,
        attention=attention,
        compress=compress,
        evict=evict,
        sampling=sampling,
        stream=stream,
    )
