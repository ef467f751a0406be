"""The `decode` stage: greedy or nucleus sampling from a prefilled cache, one token at a time.

What decoding shares: the sampling options (`Sampling`) and the choice of a token from logits
(`adjust`, `next_token`), the answer's text and end (`TextStream`), log-probabilities, and running
tokens on a cache (`extend`). The decoding step and its loop are the engine's
(`kvsieve.engine.DecodeBatch`), which steps every running request of a batch together.

Positions continue from the feed's logical position, which can differ from the cache length
(after GemFilter or compression), so position ids are always passed explicitly. Under an
eviction that re-encodes positions (StreamingLLM's `reencode`) a token goes at the cache's
length instead (`EvictRun.position`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.errors import KvsieveError
from kvsieve.models import with_cache


@dataclass(frozen=True)
class Sampling:
    """Decoding options. temperature 0 means greedy; top_p < 1 is nucleus sampling.

    `ignore_eos` decodes on past EOS tokens up to `max_new_tokens` (stop strings still apply), so
    that every method of a benchmark decodes, and is timed over, the same number of steps.
    `top_k` > 0 samples among the k likeliest tokens only; `min_tokens` keeps EOS from being
    picked before that many tokens (vLLM's sampling extensions). Penalties and logit biases change
    the logits before any choice, greedy included (`adjust`); a `grammar` then masks the tokens
    that would leave it (`kvsieve.structured`). `logprobs` (None: off) asks for each answer
    token's log-probability and that many likeliest alternatives (`TokenLogprob`). `keep_logits`
    keeps every step's raw logits in the result (transformers' output_scores and output_logits).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (vLLM's field)
    grammar: str | None = None  # "json" (any JSON value) or a JSON Schema text: kvsieve.structured
    n: int = 1  # answers sampled from the one prefill (each from its own copy of the prefilled cache)
    keep_logits: bool = False  # each step's (vocab,) raw logits in `GenerationResult.logits`

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise KvsieveError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise KvsieveError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise KvsieveError(f"top_p must be in (0, 1], got {self.top_p}.")
        if any(not s for s in self.stop):
            raise KvsieveError("Stop strings must be non-empty.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise KvsieveError(f"seed must fit in 64 bits (a torch.Generator's range), got {self.seed}.")
        if self.top_k < 0:
            raise KvsieveError(f"top_k must be >= 0 (0 = all tokens), got {self.top_k}.")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise KvsieveError(
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}."
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise KvsieveError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}.")
        if not 0 < self.repetition_penalty <= 2:
            raise KvsieveError(f"repetition_penalty must be in (0, 2] (1 = off), got {self.repetition_penalty}.")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                raise KvsieveError(
                    f"{name} asks for 0 to {MAX_LOGPROBS} alternatives per token, got {getattr(self, name)}."
                )
        if not 1 <= self.n <= MAX_CHOICES:
            raise KvsieveError(f"n (answers per prompt) must be in [1, {MAX_CHOICES}], got {self.n}.")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise KvsieveError("logit_bias values must be in [-100, 100].")

    @property
    def adjusts(self) -> bool:
        """Whether `adjust` changes anything."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias)


MAX_LOGPROBS = 20  # alternatives per token, as vLLM allows
MAX_CHOICES = 16  # answers per prompt (n)
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's rule): dividing by them overflows the logits


@dataclass(frozen=True)
class TokenLogprob:
    """An answer token's log-probability under the model (its raw distribution, before penalties,
    temperature and truncation, as vLLM reports by default) and the `top` likeliest tokens'."""

    token: int
    logprob: float | None  # None for a prompt's first token, which nothing predicts
    top: list[tuple[int, float]]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s entry from (vocab,) raw logits, with the `top` likeliest alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else []
    return TokenLogprob(token, float(logprobs[token]), alternatives)


def prompt_logprobs(logits: torch.Tensor, ids: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Each prompt token's entry from the (L, vocab) logits of its prompt (position i predicts token i + 1);
    the first token has none."""
    first = TokenLogprob(int(ids[0]), None, [])
    return [first, *(token_logprob(logits[i], int(ids[i + 1]), top) for i in range(len(ids) - 1))]


def adjust(logits: torch.Tensor, sampling: Sampling, prompt: torch.Tensor, output: Sequence[int]) -> torch.Tensor:
    """(vocab,) logits with OpenAI's presence and frequency penalties over the answer so far (minus
    penalty x [count > 0] and penalty x count), the repetition penalty over prompt and answer
    (CTRL's, as transformers and vLLM apply it: positive logits divided by it, negative multiplied)
    and the logit biases added."""
    logits = logits.float().clone()
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.long), minlength=logits.shape[0])
    counts = counts[: logits.shape[0]].to(logits.device)
    logits -= sampling.frequency_penalty * counts + sampling.presence_penalty * (counts > 0)
    if sampling.repetition_penalty != 1:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[prompt.to(logits.device)] = True
        seen |= counts > 0
        scaled = torch.where(logits > 0, logits / sampling.repetition_penalty, logits * sampling.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    for token, bias in sampling.logit_bias:
        logits[token] += bias
    return logits


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """EOS ids from the tokenizer and the model's generation config (which may list several)."""
    ids: set[int | None] = {cast(int | None, tokenizer.eos_token_id)}  # a tokenizer's EOS is one id
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return {i for i in ids if i is not None}


def next_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None, banned: Iterable[int] = ()
) -> int:
    """Pick the next token from (vocab,) logits, never one of `banned` (EOS before `min_tokens`)."""
    banned = list(banned)
    if banned:
        logits = logits.clone()
        logits[banned] = float("-inf")
    if sampling.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    # Extreme penalties can push logits to inf: cap them, and take the largest as 0 so dividing by a small
    # temperature cannot overflow into NaN probabilities.
    logits = torch.nan_to_num(logits.float().cpu(), nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    logits = logits - logits.max()
    if 0 < sampling.top_k < logits.shape[0]:
        logits = logits.masked_fill(logits < torch.topk(logits, sampling.top_k).values[-1], float("-inf"))
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p. The first token always survives, also where top_p
        # underflows to 0 in the probabilities' dtype (a top_p of 1e-300 once dropped every token: a 500).
        drop = sorted_probs.cumsum(0) - sorted_probs >= sampling.top_p
        drop[0] = False
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> int | None:
    hits = [text.find(s) for s in stop if s in text]
    return min(hits) if hits else None


class TextStream:
    """Turns sampled tokens into answer text, deciding when the answer ends and which text is final.

    Ends at an EOS token (kept in `tokens`, not in `text`), at a stop string (text cut before it)
    or at the token limit. Text within a stop string's length of the end, or ending in half a
    character, is held back until it can no longer change. Used by `decode` and by the server's
    batched decoding, so both stop and stream identically.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, sampling: Sampling, eos: set[int]):
        self.tokenizer, self.sampling, self.eos = tokenizer, sampling, eos
        self.hold_back = max((len(s) for s in sampling.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0
        self.finish: str | None = None  # "eos", "stop" or "length" once the answer is complete

    def add(self, token: int) -> str:
        """Record `token`; return the text that became final ("" if none; all the rest once finished)."""
        self.tokens.append(token)
        if token in self.eos and not self.sampling.ignore_eos:
            self.finish = "eos"
        else:
            self.text = cast(str, self.tokenizer.decode(self.tokens, skip_special_tokens=True))  # one sequence
            cut = _cut_at_stop(self.text, self.sampling.stop)
            if cut is not None:
                self.text, self.finish = self.text[:cut], "stop"
            elif len(self.tokens) >= self.sampling.max_new_tokens:
                self.finish = "length"
        end = len(self.text)
        if self.finish is None:
            end -= self.hold_back
            if end <= self.emitted or self.text.endswith("\ufffd"):
                return ""
        piece, self.emitted = self.text[self.emitted : end], max(self.emitted, end)
        return piece


def extend(
    model: PreTrainedModel, cache: Cache, ids: torch.Tensor, position: int, logits_to_keep: int = 1
) -> torch.Tensor:
    """Run (1, t) `ids` on top of `cache` at logical positions `position`, ...; (logits_to_keep, vocab) logits."""
    ids = ids.to(model.device)
    positions = torch.arange(position, position + ids.shape[1], device=ids.device)[None]
    out = model(
        input_ids=ids,
        position_ids=positions,
        **with_cache(model, cache),
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits[0]
