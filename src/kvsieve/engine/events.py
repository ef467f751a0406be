"""What a request reports and returns: its events (`Started`, `Text`, `Finished`, `Selected`, `Failed`) and the
`GenerationResult` that `kvsieve.generate` / `run` give back.

A request (`engine.request`) emits `Started` once its prefill is done, `Text` for each piece of an answer that
became final, then `Finished` (or `Failed`) per answer; a `select_only` request (the server's --upstream relay)
reports the kept token ids instead (`Selected`). The server turns them into OpenAI's responses and chunks, the
offline entry points into `GenerationResult`s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from kvsieve.decode import TokenLogprob
from kvsieve.engine.pipeline import RunState, StageRecord


@dataclass
class Started:
    """Prefill is done; `info` says what the stages did. The first text follows."""

    info: dict[str, Any]
    prompt_logprobs: list[TokenLogprob] | None = None  # when Sampling.prompt_logprobs asked for them


@dataclass
class Text:
    piece: str
    tokens: int  # answer tokens so far (a piece can span several tokens, or wait for the next)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of this piece's tokens, when asked for
    index: int = 0  # which of the request's n answers
    ids: list[int] = field(default_factory=list)  # the answer's tokens since the last event (a token streamer's)


@dataclass
class Finished:
    reason: str  # "eos", "stop" or "length"
    completion_tokens: int
    info: dict[str, Any]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of answer tokens no Text reported
    index: int = 0  # which of the request's n answers
    ids: list[int] = field(default_factory=list)  # the answer's tokens no Text reported (its EOS included)


@dataclass
class Selected:
    """A select-only request: the prompt ids the select stage kept."""

    ids: list[int]
    info: dict[str, Any]


@dataclass
class Failed:
    error: Exception  # a KvsieveError: the request asked for something the method cannot do


Event = Started | Text | Finished | Selected | Failed


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    prefill_seconds: float  # time to first token: selection + feed + compression
    decode_seconds: float
    decode_tokens_per_s: float
    prefill_kv_length: int  # cache entries per layer and KV head when the first token was picked
    kv_cache_length: int  # cache entries per layer and KV head when decoding ended
    stages: list[StageRecord]
    selected_indices: list[int] | None = None
    selected_text: str | None = None
    state: RunState | None = field(default=None, repr=False)  # what the run learned (tensors; not in to_dict)
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # each step's raw logits (keep_logits)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: everything but the per-run state and logits."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("state", "logits")}
        data["stages"] = [asdict(stage) for stage in self.stages]
        return data


def json_safe(value: Any) -> Any:
    """`value` with tensors as lists and anything else that JSON cannot hold as its string."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value if isinstance(value, str | int | float | bool | None) else str(value)
