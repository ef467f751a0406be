"""`kvsieve serve` on the embedded SmolLM2: its real chat template, a passkey document, reuse of the document."""

from __future__ import annotations

import openai
import pytest

from kvsieve.data import passkey_case
from kvsieve.models import DEFAULT_MODEL
from kvsieve.serve import ServerThread, create_server

pytestmark = pytest.mark.real_model  # `smollm` (conftest): the default model, loaded offline once


def test_passkey_document_is_reused_for_the_next_question(smollm):
    model, tokenizer = smollm
    case = passkey_case(tokenizer, 1000, 0.4, seed=3)
    with ServerThread(create_server(model, tokenizer, model_name=DEFAULT_MODEL, cache_bytes=10**9)) as server:
        chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0).chat.completions

        def ask(question: str, **options) -> openai.types.chat.ChatCompletion:
            messages = [{"role": "system", "content": case.context}, {"role": "user", "content": question}]
            extra = {"kvsieve": {"method": "full", **options}}
            return chat.create(model=DEFAULT_MODEL, messages=messages, max_tokens=16, temperature=0, extra_body=extra)

        first = ask(case.question)
        assert case.answer in first.choices[0].message.content
        assert first.model_extra["kvsieve"]["cache"] == "miss"
        follow = ask("Repeat the pass key, digits only.")
        info = follow.model_extra["kvsieve"]
        assert info["cache"] == "hit" and info["cached_tokens"] > 1000
        assert info["prefill_tokens"] == follow.usage.prompt_tokens - info["cached_tokens"] < 40
        fresh = ask("Repeat the pass key, digits only.", cache=False)  # exact prefix caching: the same answer
        assert follow.choices[0].message.content == fresh.choices[0].message.content
        assert case.answer in follow.choices[0].message.content
