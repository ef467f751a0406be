"""One answer's output processing (vLLM's output processor): what turns a step's logits into reported text.

An `Output` applies the request's `Sampling` to each step's logits (penalties and biases, the grammar's mask, the
minimum length, the seeded generator), records the token's log-probabilities, turns tokens into text that is final
(`decode.TextStream`: EOS, stop strings, the token limit) and reports it as `Text` and, at the end, `Finished` events
(`engine.events`). A request with n answers has n outputs, one per answer (`fork`); the request owns the prefill,
the cache and the row in the decoding batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from kvsieve.decode import Sampling, TextStream, TokenLogprob, adjust, next_token, token_logprob
from kvsieve.engine.events import Event, Finished, Text
from kvsieve.structured import Constraint


class Output:
    """Answer `index` of a request: its text so far, grammar state, generator (seeded `seed + index`) and the
    log-probabilities not yet reported; events go to `emit`."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        sampling: Sampling,
        eos: set[int],
        prompt_ids: torch.Tensor,
        emit: Callable[[Event], None],
        index: int = 0,
    ):
        self.tokenizer, self.vocab_size, self.sampling = tokenizer, vocab_size, sampling
        self.prompt_ids, self.emit, self.index = prompt_ids, emit, index
        self.text = TextStream(tokenizer, sampling, eos)
        self.constraint = None if sampling.grammar is None else Constraint(tokenizer, vocab_size, sampling.grammar)
        seed = sampling.seed
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed if index == 0 else (seed + index) % 2**64)
        self.pending: list[TokenLogprob] = []  # sampled tokens' entries not yet reported
        self.reported = 0  # answer tokens an event has reported
        self.logits: list[torch.Tensor] | None = [] if sampling.keep_logits else None

    @property
    def tokens(self) -> list[int]:
        return self.text.tokens

    @property
    def finish(self) -> str | None:
        """Why the answer ended ("eos", "stop", "length"), None while it goes on."""
        return self.text.finish

    def fork(self, index: int) -> Output:
        """A fresh output for answer `index` of the same request."""
        return Output(self.tokenizer, self.vocab_size, self.sampling, self.text.eos, self.prompt_ids, self.emit, index)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from (vocab,) raw logits: penalties and biases, the grammar's mask, no EOS before the
        minimum length, then greedy or sampled; its log-probabilities are kept for the report."""
        sampling = self.sampling
        chosen = adjust(logits, sampling, self.prompt_ids, self.tokens) if sampling.adjusts else logits
        if self.constraint is not None:
            chosen = self.constraint.mask(chosen)
        early = len(self.tokens) < sampling.min_tokens
        token = next_token(chosen, sampling, self.generator, self.text.eos if early else ())
        if self.constraint is not None:
            self.constraint.accept(token)
        if sampling.logprobs is not None:
            self.pending.append(token_logprob(logits, token, sampling.logprobs))
        if self.logits is not None:
            self.logits.append(logits.float().clone())
        return token

    def add(self, token: int) -> bool:
        """Record `token` and report the text it made final; True when the answer is complete."""
        piece = self.text.add(token)
        if piece:
            self.emit(Text(piece, len(self.tokens), self.take_logprobs(), self.index, self.take_ids()))
        return self.finish is not None

    def take_ids(self) -> list[int]:
        """The answer's tokens no event has reported yet."""
        taken, self.reported = self.tokens[self.reported :], len(self.tokens)
        return taken

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens not yet reported (an EOS that ended the answer is not one)."""
        taken, self.pending = self.pending, []
        if self.finish == "eos" and taken and taken[-1].token in self.text.eos:
            taken.pop()
        return taken

    def finished(self, info: dict[str, Any]) -> None:
        """Report the end of the answer with the request's record `info`."""
        self.emit(Finished(self.finish, len(self.tokens), info, self.take_logprobs(), self.index, self.take_ids()))
