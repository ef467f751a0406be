"""Structured output: an answer kept within a grammar (any JSON, or a JSON Schema) by masking, at
every step, the tokens that would leave it, with xgrammar (vLLM's structured-output backend; its
CPU path needs no GPU). Used by `Request.sample`, so every entry point and every method decodes
under the same rule; the grammar ends the answer by allowing only EOS once it is complete.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from kvsieve.errors import KvsieveError

ANY_JSON = "json"  # Sampling.grammar for any JSON value (OpenAI's response_format json_object)


@lru_cache(maxsize=8)
def _compiler(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> Any:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgrammar.GrammarCompiler(info)


@lru_cache(maxsize=64)
def compile_grammar(tokenizer: PreTrainedTokenizerBase, vocab_size: int, grammar: str) -> Any:
    """The compiled grammar (cached): `ANY_JSON`, or a JSON Schema's text; a KvsieveError says what is wrong."""
    compiler = _compiler(tokenizer, vocab_size)
    if grammar == ANY_JSON:
        return compiler.compile_builtin_json_grammar()
    try:
        json.loads(grammar)
        return compiler.compile_json_schema(grammar)
    except (ValueError, RuntimeError) as error:
        raise KvsieveError(f"The JSON schema cannot constrain an answer: {error}") from None


class Constraint:
    """One answer's grammar state: `mask` the logits of the tokens it forbids, then `accept` the chosen one."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, grammar: str):
        import xgrammar

        self._xgrammar = xgrammar
        self.matcher = xgrammar.GrammarMatcher(compile_grammar(tokenizer, vocab_size, grammar))
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A float copy of (vocab,) `logits` with the forbidden tokens at -inf."""
        logits = logits.float().clone()
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self._xgrammar.apply_token_bitmask_inplace(logits, self.bitmask[0].to(logits.device))
        if not torch.isfinite(logits).any():
            raise KvsieveError(
                "No token of this model's vocabulary continues the answer within its response_format; "
                "ask for text, or for a schema this model's tokens can spell."
            )
        return logits

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise KvsieveError(f"Token {token} does not continue the answer's grammar.")
