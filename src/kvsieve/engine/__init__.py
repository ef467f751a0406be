"""The engine: the one request lifecycle every entry point shares (vLLM's engine core, in small).

Everything outside this package uses the names imported here, never the modules below (an architecture test keeps
it so): the library's `run`/`generate`, the evaluations, the server and the benchmarks submit `Request`s to a
`Scheduler`, or run the stages once with `prefill`, and read the results and events defined here.

    pipeline.py      `prefill`: select -> feed -> compress (and start evict) on one prompt, with context reuse
    slices.py        prefill that pauses between decoder layers once it has spent a token budget
    request.py       one request: prefill in slices, then decoding steps; its events and result
    batch.py         the running requests' caches in shared tables, one step for every batch size, in place
    scheduler.py     each step: a decoding token for every running request plus budgeted prefill
    prefix_cache.py  stored prompt prefixes that later requests continue (exact context reuse)
    continuation.py  a prefilled cache fed tokens the caller chooses (teacher forcing: perplexity)
    offline.py       `run` / `generate`: the library drives its requests to the end

`kvsieve serve` (serve/) is only the HTTP front of a `Scheduler`; it has no prefill or decoding of its own. The
registry of presets is looked up by the entry points (`generate`, the CLI, the server), never below them: below,
a method is a `MethodSpec`.
"""

from kvsieve.engine.batch import DecodeBatch, Row, warm_up
from kvsieve.engine.continuation import Continuation, forced_logits
from kvsieve.engine.events import Event, Failed, Finished, GenerationResult, Selected, Started, Text
from kvsieve.engine.offline import generate, resolve_method, run
from kvsieve.engine.pipeline import (
    PrefillResult,
    RunState,
    StageRecord,
    positions_needed,
    prefill,
    select_tokens,
)
from kvsieve.engine.prefix_cache import (
    PrefixCache,
    fill_prefix_caches,
    fillable,
    parse_bytes,
    parse_reuse_budget,
    reuse_compress,
)
from kvsieve.engine.request import Request
from kvsieve.engine.scheduler import Scheduler

__all__ = [
    "Continuation",
    "DecodeBatch",
    "Event",
    "Failed",
    "Finished",
    "GenerationResult",
    "PrefillResult",
    "PrefixCache",
    "Request",
    "Row",
    "RunState",
    "Scheduler",
    "Selected",
    "StageRecord",
    "Started",
    "Text",
    "fill_prefix_caches",
    "fillable",
    "forced_logits",
    "generate",
    "parse_bytes",
    "parse_reuse_budget",
    "positions_needed",
    "prefill",
    "reuse_compress",
    "resolve_method",
    "run",
    "select_tokens",
    "warm_up",
]
