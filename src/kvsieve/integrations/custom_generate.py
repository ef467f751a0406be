"""kvsieve inside transformers' own `generate`: `model.generate(**inputs, custom_generate=kvsieve.decoding("snapkv"))`.

transformers 5 runs a callable `custom_generate` as the decoding method after its own preparation (the generation
config merged from the model's and the call's, the logits processors and stopping criteria built from it). The
callable `decoding` returns hands every row of the batch to the engine as a prompt (padding removed) whose question is
its tail by the library's one rule for a prompt that names none (`kvsieve.prompt.ids_prompt`, as the server's
`/v1/completions`), decodes with kvsieve's sampler set from the generation config (`generation_config.sampling_of`),
and returns what `generate` returns: the prompts followed by the new tokens (right-padded with the pad id), or with
`return_dict_in_generate` a `GenerateDecoderOnlyOutput` with `scores` (each step's logits through the call's own
logits processors, as transformers computes them) and `logits` where asked. A `streamer` given to `generate` receives
the answer as its text becomes final, then `end()`.

What the engine cannot do here is refused by name rather than silently ignored (`refuse_what_it_cannot_do`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from kvsieve.engine import GenerationResult, resolve_method, run
from kvsieve.errors import KvsieveError
from kvsieve.integrations.generation_config import ASSISTED, check_eos, refuse_what_it_cannot_do, sampling_of
from kvsieve.preparation import prepare
from kvsieve.prompt import ids_prompt
from kvsieve.spec import MethodSpec


def decoding(
    method: MethodSpec | str = "full", settings: Mapping[str, Any] | None = None, tokenizer: Any = None
) -> Callable[..., Any]:
    """A decoding method for `model.generate(..., custom_generate=kvsieve.decoding(method))` that runs `method` (a
    registered name or a `MethodSpec`, its fields changed by `settings` as `--set` does: {"compress.budget": 0.25}).
    A bad method or setting fails here, before any generation. `tokenizer` lets the stand-in question end at its
    sentence's start (`kvsieve.prompt.question_tail`) and a streamer get text as it becomes final: transformers hands
    a callable `custom_generate` no `tokenizer=` of the `generate` call (it keeps that one for its own stopping
    criteria), so it is given here."""
    spec = resolve_method(method, {}).with_settings(dict(settings or {}))

    def kvsieve_decoding(
        model: PreTrainedModel,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        **model_kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        refuse_what_it_cannot_do(generation_config, logits_processor, stopping_criteria)
        if generate_argument(model, "assistant_model") is not None:
            raise KvsieveError(ASSISTED)
        prepare(model)  # kvsieve's attention (plain causal SDPA where no stage hooks in); a no-op once prepared
        streamer = generate_argument(model, "streamer")
        if streamer is not None and input_ids.shape[0] > 1:
            raise KvsieveError(f"A streamer takes one prompt; this batch has {input_ids.shape[0]}.")
        # The text decides when streamed tokens are final and where the stand-in question's sentence starts: the
        # tokenizer given to `decoding`, else the streamer's, else none (token ids only).
        text = tokenizer if tokenizer is not None else getattr(streamer, "tokenizer", None) or IdsOnly()
        streamer = cast(BaseStreamer | None, streamer)
        check_eos(model, text, generation_config)
        mask = model_kwargs.get("attention_mask")
        rows = [row[mask[i].bool()] if mask is not None else row for i, row in enumerate(input_ids)]
        prompts = [ids_prompt(row.tolist(), device=input_ids.device, tokenizer=text) for row in rows]
        sampling = sampling_of(generation_config, input_ids.shape[1])
        if streamer is not None:
            results = [cast(GenerationResult, run(model, text, prompts[0], method=spec, sampling=sampling,
                                                  stream=AfterPrompt(streamer)))]  # fmt: skip
        else:  # a list of prompts gives a list: one result each (sampling.n is 1)
            results = cast(list[GenerationResult], run(model, text, prompts, method=spec, sampling=sampling))
        pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
        longest = max(len(result.tokens) for result in results)
        padded = [result.tokens + [pad] * (longest - len(result.tokens)) for result in results]
        new = torch.tensor(padded, dtype=input_ids.dtype, device=input_ids.device)
        sequences = torch.cat([input_ids, new], dim=1)
        if not generation_config.return_dict_in_generate:
            return sequences
        logits = step_logits(results, longest) if sampling.keep_logits else None
        scores = None
        if logits is not None and generation_config.output_scores:
            start = input_ids.shape[1]
            scores = tuple(logits_processor(sequences[:, : start + t], step.clone()) for t, step in enumerate(logits))
        return GenerateDecoderOnlyOutput(
            sequences=sequences, scores=scores, logits=logits if generation_config.output_logits else None
        )

    kvsieve_decoding.__doc__ = f"kvsieve's decoding with method {spec.name} ({spec.describe()})."
    return kvsieve_decoding


def step_logits(results: list[GenerationResult], steps: int) -> tuple[torch.Tensor, ...]:
    """Each step's (batch, vocab) raw logits, as transformers' `logits`; a row that ended earlier has zeros after its
    end (transformers still computes them for a finished row, kvsieve does not run it)."""
    first = cast(list[torch.Tensor], results[0].logits)[0]
    out = []
    for t in range(steps):
        rows = [r.logits[t] if r.logits is not None and t < len(r.logits) else torch.zeros_like(first) for r in results]
        out.append(torch.stack(rows))
    return tuple(out)


def generate_argument(model: PreTrainedModel, name: str) -> Any:
    """An argument of the `generate` call that runs this decoding method (`streamer`, `assistant_model`).
    transformers does not hand them to a callable `custom_generate` (it passes only the arguments its own `_sample`
    does not take), so they are read from that call's frame: generate's own locals (the streamer after generate put
    the prompt into it)."""
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "generate" and frame.f_locals.get("self") is model:
            return frame.f_locals.get(name)
        frame = frame.f_back
    return None


class AfterPrompt(BaseStreamer):
    """`streamer` once transformers' `generate` has put the prompt into it: `run`'s own put of the prompt (what a
    streamer expects first) is dropped, the answer's ids and the end go on."""

    def __init__(self, streamer: BaseStreamer):
        self.streamer, self.prompt_seen = streamer, False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.streamer.put(value)
        self.prompt_seen = True

    def end(self) -> None:
        self.streamer.end()


class IdsOnly:
    """What the engine reads of a tokenizer when `decoding` and the streamer give none: no text (generate returns
    token ids; the stand-in question is the window alone), and the model's EOS (`check_eos`)."""

    eos_token_id = None

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""
