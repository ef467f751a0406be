"""Runs select -> feed -> compress (and starts evict) on a prompt, and records what each stage did.

Each stage is an immutable option object (a `MethodSpec` bundles them under a name); `None` means
the stage's plain default (no selection, one-pass prefill, dense attention, no compression).
What a run learns lives in a `RunState` that is passed along and returned, so one configuration
can serve concurrent requests. The prefill attention (dense, or e.g. CritiPrefill's block-sparse one) applies
to every pass that prefills: the selector's scoring pass and the feed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsieve.attention import ATTENTION_NAME, attention_hooks
from kvsieve.compress.policy import Policy
from kvsieve.compress.stages import (
    Compress,
    CompressRun,
    EvictRun,
    PrefixSums,
    accumulating,
    sum_recorders,
)
from kvsieve.errors import KvsieveError
from kvsieve.feed import Feed, FeedOutput, PromptState
from kvsieve.feed.full import FullPrefill
from kvsieve.feed.reconstruction import second_pass_scores
from kvsieve.kv.cache import compose_kept, kv_entries, resolve_budget, wrap_cache
from kvsieve.kv.heads import carry_segments
from kvsieve.loading import tokenizer_of
from kvsieve.models import architecture
from kvsieve.prompt import Prompt
from kvsieve.select import Selector
from kvsieve.spec import MethodSpec, warn_renamed

FULL = MethodSpec("full", "full attention, one-pass prefill")  # every stage at its plain default


@dataclass
class StageRecord:
    """One stage's method, wall time and details (sizes, chosen layer, ...)."""

    stage: str
    method: str
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)


def positions_needed(stages: dict[str, Any], prompt: int, reserve: int) -> int:
    """The positions a run of `stages` on `prompt` tokens then `reserve` new tokens places (0: no bound).

    The one position rule of every entry point (generate, the evaluations, the server). A chunked
    feed re-encodes positions, so it takes any length (its answer is checked after it ran); a
    select stage's scoring pass places every prompt token, then the later stages run on the kept
    ones by this same rule; a one-pass feed places the prompt and the answer, except that a
    re-encoding eviction (StreamingLLM's `reencode`) feeds every new token at the cache's length,
    which stays within the budget (plus the interval's growth).
    """
    select, feed, evict = (stages.get(k) for k in ("select", "feed", "evict"))
    if select is not None:
        kept = round(select.k * prompt) if isinstance(select.k, float) else select.k
        after = {name: stage for name, stage in stages.items() if name != "select"}
        return max(prompt, positions_needed(after, min(kept, prompt), reserve))
    if feed is not None and not feed.one_pass:
        return 0
    if evict is None or not evict.reencodes:
        return prompt + reserve
    budget, _ = resolve_budget(evict.budget, max(prompt, 1))
    return max(prompt, min(prompt + reserve, budget + evict.interval))


def check_positions(model: PreTrainedModel, stages: dict[str, Any], prompt: int, reserve: int) -> None:
    """Refuse a run that needs more positions than the model was trained for (`positions_needed`)."""
    needed, max_positions = positions_needed(stages, prompt, reserve), architecture(model).max_positions
    if needed <= max_positions:
        return
    evict = stages.get("evict")
    streaming = evict is not None and hasattr(evict.policy, "reencode")
    raise KvsieveError(
        f"The run needs {needed} positions ({prompt} tokens in the prompt, then {reserve} new tokens), but this "
        f"model was trained for {max_positions}. Shorten the context or lower max_new_tokens, or feed the prompt in "
        "chunks with a compressed memory (--method imdc, or feed=ChunkedPrefill(...)), which re-encodes positions "
        "and accepts any length."
        + (
            " To decode a stream past the trained positions with StreamingLLM, re-encode its positions "
            "(--set evict.policy.reencode=true): kept positions break down there (docs/STUDIES.md)."
            if streaming
            else ""
        )
    )


