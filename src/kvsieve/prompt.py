"""Turning a long context and a question into token ids.

The result records how many tokens at the end are the question and the chat template's suffix
(`tail_len`), because selection stages keep that tail: a GemFilter that drops the question
cannot answer it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PreTrainedTokenizerBase

from kvsieve.errors import KvsieveError

_PLACEHOLDER = "\x00KVSIEVE_CONTEXT\x00"


@dataclass(frozen=True)
class Prompt:
    """Token ids (1, n) plus where the context sits in them; `asked` is False where nothing marked a question and
    the tail is the stand-in window (`question_tail`)."""

    ids: torch.Tensor
    context_start: int
    context_len: int
    asked: bool = True

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @property
    def tail_len(self) -> int:
        """Tokens after the context: the question and the template's suffix."""
        return self.length - self.context_start - self.context_len


# Tokens at a prompt's end that stand in for its question where nothing marks one (token ids, a completion, a
# chat's single message): the question-guided stages (IMDC's chunk pruning, GemFilter's kept tail) read them. The
# window reaches back to the start of the sentence its first token lies in, up to QUESTION_LONGEST tokens: a
# question longer than the window (RULER's multi-query one names four keys in some 30 tokens) is read whole.
QUESTION_WINDOW = 16
QUESTION_LONGEST = 64
# The rule as a result file records it (`kvsieve ruler --modes unmarked`): a file made before it was recorded read
# the window alone, QUESTION_WINDOW tokens (`report_results` reads an absent record so).
STAND_IN = {"window": QUESTION_WINDOW, "longest": QUESTION_LONGEST}


def question_tail(ids: Sequence[int], marked: int | None = None, tokenizer: Any = None) -> int:
    """How many of a prompt's last tokens are its question: the `marked` ones where the caller knows them (the last
    chat message, the question given apart), else the last `QUESTION_WINDOW` (all but the first token of a shorter
    prompt) reaching back to the start of their first token's sentence, if one starts within the last
    `QUESTION_LONGEST` tokens (a sentence ends at a token whose text holds a line break or ends with ".", "?" or
    "!"; without a `tokenizer`, or one that decodes nothing, the window alone): the one rule every entry point uses
    for a prompt that names no question."""
    if marked is not None:
        return marked
    window = max(0, min(QUESTION_WINDOW, len(ids) - 1))
    if window < QUESTION_WINDOW or tokenizer is None:
        return window
    for start in range(len(ids) - window, max(len(ids) - QUESTION_LONGEST, 1) - 1, -1):
        if _ends_sentence(tokenizer.decode([ids[start - 1]], skip_special_tokens=False)):
            return len(ids) - start
    return window


def _ends_sentence(text: str) -> bool:
    return "\n" in text or text.rstrip().endswith((".", "?", "!"))


def ids_prompt(
    ids: list[int], tail: int | None = None, device: torch.device | str | None = None, tokenizer: Any = None
) -> Prompt:
    """A prompt given as token ids (a completions request, a `generate` call): the last `tail` tokens are its
    question, the rest its context; with no tail (nothing marks a question in plain ids) `question_tail`'s stand-in,
    read with `tokenizer` where there is one."""
    question = question_tail(ids, tail, tokenizer)
    return Prompt(torch.tensor([ids], device=device), 0, len(ids) - question, tail is not None)


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def build_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context: str,
    question: str | None = None,
    raw: bool = False,
    lead: str = "",
) -> Prompt:
    """Build the prompt for `context` (the long document) and an optional `question`.

    Chat mode (default) wraps "context, blank line, question" as one user turn in the
    tokenizer's chat template with the generation prompt appended. A base model's tokenizer has no
    template (Gemma 3 270M): its prompt is a plain completion instead, the BOS token, the context,
    "Question: ... Answer:" after a blank line, then `lead` (how the answer starts, e.g. "The pass key
    is"; a chat prompt leaves it out). Raw mode feeds the context followed by the question exactly as
    given: no template, no BOS, nothing added.
    Prefix, context and suffix are tokenized separately so their boundaries are exact. Without a question
    the context's end stands in for one (`question_tail`).
    """
    if question is not None and not question.strip():
        raise KvsieveError("The question is empty. Pass a non-empty question, or none at all.")
    if not context.strip() and not question:
        raise KvsieveError("The prompt is empty: give a context (file or stdin) and/or a question.")
    bos: list[int] = []
    if raw:
        prefix, suffix = "", question or ""
    elif not getattr(tokenizer, "chat_template", None):  # a base model: a plain completion
        answer = f"\nAnswer: {lead}".rstrip()
        prefix, suffix = "", f"\n\nQuestion: {question}{answer}" if question else ""
        bos = [cast(int, tokenizer.bos_token_id)] if tokenizer.bos_token_id is not None else []  # one id
    else:
        prefix, suffix = _chat_frame(tokenizer, f"\n\n{question}" if question else "")
    prompt = _assemble(tokenizer, bos, prefix, context, suffix)
    if question:
        return prompt
    stand_in = question_tail(prompt.ids[0].tolist(), tokenizer=tokenizer)
    tail = min(max(prompt.tail_len, stand_in), prompt.length - prompt.context_start)
    return Prompt(prompt.ids, prompt.context_start, prompt.length - prompt.context_start - tail, asked=False)


def build_task_prompt(tokenizer: PreTrainedTokenizerBase, context: str, question: str, lead: str) -> Prompt:
    """A benchmark's prompt whose text is given whole (RULER's: instructions and document, the question, how the
    answer starts): `context + question` is the user turn of the tokenizer's chat template and `lead` opens the
    answer after it (as RULER's own model templates append its answer prefix); a base model's tokenizer (no
    template) gets the BOS token and the text as it is. The context is everything before the question."""
    if not getattr(tokenizer, "chat_template", None):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return _assemble(tokenizer, bos, "", context, question + lead)
    prefix, suffix = _chat_frame(tokenizer, question)
    return _assemble(tokenizer, [], prefix, context, suffix + lead.lstrip())


def _chat_frame(tokenizer: PreTrainedTokenizerBase, after_context: str) -> tuple[str, str]:
    """The chat template's text before and after the context, for one user turn holding the context followed by
    `after_context`, with the generation prompt appended."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _PLACEHOLDER + after_context}], tokenize=False, add_generation_prompt=True
    )
    prefix, suffix = rendered.split(_PLACEHOLDER)
    return prefix, suffix


def _assemble(tokenizer: PreTrainedTokenizerBase, bos: list[int], prefix: str, context: str, suffix: str) -> Prompt:
    """Prefix, context and suffix tokenized apart, so that their boundaries are exact."""
    prefix_ids, context_ids, suffix_ids = (_encode(tokenizer, part) for part in (prefix, context, suffix))
    prefix_ids = bos + prefix_ids
    ids = torch.tensor([prefix_ids + context_ids + suffix_ids], dtype=torch.long, device="cpu")  # moved by the pipeline
    return Prompt(ids=ids, context_start=len(prefix_ids), context_len=len(context_ids))
