"""The library's entry points: `run` and `generate` drive requests to the end through the scheduler.

As vLLM's offline `LLM.generate` and its server share one engine core, these use the same
request lifecycle and scheduler as `kvsieve serve`: given a list of prompts they run them as one
batch (decoding steps shared, prefills in turn), given one they return one result.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from kvsieve import registry
from kvsieve.compress.stages import Compress, Evict
from kvsieve.decode import Sampling
from kvsieve.engine.events import Event, Failed, Finished, GenerationResult, Text
from kvsieve.engine.prefix_cache import PrefixCache, reuse_compress
from kvsieve.engine.request import Request
from kvsieve.engine.scheduler import Scheduler
from kvsieve.errors import KvsieveError
from kvsieve.feed import Feed
from kvsieve.prompt import Prompt, build_prompt
from kvsieve.select import Selector
from kvsieve.spec import MethodSpec

# What `run` and `generate` return: one result for one prompt, a list for a list of prompts, and with sampling.n > 1
# each prompt's n results.
Results = GenerationResult | list[GenerationResult] | list[list[GenerationResult]]
STAGES = ("select", "feed", "attention", "compress", "evict")  # a method's stages, as `run` takes them one by one


def resolve_method(method: MethodSpec | str | None, stages: dict[str, Any]) -> MethodSpec:
    """`method` (a registered name or a spec), or a spec of the stage objects given one by one (not both)."""
    given = {name: value for name, value in stages.items() if value is not None}
    if method is None:
        return MethodSpec("custom", "stages given one by one", **given)
    if given:
        raise KvsieveError(
            f"Give either a method or stage objects, not both (got method and {', '.join(given)}); "
            "change a method's stages with its settings instead, e.g. method.with_setting('compress.budget', 512)."
        )
    return registry.method(method)


def run(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt | Sequence[Prompt],
    *,
    method: MethodSpec | str | None = None,
    select: Selector | None = None,
    feed: Feed | None = None,
    attention: Any = None,
    compress: Compress | None = None,
    evict: Evict | None = None,
    sampling: Sampling | None = None,
    stream: Callable[[str], None] | BaseStreamer | None = None,
    max_batch: int = 16,
    prefix_cache: PrefixCache | None = None,
) -> Results:
    """Generate from built `Prompt`s through `method`'s stages (or stages given one by one).

    A list of prompts runs as a batch of at most `max_batch` at a time; `stream` receives the
    answer's text as it becomes final (one prompt only), or is a transformers streamer (`TextStreamer`,
    `TextIteratorStreamer`): it gets the prompt's ids, then the answer's as their text becomes final, then `end()`,
    as transformers' `generate` feeds it. The first failure raises its error.
    With `sampling.n` > 1 each prompt gives a list of its n answers, all decoded from one prefill.
    With `prefix_cache` each prompt stores the state of its context (everything before its question) there, and
    prompts that start with a stored context continue from it (`prefill_with_reuse`): prompts prefill in turn, so
    the questions of one context prefill it once.
    """
    sampling = sampling or Sampling()
    sampling.validate()
    stages = (select, feed, attention, compress, evict)
    spec = resolve_method(method, dict(zip(STAGES, stages, strict=True)))
    prompts = [prompt] if isinstance(prompt, Prompt) else list(prompt)
    if stream is not None and (len(prompts) != 1 or sampling.n > 1):
        raise KvsieveError("stream= takes one answer: one prompt and one question (n = 1); run the others without it.")
    emit = None if stream is None else _events_to(stream, prompts[0].ids[0])
    scheduler = Scheduler(model, tokenizer, max_batch=max_batch, prefix_cache=prefix_cache)
    requests = [Request(p, spec, sampling, emit, boundary=p.context_start + p.context_len) for p in prompts]
    scheduler.run_to_end(requests)
    if sampling.n > 1:  # each prompt's n answers, sampled from its one prefill
        results: list = [[finished(answer) for answer in (request, *request.forks)] for request in requests]
    else:
        results = [finished(request) for request in requests]
    return results[0] if isinstance(prompt, Prompt) else results


def finished(request: Request) -> GenerationResult:
    """A request's result once the scheduler ran it to the end (it raised otherwise)."""
    if request.result is None:
        raise RuntimeError("A request ended without a result: a bug in the scheduler, not in the call.")
    return request.result