def _check_answer_room(model: PreTrainedModel, feed: Feed, position: int, reserve: int) -> None:
    """Refuse to decode past the model's trained positions after a chunked feed, which re-encodes the
    prompt within sinks + memory + chunk but decodes on from the position after its last chunk."""
    max_positions = architecture(model).max_positions
    if position + reserve > max_positions:
        raise KvsieveError(
            f"The {feed.name} feed leaves the prompt at position {position}, so {reserve} new tokens would reach "
            f"position {position + reserve}, past the {max_positions} this model was trained for. Lower "
            "max_new_tokens, or feed.memory / feed.chunk (the last chunk starts after the sinks and the memory)."
        )


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
    scores, resolved budget, kept positions); attention: the prefill attention's per-run state (CritiPrefill's).
    """

    selected: torch.Tensor | None = None
    prefilled: FeedOutput | None = None
    compress: CompressRun | None = None
    evict: EvictRun | None = None
    attention: Any = None

    @property
    def kernel(self) -> Any:
        """`attention`'s old name, for one release (CHANGELOG.md)."""
        warn_renamed("RunState", "kernel", "attention")
        return self.attention


@dataclass
class PrefillResult:
    """What the stages before decoding produced: the cache to decode from and their records."""

    prefilled: FeedOutput
    stages: list[StageRecord]
    seconds: float  # time to first token: selection + feed + compression + first eviction
    kv_length: int  # cache entries per layer and KV head when the first token is picked
    evict_details: dict[str, Any]
    ids: torch.Tensor  # the ids the feed prefilled
    state: RunState
    stored: PromptState | None = None  # the prefix state `keep` asked for


def prefill(
    model: PreTrainedModel,
    prompt: Prompt,
    method: MethodSpec = FULL,
    *,
    reserve: int = 0,
    prefix: PromptState | None = None,
    keep: int = 0,
    store_with: Compress | None = None,
    prompt_logits: bool = False,
) -> PrefillResult:
    """Run `method`'s select -> feed -> compress (and start its evict) on `prompt`; `reserve` positions follow it.

    `method` is a MethodSpec (the entry points look a preset's name up in the registry); its stage objects are never
    changed, so one configuration may serve concurrent runs. Shared by generation (`engine.request`) and by
    evaluations that continue the cache their own way (perplexity, through `engine.continuation`).

    Context reuse (`spec.continues_prefix`, `engine.prefix_cache.reuse_tail`): `prefix` is a stored state of the
    prompt's first `prefix.length` tokens (the one-pass feed's cache, or the select stage's pass up to its filter
    layer), which then are not run again; `keep` > 0 runs the first `keep` tokens as a pass of their own and returns
    their state in `PrefillResult.stored`. Either way selection, compression and eviction see the whole prompt.
    `store_with` (a one-pass feed only) compresses the stored state with its policy, which sees the prefix's own
    queries only (no question), to its budget; this run then goes on from that compressed state too, so the first
    request on a prefix answers as every later one does. `prompt_logits` keeps the logits of every prompt position
    (`FeedOutput.logits`): only a dense one-pass feed of the whole prompt computes them (`spec.prompt_logprobs`).
    """
    if not isinstance(method, MethodSpec):
        raise KvsieveError(
            f"prefill takes a MethodSpec, got {method!r}; look a preset up by name with kvsieve.method({method!r})."
        )
    spec = method
    feed = spec.feed or FullPrefill()
    _check_run(model, spec, feed, prompt, reserve, prefix, keep, store_with, prompt_logits)
    state = RunState(
        compress=spec.compress.begin() if spec.compress is not None else None,
        evict=spec.evict.begin() if spec.evict is not None else None,
        attention=spec.attention.begin() if spec.attention is not None else None,
    )
    records: list[StageRecord] = []
    ids = prompt.ids.to(model.device)
    start = time.perf_counter()
    stored = None
    with attention_hooks(prefill=state.attention):
        if spec.select is not None:
            selected = replace(prompt, ids=ids)
            state.selected, record, stored = select_tokens(model, selected, spec.select, prefix=prefix, keep=keep)
            ids = ids[:, state.selected]
            records.append(record)
            prefix, keep = None, 0  # the feed runs the kept tokens afresh
        runs = [run for run in (state.compress, state.evict) if run is not None]
        if feed.one_pass:
            prefilled, record, kept = _feed_one_pass(model, feed, ids, runs, prefix, keep, store_with, prompt_logits)
            stored = kept or stored
        else:
            prefilled, record = _feed_chunked(model, feed, ids, runs, question=prompt.tail_len)
        records.append(record)
    if not feed.one_pass:  # a chunked feed's own rule: its answer starts after its last chunk
        _check_answer_room(model, feed, prefilled.next_position, reserve)
    state.prefilled = prefilled
    kept = prefilled.kept_positions  # cache entries among the feed's last attended keys (None: all)
    if state.compress is not None:
        compress_start = time.perf_counter()
        if state.compress.rereads:  # its second pass over the cache, which holds `ids` (a one-pass feed's)
            policy = state.compress.config.policy
            state.compress.scores = second_pass_scores(model, prefilled.cache, ids, policy, encoder(model))
        details = state.compress.compress(prefilled.cache, kept)
        kept = compose_kept(kept, state.compress.kept_positions)
        records.append(StageRecord("compress", spec.compress.name, time.perf_counter() - compress_start, details))
    evict_details = state.evict.start(prefilled.cache, kept, model) if state.evict is not None else {}
    return PrefillResult(
        prefilled=prefilled,
        stages=records,
        seconds=time.perf_counter() - start,
        kv_length=kv_entries(prefilled.cache),
        evict_details=evict_details,
        ids=ids,
        state=state,
        stored=stored,
    )


