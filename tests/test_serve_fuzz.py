"""Property-based tests of the server's endpoints: whatever a client sends, the answer is a 2xx or a 4xx
with OpenAI's error object, never a 5xx or a dropped connection.

Bodies are drawn by hypothesis around the fields the endpoints know (values of every JSON type, valid
and not, at the edges of their ranges: huge integers, deep nesting, odd Unicode, token ids past the
vocabulary, wrong kvsieve settings) plus unknown fields. The server is the tiny model on a free
localhost port; each example is bounded (a few new tokens), and the number of examples is fixed.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve import start, tiny  # noqa: F401  (the module's tiny-model fixture)

LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
)
JSON = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
SMALL_INT = st.integers(min_value=-3, max_value=6)
PROMPT = st.one_of(st.text(max_size=40), st.lists(st.integers(min_value=-2, max_value=300), max_size=12), JSON)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
        "content": st.one_of(st.text(max_size=30), JSON),
    }
)
METHODS = st.sampled_from(["full", "snapkv", "gemfilter", "a2sf", "imdc", "critiprefill", "nope"])
SETTINGS = st.dictionaries(
    st.sampled_from(
        ["compress.budget", "evict.budget", "select.k", "select.layer", "feed.chunk", "attention.dense_layers", "x.y"]
    ),
    st.one_of(SMALL_INT, st.floats(min_value=-1, max_value=2), st.text(max_size=5), st.none()),
    max_size=2,
)
COMMON = {
    "model": st.sampled_from(["tiny", "tiny", "other"]),
    "max_tokens": st.one_of(SMALL_INT, st.integers(min_value=2**31, max_value=2**70), JSON),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), JSON),
    "top_p": st.floats(min_value=-0.5, max_value=1.5),
    "top_k": SMALL_INT,
    "seed": st.one_of(st.integers(min_value=-(2**70), max_value=2**70), JSON),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=6), JSON),
    "n": SMALL_INT,
    "logprobs": st.one_of(st.booleans(), SMALL_INT, st.integers(min_value=20, max_value=40)),
    "top_logprobs": SMALL_INT,
    "presence_penalty": st.floats(min_value=-3, max_value=3),
    "repetition_penalty": st.floats(min_value=-1, max_value=3),
    "logit_bias": st.one_of(
        st.none(), st.dictionaries(st.text(max_size=4), st.floats(min_value=-200, max_value=200), max_size=2)
    ),
    "response_format": st.one_of(
        st.none(), JSON, st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])})
    ),
    "tools": st.one_of(st.none(), st.lists(JSON, max_size=2)),
    "tool_choice": st.one_of(st.none(), st.sampled_from(["none", "auto", "required"]), JSON),
    "min_tokens": SMALL_INT,
    "ignore_eos": st.one_of(st.booleans(), JSON),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), JSON, st.fixed_dictionaries({"include_usage": st.booleans()})),
    "kvsieve": st.one_of(JSON, st.fixed_dictionaries({"method": METHODS, "set": SETTINGS, "cache": st.booleans()})),
    "unknown_field": JSON,
}


def bodies(valid: dict, **fields: st.SearchStrategy) -> st.SearchStrategy:
    """A `valid` body with one to three of the fields drawn over it, so that most examples get past the first
    check and a bad value deep in the request (a seed past 64 bits, a setting the model refuses) is met."""
    strategies = {**COMMON, **fields}
    names = st.lists(st.sampled_from(sorted(strategies)), min_size=1, max_size=3, unique=True)
    drawn = names.flatmap(lambda chosen: st.fixed_dictionaries({name: strategies[name] for name in chosen}))
    return drawn.map(lambda values: {**valid, **values})


@pytest.fixture(scope="module")
def fuzz_server(tiny):  # noqa: F811
    running = start(tiny, cache_bytes=5_000_000, max_step_tokens=32, default_max_tokens=4)
    yield running
    running.stop()


def check(server, path: str, body) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.stream("POST", f"{server.url}{path}", content=data, timeout=60) as response:
        raw = response.read()
    assert response.status_code < 500, (path, body, raw[:300])
    if response.status_code >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], raw[:300]
    elif b"data: " in raw:  # a stream: every event is JSON or [DONE], and it ends with [DONE]
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all(json.loads(e) for e in events[:-1])


FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=bodies({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}, prompt=PROMPT, echo=st.booleans()))
def test_completions_never_answer_5xx(fuzz_server, body):
    check(fuzz_server, "/v1/completions", body)


@FUZZ
@given(
    body=bodies(
        {"model": "tiny", "messages": [{"role": "user", "content": "the pass key"}], "max_tokens": 3},
        messages=st.one_of(st.lists(MESSAGE, max_size=3), JSON),
        max_completion_tokens=SMALL_INT,
    )
)
def test_chat_never_answers_5xx(fuzz_server, body):
    check(fuzz_server, "/v1/chat/completions", body)


@FUZZ
@given(body=st.one_of(st.binary(max_size=40), JSON.map(lambda v: json.dumps(v).encode())))
def test_any_bytes_never_answer_5xx(fuzz_server, body):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        check(fuzz_server, path, body)
