"""kvsieve inside transformers' own `generate`: `model.generate(**inputs, custom_generate=kvsieve.decoding("snapkv"))`.

transformers 5 runs a callable `custom_generate` as the decoding method after its own preparation (the generation
config merged from the model's and the call's, the logits processors and stopping criteria built from it). The
callable `decoding` returns hands every row of the batch to the engine as a prompt whose context is the whole row
(padding removed), exactly as the server's `/v1/completions` does (`kvsieve.prompt.ids_prompt`), decodes with
kvsieve's sampler set from the generation config, and returns what `generate` returns: the prompts followed by the new
tokens (right-padded with the pad id), or a `GenerateDecoderOnlyOutput` with `return_dict_in_generate`.

What the engine cannot do here is refused by name rather than silently ignored: beam search, scores and other
per-step outputs, stop strings, logits processors or stopping criteria beyond those the config's own fields build,
and an EOS other than the model's. Not yet: a `streamer` given to `generate` receives the prompt and nothing more
(transformers hands a callable decoding method only the arguments `_sample` does not take, and `_sample` takes the
streamer); `kvsieve.generate(..., stream=...)` streams.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from kvsieve.decode import Sampling, eos_token_ids
from kvsieve.engine import GenerationResult, resolve_method, run
from kvsieve.errors import KvsieveError
from kvsieve.models import prepare
from kvsieve.prompt import ids_prompt
from kvsieve.spec import MethodSpec

# What the generation config's fields kvsieve reads build; anything else in the lists came from the caller.
MAPPED_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, RepetitionPenaltyLogitsProcessor,
    MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
)  # fmt: skip
MAPPED_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)
PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def decoding(method: MethodSpec | str = "full", settings: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """A decoding method for `model.generate(..., custom_generate=kvsieve.decoding(method))` that runs `method` (a
    registered name or a `MethodSpec`, its fields changed by `settings` as `--set` does: {"compress.budget": 0.25}).
    A bad method or setting fails here, before any generation."""
    spec = resolve_method(method, {}).with_settings(dict(settings or {}))

    def kvsieve_decoding(
        model: PreTrainedModel,
        input_ids: torch.LongTensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        tokenizer: Any = None,
        **model_kwargs: Any,
    ) -> torch.Tensor | GenerateDecoderOnlyOutput:
        refuse_what_it_cannot_do(generation_config, logits_processor, stopping_criteria)
        prepare(model)  # kvsieve's attention (plain causal SDPA where no stage hooks in); a no-op once prepared
        engine_tokenizer = tokenizer if tokenizer is not None else IdsOnly()
        check_eos(model, engine_tokenizer, generation_config)
        mask = model_kwargs.get("attention_mask")
        rows = [row[mask[i].bool()] if mask is not None else row for i, row in enumerate(input_ids)]
        prompts = [ids_prompt(row.tolist(), device=input_ids.device) for row in rows]
        sampling = sampling_of(generation_config, input_ids.shape[1])
        # A list of prompts gives a list: one result each (sampling.n is 1).
        results = cast(list[GenerationResult], run(model, engine_tokenizer, prompts, method=spec, sampling=sampling))
        pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
        longest = max(len(result.tokens) for result in results)
        padded = [result.tokens + [pad] * (longest - len(result.tokens)) for result in results]
        new = torch.tensor(padded, dtype=input_ids.dtype, device=input_ids.device)
        sequences = torch.cat([input_ids, new], dim=1)
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    kvsieve_decoding.__doc__ = f"kvsieve's decoding with method {spec.name} ({spec.describe()})."
    return kvsieve_decoding


class IdsOnly:
    """What the engine reads of a tokenizer when `generate` is given none: no text (generate returns token ids),
    and the model's EOS (`check_eos`)."""

    eos_token_id = None

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""


def sampling_of(config: GenerationConfig, prompt_length: int) -> Sampling:
    """kvsieve's sampler from the generation config: greedy unless do_sample; temperature, top-p, top-k, the
    repetition penalty and the least new tokens as transformers' own processors apply them."""
    if config.max_new_tokens is not None:
        most = config.max_new_tokens
    else:
        most = (config.max_length or 20) - prompt_length
    if most < 1:
        raise KvsieveError(
            f"No room to generate: max_length {config.max_length} <= the prompt's {prompt_length} tokens; "
            "set max_new_tokens."
        )
    least = config.min_new_tokens or max(0, (config.min_length or 0) - prompt_length)
    penalty = config.repetition_penalty if config.repetition_penalty is not None else 1.0
    if not config.do_sample:
        return Sampling(max_new_tokens=most, min_tokens=least, repetition_penalty=penalty)
    return Sampling(
        max_new_tokens=most,
        temperature=config.temperature if config.temperature is not None else 1.0,
        top_p=config.top_p if config.top_p is not None else 1.0,
        top_k=config.top_k or 0,
        min_tokens=least,
        repetition_penalty=penalty,
    )


def refuse_what_it_cannot_do(
    config: GenerationConfig,
    processors: LogitsProcessorList,
    criteria: StoppingCriteriaList,
) -> None:
    """A clear error for every request kvsieve's decoding would otherwise not honour."""
    if (config.num_beams or 1) > 1:
        raise KvsieveError(
            f"kvsieve's decoding samples or decodes greedily; it does not run beam search (num_beams="
            f"{config.num_beams}). Use num_beams=1, or call generate without custom_generate for beam search."
        )
    asked = [name for name in PER_STEP_OUTPUTS if getattr(config, name, False)]
    if asked:
        raise KvsieveError(
            f"kvsieve's decoding returns the sequences only; it does not return {', '.join(asked)}. Leave them off."
        )
    if config.stop_strings:
        raise KvsieveError("kvsieve's decoding does not take stop_strings here; use kvsieve.Sampling(stop=...).")
    extra = [type(p).__name__ for p in processors if not isinstance(p, MAPPED_PROCESSORS)]
    extra += [type(c).__name__ for c in criteria if not isinstance(c, MAPPED_CRITERIA)]
    if extra:
        raise KvsieveError(
            f"kvsieve's decoding samples with its own sampler, set from the generation config's temperature, "
            f"top_p, top_k, repetition_penalty and min_new_tokens; it cannot apply {', '.join(extra)}. "
            "Leave them out, or call generate without custom_generate."
        )


def check_eos(model: PreTrainedModel, tokenizer: Any, config: GenerationConfig) -> None:
    """The engine stops at the model's EOS ids (its generation config's and the tokenizer's); a call that asks to
    stop at other ids, or at fewer, is refused rather than decoded past them or cut short."""
    asked = config.eos_token_id
    asked_ids = set(asked) if isinstance(asked, list | tuple) else {asked} if asked is not None else set()
    stops = eos_token_ids(model, tokenizer)
    if asked_ids and asked_ids != stops:
        raise KvsieveError(
            f"This call asks to stop at EOS {sorted(asked_ids)}, the model stops at {sorted(stops)}: set "
            "model.generation_config.eos_token_id instead, so kvsieve's decoding stops where you ask."
        )
