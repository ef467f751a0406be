"""`kvsieve serve` on the embedded SmolLM2: its real chat template, a passkey document, reuse of the document."""

from __future__ import annotations

import json

import openai
import pytest

from kvsieve.data import passkey_case
from kvsieve.loading import DEFAULT_MODEL
from kvsieve.serve import ServerThread, create_server

pytestmark = pytest.mark.real_model  # `smollm` (conftest): the default model, loaded offline once


def test_passkey_document_is_reused_for_the_next_question(smollm):
    model, tokenizer = smollm
    case = passkey_case(tokenizer, 500, 0.4, seed=3)
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
        assert info["cache"] == "hit" and info["cached_tokens"] > 500
        assert info["prefill_tokens"] == follow.usage.prompt_tokens - info["cached_tokens"] < 40
        fresh = ask("Repeat the pass key, digits only.", cache=False)  # exact prefix caching: the same answer
        assert follow.choices[0].message.content == fresh.choices[0].message.content
        assert case.answer in follow.choices[0].message.content


def test_structured_output_keeps_the_answer_within_json_and_its_schema(smollm):
    """response_format json_object gives JSON and json_schema JSON of that schema (xgrammar masks every other
    token), where the same request without it answers in prose; an unusable schema is a 400."""
    model, tokenizer = smollm
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    with ServerThread(create_server(model, tokenizer, model_name=DEFAULT_MODEL, cache_bytes=0)) as server:
        chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0).chat.completions
        messages = [{"role": "user", "content": "Tell me about Paris and how many people live there."}]

        def ask(**options) -> openai.types.chat.ChatCompletion:
            options = {"max_tokens": 40, **options}
            return chat.create(model=DEFAULT_MODEL, messages=messages, temperature=0, **options)

        prose = ask(max_tokens=12).choices[0].message.content
        with pytest.raises(json.JSONDecodeError):
            json.loads(prose)
        anything = ask(response_format={"type": "json_object"}).choices[0]
        assert anything.finish_reason == "stop"
        json.loads(anything.message.content)
        shaped = ask(response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
        answer = json.loads(shaped.choices[0].message.content)
        assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)
        with pytest.raises(openai.BadRequestError, match="schema"):
            ask(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
        with pytest.raises(openai.BadRequestError, match="tool"):
            ask(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
        assert ask(tools=[], tool_choice="none", parallel_tool_calls=False, max_tokens=4).choices[0].message.content


def test_langchain_chat_openai_runs_against_the_server(smollm, caplog):
    """LangChain's ChatOpenAI as its users call it: invoke, stream, batch, structured output in json_mode and
    json_schema (a pydantic model back), logprobs; tool binding is refused with a 400 that names tools."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        country: str

    model, tokenizer = smollm
    with ServerThread(create_server(model, tokenizer, model_name=DEFAULT_MODEL, cache_bytes=0)) as server:
        llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=DEFAULT_MODEL, max_tokens=24, temperature=0)
        short = llm.bind(max_tokens=8)  # where no JSON must close, 8 tokens say as much
        assert "Paris" in short.invoke("What is the capital of France?").content
        assert "".join(chunk.content for chunk in short.stream("Say hello.")).strip()
        assert all(answer.content for answer in short.batch(["Hi", "Name a color."]))
        ask = "Give a city and its country as JSON with keys city and country."
        with caplog.at_level("WARNING", logger="kvsieve.serve"):
            assert set(llm.with_structured_output(None, method="json_mode").invoke(ask)) == {"city", "country"}
            assert isinstance(llm.with_structured_output(City, method="json_schema").invoke(ask), City)
        assert not [r for r in caplog.records if "unknown request field" in r.getMessage()]  # every field understood
        content = short.bind(logprobs=True).invoke("Hi").response_metadata["logprobs"]["content"]
        assert content and all(entry["logprob"] <= 0 for entry in content)
        with pytest.raises(openai.BadRequestError, match="tool"):
            llm.bind_tools([City]).invoke("hi")
