"""Token ids of a request's prompt, and where its reusable context ends.

Chat messages go through the tokenizer's chat template with the generation prompt appended.
The reuse boundary is where the last message starts: the document or the earlier turns before
it are the context that later requests share, the last message is the new question. A select
stage keeps the prompt's tail and IMDC's pruning asks it: the last message when there is a boundary,
else (a single message, a completion) the library's window for a prompt that names no question
(`kvsieve.prompt.question_tail`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from transformers import PreTrainedTokenizerBase

from kvsieve.prompt import Prompt, ids_prompt
from kvsieve.serve.openai_types import ApiError, Message


@dataclass(frozen=True)
class PromptIds:
    ids: list[int]
    boundary: int = 0  # tokens before the last message (0: nothing reusable)
    tail: int | None = None  # the last message's tokens (None: nothing marks a question, `question_tail`'s window)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation: bool) -> str:
    try:
        # With tokenize=False the template's text (transformers annotates every form it can return).
        return cast(str, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation))
    except Exception as error:  # the template's own checks (e.g. roles must alternate)
        raise ApiError(400, f"The model's chat template refused these messages: {error}", param="messages") from None


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> PromptIds:
    """The chat template's token ids for `messages`, with the reuse boundary and the kept tail."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "This model's tokenizer has no chat template; use /v1/completions.", param="messages")
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    if not any(m["content"].strip() for m in plain):
        raise ApiError(400, "Every message is empty; send some text.", param="messages")
    ids = _encode(tokenizer, _render(tokenizer, plain, generation=True))
    if len(plain) > 1:
        head = _encode(tokenizer, _render(tokenizer, plain[:-1], generation=False))
        if 0 < len(head) < len(ids) and ids[: len(head)] == head:
            return PromptIds(ids, boundary=len(head), tail=len(ids) - len(head))
    return PromptIds(ids)


def completion_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[int], vocab_size: int) -> PromptIds:
    """Text (tokenized as the tokenizer does by default) or token ids, checked against the vocabulary."""
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
        if not ids:
            raise ApiError(400, "The prompt is empty.", param="prompt")
        return PromptIds(ids)
    bad = [i for i in prompt if not 0 <= i < vocab_size]
    if bad:
        raise ApiError(400, f"Token ids must be in [0, {vocab_size}); got {bad[:5]}.", param="prompt")
    return PromptIds(list(prompt))


def as_prompt(prompt: PromptIds, tokenizer: PreTrainedTokenizerBase) -> Prompt:
    """The library's prompt for a request's token ids: the last `tail` tokens are its question, else the stand-in
    the tokenizer's sentences bound (`ids_prompt`)."""
    return ids_prompt(prompt.ids, prompt.tail, tokenizer=tokenizer)
