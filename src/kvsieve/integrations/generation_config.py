"""transformers' `GenerationConfig` read as kvsieve's `Sampling`: the one mapping `model.generate(custom_generate=...)`
and the `kvsieve-text-generation` pipeline share, so both apply the same generation options and refuse the same.

Applied: max_new_tokens (or max_length), min_new_tokens (or min_length), do_sample, temperature, top_p, top_k,
repetition_penalty, output_scores and output_logits (with return_dict_in_generate), eos_token_id when it is the
model's own. Refused by name, with what to do instead: beam search, attentions and hidden states per step, stop
strings, logits processors or stopping criteria the config's own fields do not build, and an EOS other than the
model's (the engine stops at the model's EOS ids), assisted generation.
"""

from __future__ import annotations

from typing import Any

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

from kvsieve.decode import Sampling, eos_token_ids
from kvsieve.errors import KvsieveError

# What the generation config's fields kvsieve reads build; anything else in the lists came from the caller.
MAPPED_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, RepetitionPenaltyLogitsProcessor,
    MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
)  # fmt: skip
MAPPED_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)
UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states")
ASSISTED = (
    "kvsieve's decoding does not run assisted (speculative) generation: leave out assistant_model and "
    "prompt_lookup_num_tokens, or generate without kvsieve to use them."
)


def sampling_of(config: GenerationConfig, prompt_length: int) -> Sampling:
    """kvsieve's sampler from the generation config: greedy unless do_sample; temperature, top-p, top-k, the
    repetition penalty and the least new tokens as transformers' own processors apply them; each step's logits kept
    where the config asks for scores or logits."""
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
    keep = bool(config.output_scores or config.output_logits)
    if not config.do_sample:
        return Sampling(max_new_tokens=most, min_tokens=least, repetition_penalty=penalty, keep_logits=keep)
    return Sampling(
        max_new_tokens=most,
        temperature=config.temperature if config.temperature is not None else 1.0,
        top_p=config.top_p if config.top_p is not None else 1.0,
        top_k=config.top_k or 0,
        min_tokens=least,
        repetition_penalty=penalty,
        keep_logits=keep,
    )


def refuse_what_it_cannot_do(
    config: GenerationConfig,
    processors: LogitsProcessorList | None = None,
    criteria: StoppingCriteriaList | None = None,
) -> None:
    """A clear error for every request kvsieve's decoding would otherwise not honour."""
    if (config.num_beams or 1) > 1:
        raise KvsieveError(
            f"kvsieve's decoding samples or decodes greedily; it does not run beam search (num_beams="
            f"{config.num_beams}). Use num_beams=1, or generate without kvsieve for beam search."
        )
    if config.prompt_lookup_num_tokens:
        raise KvsieveError(ASSISTED)
    asked = [name for name in UNSUPPORTED_OUTPUTS if getattr(config, name, False)]
    if asked:
        raise KvsieveError(
            f"kvsieve's decoding returns the sequences, scores and logits; it does not return {', '.join(asked)}. "
            "Leave them off."
        )
    if config.stop_strings:
        raise KvsieveError("kvsieve's decoding does not take stop_strings here; use kvsieve.Sampling(stop=...).")
    extra = [type(p).__name__ for p in processors or [] if not isinstance(p, MAPPED_PROCESSORS)]
    extra += [type(c).__name__ for c in criteria or [] if not isinstance(c, MAPPED_CRITERIA)]
    if extra:
        raise KvsieveError(
            f"kvsieve's decoding samples with its own sampler, set from the generation config's temperature, "
            f"top_p, top_k, repetition_penalty and min_new_tokens; it cannot apply {', '.join(extra)}. "
            "Leave them out, or generate without kvsieve."
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