def _check_run(
    model: PreTrainedModel,
    spec: MethodSpec,
    feed: Feed,
    prompt: Prompt,
    reserve: int,
    prefix: PromptState | None,
    keep: int,
    store_with: Compress | None,
    prompt_logits: bool,
) -> None:
    """Refuse a run whose stages, prompt, stored prefix or positions do not fit together, saying why."""
    if spec.evict is not None and spec.evict.reencodes and not feed.one_pass:
        raise KvsieveError(
            f"{spec.evict.name}'s reencode starts from a one-pass prefill, whose keys sit at positions 0 .. n-1; the "
            f"{feed.name} feed leaves its cache in its own position frame. Drop evict.policy.reencode, or use the "
            "full feed (a chunked feed already re-encodes positions while it prefills)."
        )
    check_prepared(model)
    for stage in spec.stages().values():  # settings that depend on the model (CritiPrefill's dense layers)
        if hasattr(stage, "check_model"):
            stage.check_model(architecture(model))
    if prompt.ids.ndim != 2 or prompt.ids.shape[0] != 1:
        raise KvsieveError(
            f"A prompt is one row of token ids, shape (1, n); got {tuple(prompt.ids.shape)}. "
            "For a batch, pass a list of prompts to kvsieve.run (or of contexts to kvsieve.generate)."
        )
    start_at = prefix.length if prefix is not None else 0
    if (prefix is not None or keep) and not spec.continues_prefix:
        raise KvsieveError(
            "Only a select stage or a one-pass feed without a prefill attention stage continues a stored prefix."
        )
    if prompt_logits and (not spec.prompt_logprobs or prefix is not None or keep):
        raise KvsieveError(
            "Prompt log-probabilities (echo with logprobs) need the whole prompt in one dense pass: a method "
            "without a select stage, a prefill attention stage or a chunked feed (full, snapkv, h2o, a2sf, ...), "
            "and no reused prefix."
        )
    if store_with is not None and (spec.select is not None or not keep):
        raise KvsieveError("store_with compresses the prefix state that `keep` stores after a one-pass feed.")
    if spec.compress is not None and "second_pass" in spec.compress.policy.reads and not feed.one_pass:
        raise KvsieveError(
            f"{spec.compress.policy.name} scores a second pass over the prompt's whole cache; the {feed.name} feed "
            "leaves a pruned one. Use it after the full feed."
        )
    if spec.compress is not None and spec.compress.head_budgets and (spec.evict is not None or not feed.one_pass):
        raise KvsieveError(
            "compress.head_budgets leaves each KV head its own count of entries, which an evict stage (one count "
            "per head while decoding) and a chunked feed (which prunes its memory itself) do not take; use it with "
            "the full feed and no evict stage."
        )
    if start_at >= prompt.length or (keep and not start_at < keep < prompt.length):
        raise KvsieveError(f"A stored prefix ({start_at} / {keep} tokens) must leave prompt tokens to run.")
    check_positions(model, spec.stages(), prompt.length, reserve)


