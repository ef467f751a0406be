"""`--upstream URL`: send the selected token ids to another OpenAI-compatible engine and relay its answer.

kvsieve runs the select stage (GemFilter) locally; the shortened prompt goes to the upstream's
`/v1/completions` as a list of token ids, which vLLM, SGLang, TGI and kvsieve itself accept.
The upstream must serve the same model (same tokenizer). Its answer, streamed or whole, is
relayed in the client's format (chat or completion) by `serve.relay`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import httpx

from kvsieve.decode import Sampling
from kvsieve.serve.openai_types import ApiError

RELAYED = ("presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "min_tokens", "ignore_eos")


@dataclass
class UpstreamPiece:
    """One relayed piece: text, and once the upstream finishes, its finish reason and usage."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


class Upstream:
    """An OpenAI-compatible engine at `url` (e.g. http://gpu-box:8000), reached with httpx."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout: float = 600):
        self.url = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)
        self._model = model

    async def close(self) -> None:
        await self._client.aclose()

    async def check(self) -> None:
        """Ask the upstream for its models (5 s at most); the ApiError of `_call` if it does not answer them."""
        await self._call("GET", "/v1/models", timeout=5)

    async def model(self) -> str:
        """The model name to send: --upstream-model, else the first model the upstream lists."""
        if self._model is None:
            listed = await self._call("GET", "/v1/models")
            try:
                self._model = listed["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise ApiError(502, f"The upstream at {self.url} lists no model.", type="upstream_error") from None
        return self._model

    def check_relayable(self, sampling: Sampling) -> None:
        """Refuse what a relayed answer cannot carry: this relay passes text, not log-probabilities, grammars
        or several answers."""
        unrelayable = {
            "n": sampling.n > 1,
            "logprobs": sampling.logprobs is not None or sampling.prompt_logprobs is not None,
            "response_format": sampling.grammar is not None,
        }
        asked = [name for name, value in unrelayable.items() if value]
        if asked:
            raise ApiError(
                400, f"With --upstream, {', '.join(asked)} cannot be relayed; ask the upstream engine directly.",
                param=asked[0],
            )  # fmt: skip

    async def _body(self, ids: list[int], sampling: Sampling, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": await self.model(),
            "prompt": ids,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": stream,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias}
        defaults = Sampling()
        for name in RELAYED:  # OpenAI's penalties and vLLM's extensions, sent only when asked for
            if getattr(sampling, name) != getattr(defaults, name):
                body[name] = getattr(sampling, name)
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def complete(self, ids: list[int], sampling: Sampling) -> UpstreamPiece:
        """The whole answer to the token-id prompt `ids`."""
        data = await self._call("POST", "/v1/completions", json=await self._body(ids, sampling, stream=False))
        try:
            choice = data["choices"][0]
            return UpstreamPiece(choice["text"], choice.get("finish_reason") or "stop", data.get("usage"))
        except (KeyError, IndexError, TypeError):
            message = f"The upstream answered an unexpected body: {str(data)[:200]}"
            raise ApiError(502, message, type="upstream_error") from None

    async def stream(self, ids: list[int], sampling: Sampling) -> AsyncGenerator[UpstreamPiece, None]:
        """The answer as it streams from the upstream (server-sent events)."""
        body = await self._body(ids, sampling, stream=True)
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise _upstream_error(self.url, response)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ApiError(502, f"The upstream failed: {chunk['error']}", type="upstream_error")
                    choices = chunk.get("choices") or [{}]
                    yield UpstreamPiece(choices[0].get("text", ""), choices[0].get("finish_reason"), chunk.get("usage"))
        except httpx.HTTPError as error:
            raise _unreachable(self.url, error) from None

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise _unreachable(self.url, error) from None
        if response.status_code != 200:
            raise _upstream_error(self.url, response)
        return response.json()


def _unreachable(url: str, error: httpx.HTTPError) -> ApiError:
    """No answer from the upstream: 504 when it timed out (--upstream-timeout), else 502."""
    if isinstance(error, httpx.TimeoutException):
        return ApiError(504, f"The upstream at {url} did not answer in time: {error!r}.", type="upstream_error")
    return ApiError(502, f"The upstream at {url} failed: {error!r}", type="upstream_error")


def _upstream_error(url: str, response: httpx.Response) -> ApiError:
    """The upstream's own error status and message: the client's 4xx passed on, but a refusal of kvsieve's
    own credentials (401 / 403) and the upstream's 5xx are this server's fault (502)."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    if response.status_code in (401, 403):
        return ApiError(
            502,
            f"The upstream at {url} refused kvsieve's credentials ({response.status_code}: {message}); give the "
            "server its key in KVSIEVE_UPSTREAM_API_KEY.",
            type="upstream_error",
        )
    status = response.status_code if 400 <= response.status_code < 500 else 502
    return ApiError(status, f"Upstream: {message}", type="upstream_error")
