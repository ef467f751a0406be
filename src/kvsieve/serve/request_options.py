"""What one HTTP request asks for, checked against the server's limits (`ServeConfig`): its body within
--max-body (`read_body`), its method with its settings (`method_of`), and OpenAI's sampling fields as kvsieve's
`Sampling` with the prompt and answer checked against the model's context (`sampling_of`). The front
(`serve.app`) calls these for every request, streamed, whole or relayed.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from kvsieve import registry
from kvsieve.decode import Sampling
from kvsieve.engine import positions_needed
from kvsieve.errors import KvsieveError
from kvsieve.serve.openai_types import ApiError, ChatRequest, CompletionRequest, KvsieveOptions
from kvsieve.serve.prompts import PromptIds
from kvsieve.spec import MethodSpec, json_type_error
from kvsieve.structured import compile_grammar


@dataclass(frozen=True)
class ServeConfig:
    """What the front checks requests against."""

    model_name: str
    default_spec: MethodSpec
    max_positions: int  # the model's trained context
    vocab_size: int
    api_key: str | None = None
    max_body_bytes: int = 4_000_000
    max_prompt_tokens: int = 131_072
    default_max_tokens: int = 256


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing more than --max-body-bytes (413) without reading it all."""
    declared = request.headers.get("content-length", "")
    too_large = ApiError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise too_large
    return bytes(data)


def method_of(options: KvsieveOptions, config: ServeConfig) -> MethodSpec:
    """The request's method: its `kvsieve.method` (or the server's) with `kvsieve.set` applied."""
    try:
        base = registry.method(options.method) if options.method is not None else config.default_spec
        for path, value in options.set.items():
            if (problem := json_type_error(base, path, value)) is not None:
                raise KvsieveError(problem)
        return base.with_settings(options.set)
    except KvsieveError as error:
        raise ApiError(400, str(error), param="kvsieve", code="invalid_method") from None


def sampling_of(
    body: ChatRequest | CompletionRequest,
    prompt: PromptIds,
    spec: MethodSpec,
    param: str,
    config: ServeConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    relayed: bool = False,
) -> Sampling:
    """OpenAI's sampling fields as kvsieve's `Sampling`, after checking the prompt and answer fit what the method
    can hold (`relayed`: an upstream engine checks its own context; only the select pass runs here)."""
    n = len(prompt.ids)
    if n > config.max_prompt_tokens:
        raise ApiError(
            400, f"The prompt has {n} tokens; this server accepts at most {config.max_prompt_tokens}.",
            param=param, code="prompt_too_long",
        )  # fmt: skip
    limit = body.token_limit()
    # An upstream engine checks its own context; here only the select pass places every prompt token.
    needed = positions_needed(spec.stages(), n, limit or 1) if not relayed else (n if spec.select else 0)
    if needed > config.max_positions:
        raise ApiError(
            400,
            f"This model's maximum context length is {config.max_positions} tokens; the request needs "
            f"{needed} ({n} in the prompt). Shorten it, lower max_tokens, or use a method that feeds the prompt "
            "in chunks with a compressed memory (imdc), which takes any length.",
            param=param,
            code="context_length_exceeded",
        )
    if not limit and not relayed and positions_needed(spec.stages(), n, 0) > 0:  # the answer must fit
        limit = min(config.default_max_tokens, config.max_positions - needed + 1)
    sampling = Sampling(
        max_new_tokens=limit or config.default_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings(),
        ignore_eos=body.ignore_eos,
        top_k=max(body.top_k, 0),
        min_tokens=body.min_tokens,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.biases(),
        logprobs=body.logprob_alternatives(),
        grammar=body.grammar(),
        n=body.n,
        prompt_logprobs=body.logprobs if getattr(body, "echo", False) else None,
    )
    try:
        sampling.validate()
    except KvsieveError as error:
        raise ApiError(400, str(error), code="invalid_value") from None
    unknown = [token for token, _ in sampling.logit_bias if token >= config.vocab_size]
    if unknown:
        raise ApiError(
            400, f"logit_bias names token ids {unknown} beyond this model's {config.vocab_size} tokens.",
            param="logit_bias", code="invalid_value",
        )  # fmt: skip
    if sampling.grammar is not None:
        try:  # compiled once per grammar; the request's decoding then only matches against it
            compile_grammar(tokenizer, config.vocab_size, sampling.grammar)
        except KvsieveError as error:
            raise ApiError(400, str(error), param="response_format", code="invalid_value") from None
    return sampling