def _feed_one_pass(
    model: PreTrainedModel,
    feed: FullPrefill,
    ids: torch.Tensor,
    runs: list[CompressRun | EvictRun],
    prefix: PromptState | None,
    keep: int,
    store_with: Compress | None,
    prompt_logits: bool,
) -> tuple[FeedOutput, StageRecord, PromptState | None]:
    """The one-pass feed of `ids`, from `prefix`'s state where given (its tokens not run again), the first `keep`
    tokens first as a pass of their own whose state is returned (compressed by `store_with`); the first pruning
    stage cuts each layer right after its attention (a lower peak)."""
    start = time.perf_counter()
    cache = prefix.cache if prefix is not None else DynamicCache(config=model.config)
    sums = prefix.sums if prefix is not None else None
    position = prefix.position if prefix is not None else 0
    start_at = prefix.length if prefix is not None else 0
    stored = None
    if keep:
        alphas = accumulating([run.config.policy for run in runs])
        part = ids[:, start_at:keep]
        stored = prefix_states(model, part, cache, position, sums, alphas, [store_with], context=ids[:, :keep])[0]
        start_at, sums, position = keep, stored.sums, keep
        if stored.compressed:  # go on from the state later requests will start from
            cache = _snapshot(model, stored.cache)
    context_entries = kv_entries(cache)
    compressed = kv_entries(cache, least=True) < position  # a context compressed without what follows (agnostic reuse)
    if compressed:  # the new tokens are appended to it; nothing is pruned again with their scores
        for run in runs:
            run.hold(context_entries + ids.shape[1] - start_at)
    # After a context compressed without the question, the question's pass scores nothing (`score_observers`).
    arch = architecture(model)
    observers = [observer for run in runs for observer in run.observers(sums, blind=compressed, arch=arch)]
    finishers = [runs[0].finisher(cache)] if runs and not compressed else []
    with attention_hooks(last_pass=observers, finishers=finishers):
        prefilled = feed.prefill(model, ids[:, start_at:], cache=cache, position=position, every_logit=prompt_logits)
    details = {"tokens": ids.shape[1] - (prefix.length if prefix is not None else 0), **prefilled.details}
    if prefix is not None:
        details["reused_tokens"] = prefix.length
    if compressed:
        details["context_entries"] = context_entries  # the compressed context the question's pass saw
    return prefilled, StageRecord("feed", feed.name, time.perf_counter() - start, details), stored


def _feed_chunked(
    model: PreTrainedModel, feed: Feed, ids: torch.Tensor, runs: list[CompressRun | EvictRun], question: int
) -> tuple[FeedOutput, StageRecord]:
    """A chunked feed of `ids`; the prompt's `question` last tokens (kept by a select stage) can guide its pruning,
    and the compress and evict stages observe its last pass."""
    start = time.perf_counter()
    arch = architecture(model)
    with attention_hooks(last_pass=[observer for run in runs for observer in run.observers(arch=arch)]):
        prefilled = feed.prefill(model, ids, question=question)
    details = {"tokens": ids.shape[1], **prefilled.details}
    return prefilled, StageRecord("feed", feed.name, time.perf_counter() - start, details)


def select_tokens(
    model: PreTrainedModel,
    prompt: Prompt,
    select: Selector,
    attention: Any = None,
    *,
    prefix: PromptState | None = None,
    keep: int = 0,
) -> tuple[torch.Tensor, StageRecord, PromptState | None]:
    """The select stage on `prompt`: the kept positions (ascending), its record, and the prefix state `keep` asked for.

    `attention` (a prefill attention stage such as CritiPrefill) runs the selection pass; inside
    `prefill` the run's own is already active. The one place a select stage is called:
    generation, `kvsieve inspect` and the server's --upstream relay. Context reuse: the selection
    pass up to the filter layer does not depend on the question, so `prefix` (a stored state of
    those layers over the prompt's first tokens) is continued, and `keep` > 0 first runs the first
    `keep` tokens on their own and returns their state.
    """
    start = time.perf_counter()
    run = attention.begin() if attention is not None else None
    ids = prompt.ids.to(model.device)
    cache, stored = (prefix.cache if prefix is not None else None), None
    with attention_hooks(prefill=run):
        if keep:
            cache = cache if cache is not None else DynamicCache(config=model.config)
            select.first_pass(model, ids[:, cache.get_seq_length() : keep], cache)
            stored = PromptState(_snapshot(model, cache), keep, keep)
        selection = select.select(model, replace(prompt, ids=ids), cache)
    details = {"kept": len(selection.indices), **selection.details}
    return selection.indices, StageRecord("select", select.name, time.perf_counter() - start, details), stored