def _events_to(stream: Callable[[str], None] | BaseStreamer, prompt: torch.Tensor) -> Callable[[Event], None]:
    """What a request's events give `run`'s `stream`: text pieces, or a transformers streamer's token ids."""
    if not isinstance(stream, BaseStreamer):

        def text(event: Event) -> None:
            if isinstance(event, Text):
                stream(event.piece)

        return text
    stream.put(prompt.cpu())

    def tokens(event: Event) -> None:
        if isinstance(event, Text | Finished) and event.ids:
            stream.put(torch.tensor(event.ids, device="cpu"))  # a streamer reads ids on the CPU, as generate puts them
        if isinstance(event, Finished | Failed):
            stream.end()

    return tokens


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str | Sequence[str],
    question: str | Sequence[str] | None = None,
    *,
    raw: bool = False,
    reuse_budget: int | float | None = None,
    **options: Any,
) -> Results:
    """Answer `question` about `context` (chat template), or continue `context + question` (raw=True).

    `method` is a registered name ("snapkv") or a MethodSpec (`kvsieve.method("snapkv", {...})`);
    alternatively pass the stage objects one by one; the other options are `run`'s. Lists of
    contexts (and as many questions, or one for all) run as one batch and give a list of results.
    One context with a list of questions prefills the context once and answers every question from it (a list of
    results): exactly as each alone with `reuse_budget` None; with a budget (a count of KV entries or a fraction of
    the context) the context is kept compressed by the method's scorer before any question is known
    (question-agnostic, `kvsieve.engine.reuse_compress`), and every question continues from that.
    """
    if isinstance(context, str) and (question is None or isinstance(question, str)):
        if reuse_budget is not None:
            raise KvsieveError("reuse_budget keeps one context for several questions: pass a list of questions.")
        return run(model, tokenizer, build_prompt(tokenizer, context, question, raw=raw), **options)
    if isinstance(context, str):
        questions = list(cast(Sequence[str], question))
        if not questions:
            raise KvsieveError("questions is empty; give at least one question.")
        empty = [i for i, q in enumerate(questions) if not isinstance(q, str) or not q.strip()]
        if empty:
            raise KvsieveError(f"questions[{empty[0]}] is empty; every question needs some text.")
        spec = resolve_method(options.pop("method", None), {name: options.pop(name, None) for name in STAGES})
        if reuse_budget is not None and reuse_compress(spec, reuse_budget) is None:
            raise KvsieveError(
                f"Method '{spec.name}' has no scorer that compresses a context before its question (full attention, "
                "a select stage, re-encoded positions): leave reuse_budget out."
            )
        prompts = [build_prompt(tokenizer, context, q, raw=raw) for q in questions]
        cache = PrefixCache(model, sys.maxsize, reuse_budget)  # holds this context's state only
        return run(model, tokenizer, prompts, method=spec, prefix_cache=cache, **options)
    if reuse_budget is not None:
        raise KvsieveError("reuse_budget keeps one context for several questions, not a list of contexts.")
    contexts = list(context)
    questions = [question] * len(contexts) if question is None or isinstance(question, str) else list(question)
    if len(questions) != len(contexts):
        raise ValueError(f"{len(contexts)} contexts but {len(questions)} questions; give one per context, or one.")
    prompts = [build_prompt(tokenizer, c, q, raw=raw) for c, q in zip(contexts, questions, strict=True)]
    return run(model, tokenizer, prompts, **options)
