"""build_prompt on an offline word-level tokenizer: boundaries, tail length, modes and errors."""

from __future__ import annotations

import pytest
from conftest import word_level_tokenizer

from kvsieve import KvsieveError, build_prompt
from kvsieve.prompt import QUESTION_LONGEST, QUESTION_WINDOW, ids_prompt, question_tail

# Word ids in word_level_tokenizer(): [UNK]=0 <s>=1 </s>=2 the=3 pass=4 key=5 is=6 what=7
# remember=8 it=9 answer=10 question=11 hello=12 world=13
TEMPLATE = (
    "{% for m in messages %}<s> question {{ m['content'] }} </s>{% endfor %}"
    "{% if add_generation_prompt %} answer{% endif %}"
)


def test_raw_prompt_is_context_then_question():
    tokenizer = word_level_tokenizer()
    prompt = build_prompt(tokenizer, "the pass key is hello", "what is it", raw=True)
    assert prompt.ids.tolist() == [[3, 4, 5, 6, 12, 7, 6, 9]]
    assert prompt.ids.shape == (1, 8)
    assert (prompt.context_start, prompt.context_len, prompt.tail_len, prompt.length) == (0, 5, 3, 8)


def test_a_prompt_without_a_question_takes_its_end_as_one():
    """Nothing marks a question: the last QUESTION_WINDOW tokens stand in (all but the first of a shorter prompt),
    in a built prompt and in token ids alike; a marked question is the question."""
    prompt = build_prompt(word_level_tokenizer(), "hello world", raw=True)
    assert prompt.ids.tolist() == [[12, 13]]
    assert (prompt.tail_len, prompt.asked) == (1, False)
    long = build_prompt(word_level_tokenizer(), " ".join(["hello"] * 100), raw=True)
    assert (long.tail_len, long.context_len, long.asked) == (QUESTION_WINDOW, 100 - QUESTION_WINDOW, False)
    assert ids_prompt(list(range(100))).tail_len == QUESTION_WINDOW
    assert (ids_prompt(list(range(100)), tail=7).tail_len, ids_prompt(list(range(100)), tail=7).asked) == (7, True)
    assert ids_prompt([5]).tail_len == 0


class Sentences:
    """Decodes id 1 as ".", 2 as "?\\n", 3 as " 3.5x" (a period inside a token) and any other id as a word: where
    sentences end, for `question_tail`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return {1: ".", 2: "?\n", 3: " 3.5x"}.get(ids[0], " word")


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([5] * 50 + [1] + [5] * 24, 24),  # the window reaches back to the sentence its first token lies in
        ([5] * 50 + [2] + [5] * 30, 30),  # a line break ends a sentence too
        ([5] * 50 + [1] + [5] * QUESTION_WINDOW, QUESTION_WINDOW),  # the window starts a sentence already
        ([5] * 50 + [1] + [5] * 5, QUESTION_WINDOW),  # a sentence inside the window: the window
        ([5] * 10 + [1] + [5] * QUESTION_LONGEST, QUESTION_LONGEST),  # the longest question read whole
        ([5] * 10 + [1] + [5] * (QUESTION_LONGEST + 1), QUESTION_WINDOW),  # longer: no sentence start, the window
        ([5] * 50 + [3] + [5] * 24, QUESTION_WINDOW),  # "3.5x" ends no sentence
        ([5] * 200, QUESTION_WINDOW),
        ([5] * 10, 9),  # all but the first token of a shorter prompt
    ],
)
def test_a_stand_in_question_reaches_back_to_the_start_of_its_sentence(ids, expected):
    assert question_tail(ids, tokenizer=Sentences()) == expected
    assert question_tail(ids) == min(QUESTION_WINDOW, len(ids) - 1)  # no tokenizer: the window alone
    assert question_tail(ids, marked=3, tokenizer=Sentences()) == 3  # a marked question is the question
    assert ids_prompt(ids, tokenizer=Sentences()).tail_len == expected


@pytest.mark.real_model
def test_the_stand_in_is_a_ruler_multi_query_question_whole(smollm):
    """On SmolLM2's tokenizer and RULER's multi-query wording (four keys in the answer's lead, some 30 tokens): the
    stand-in is that sentence, every key in it, where the window alone holds the last two."""
    tokenizer = smollm[1]
    keys = "used-postfix, squealing-probe, annoying-doorbell, and deranged-assurance"
    lead = f"The special magic numbers for {keys} mentioned in the provided text are"
    text = f"The grass is green. One of the special magic numbers for used-postfix is: 8082668.\n{lead}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[-question_tail(ids, tokenizer=tokenizer) :]) == lead
    assert "used-postfix" not in tokenizer.decode(ids[-QUESTION_WINDOW:])


def test_chat_prompt_wraps_context_and_question_in_the_template():
    tokenizer = word_level_tokenizer()
    tokenizer.chat_template = TEMPLATE
    prompt = build_prompt(tokenizer, "the pass key is hello", "what is it")
    # "<s> question " + context + "\n\nwhat is it </s> answer"
    assert prompt.ids.tolist() == [[1, 11, 3, 4, 5, 6, 12, 7, 6, 9, 2, 10]]
    assert (prompt.context_start, prompt.context_len, prompt.tail_len) == (2, 5, 5)
    assert prompt.ids[0, prompt.context_start : prompt.context_start + prompt.context_len].tolist() == [3, 4, 5, 6, 12]


def test_a_tokenizer_without_a_template_gets_a_plain_completion():
    """A base model (no chat template): BOS, the context, then "Question: ... Answer:" after a blank line."""
    tokenizer = word_level_tokenizer()
    prompt = build_prompt(tokenizer, "the pass key is hello", "what is it")
    question = tokenizer("\n\nQuestion: what is it\nAnswer:", add_special_tokens=False)["input_ids"]
    assert prompt.ids.tolist() == [[tokenizer.bos_token_id, 3, 4, 5, 6, 12, *question]]
    assert (prompt.context_start, prompt.context_len, prompt.tail_len) == (1, 5, len(question))


@pytest.mark.parametrize(
    ("context", "question", "message"), [("hello", "  ", "question is empty"), (" \n", None, "empty")]
)
def test_empty_inputs_are_refused(context, question, message):
    with pytest.raises(KvsieveError, match=message):
        build_prompt(word_level_tokenizer(), context, question, raw=True)