def encoder(model: PreTrainedModel) -> Callable[[str], list[int]]:
    """Text to `model`'s token ids (no special tokens), with the tokenizer it was loaded with (`tokenizer_of`): a
    policy's second pass writes its own prompt (KVzip's "repeat the previous context")."""
    try:
        tokenizer = tokenizer_of(model)
    except KvsieveError:
        raise KvsieveError(
            "This method's second pass writes its own prompt (KVzip's 'Repeat the previous context'), which needs the "
            "model's tokenizer: load the model with kvsieve.load_model, or run it through kvsieve.run / generate / "
            "the server, which are given one."
        ) from None
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def _snapshot(model: PreTrainedModel, cache: DynamicCache) -> DynamicCache:
    """A cache sharing `cache`'s tensors as they are now (later passes replace them, never change them);
    layers it has not filled yet (those above a select stage's filter layer) stay empty."""
    layers = [(layer.keys, layer.values) for layer in cache.layers if layer.is_initialized]
    return carry_segments(cache, wrap_cache(model, layers, cache.get_seq_length()), share=True)


def prefix_states(
    model: PreTrainedModel,
    ids: torch.Tensor,
    cache: DynamicCache,
    position: int,
    prior: PrefixSums | None,
    alphas: list[float],
    squeezes: list[Compress | None],
    context: torch.Tensor | None = None,
) -> list[PromptState]:
    """Run `ids` onto `cache` (at `position`) as a one-pass prefill of their own and return, per entry of `squeezes`,
    the prefix state they end in: the exact state for None, else that state compressed by the Compress.

    The sums of `alphas` (accumulating policies, continuing `prior`'s) are recorded; nothing is pruned in `cache`,
    so the exact state is what any later prompt that starts with these tokens would compute. A compressed state is
    cut to its budget by its policy's scores of this pass (the prefix's own queries: query-agnostic), its sums
    gathered alike; a squeeze whose policy reads a second pass (KVzip) runs it over `context`, every token the cache
    holds (default: `ids`, from position 0). One pass serves every squeeze: a sweep of reuse budgets and policies over
    one context prefills it once (`engine.fill_prefix_caches`); the squeezes only observe, so each state is the one a
    pass for it alone gives, as long as the accumulated sums (`alphas`), which choose the attention's path, are the
    same.
    """
    runs = [squeeze.begin() if squeeze is not None else None for squeeze in squeezes]
    sums: dict[float, dict[int, torch.Tensor]] = {}
    observers = sum_recorders(alphas, sums, prior)
    arch = architecture(model)
    observers += [observer for run in runs if run is not None for observer in run.observers(prior, arch=arch)]
    with attention_hooks(observers=observers, intermediate=True):
        FullPrefill().prefill(model, ids, cache=cache, position=position)
    length = position + ids.shape[1]
    states = []
    reread: dict[Policy, dict[int, torch.Tensor]] = {}  # a policy's second pass runs once, whatever the budgets
    for run in runs:
        kept_sums = {alpha: dict(by_layer) for alpha, by_layer in sums.items()}
        state = PromptState(_snapshot(model, cache), length, length, PrefixSums(length, kept_sums) if alphas else None)
        if run is not None:
            run.resolve_budget(length)
            if run.rereads:
                whole = context if context is not None else ids
                if whole.shape[1] != length:
                    raise KvsieveError("A second pass reads every token of the prefix: pass them all as context.")
                policy = run.config.policy
                if policy not in reread:
                    reread[policy] = second_pass_scores(model, state.cache, whole, policy, encoder(model))
                run.scores = dict(reread[policy])
            run.compress(state.cache)
            for by_layer in kept_sums.values():  # the scored layers' sums (a hybrid model's sliding layers have none)
                for layer in by_layer:
                    by_layer[layer] = by_layer[layer].gather(1, run.kept_positions[layer])
        states.append(state)
    return states


def __getattr__(name: str) -> object:
    """`Prefill`, `PrefillResult`'s old name, for one release (CHANGELOG.md)."""
    if name == "Prefill":
        warn_renamed("kvsieve.engine.pipeline", "Prefill", "PrefillResult")
        return PrefillResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
