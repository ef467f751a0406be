"""`kvsieve serve`: the OpenAI-compatible server (docs/SERVING.md)."""

from __future__ import annotations

import argparse
import copy
import os
import signal
from pathlib import Path

from kvsieve.cli import options


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve the model on OpenAI's API (POST /v1/chat/completions, /v1/completions; GET /v1/models, /health, /metrics).
    Requests choose a method with the body field {"kvsieve": {"method": NAME, "set": {...}}}; decoding steps of all
    requests run as one batch, with long prefills sliced between them; the states of recent prompt prefixes are
    reused exactly (the method still sees the whole prompt)."""
    from kvsieve.engine import parse_bytes, parse_reuse_budget
    from kvsieve.loading import DEFAULT_MODEL
    from kvsieve.serve import create_server

    spec = options.spec_of(args)  # a bad method fails before the model loads
    cache_bytes = parse_bytes(args.cache_memory)
    reuse_budget = parse_reuse_budget(args.reuse_budget)
    api_key = args.api_key or os.environ.get("KVSIEVE_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        options.say(f"kvsieve: warning: serving on {args.host} without --api-key: anyone who can reach it can use it.")
    model, tokenizer = options.load_off_main_thread(args)
    name = args.served_model_name or (Path(args.model).name if args.model else DEFAULT_MODEL)
    app = create_server(
        model,
        tokenizer,
        model_name=name,
        spec=spec,
        api_key=api_key,
        cache_bytes=cache_bytes,
        reuse_budget=reuse_budget,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        max_step_tokens=args.max_step_tokens or None,
        max_body_bytes=parse_bytes(args.max_body),
        max_prompt_tokens=args.max_prompt_tokens,
        default_max_tokens=args.default_max_tokens,
        upstream=args.upstream,
        upstream_model=args.upstream_model,
        upstream_api_key=os.environ.get("KVSIEVE_UPSTREAM_API_KEY"),
        upstream_timeout=args.upstream_timeout,
    )
    import uvicorn

    where = f" -> upstream {args.upstream}" if args.upstream else ""
    options.say(f"kvsieve: serving {name} with method {spec.name} on http://{args.host}:{args.port}/v1{where}")
    # uvicorn shuts down gracefully on SIGTERM, then restores the handler it found and raises the signal again; with
    # Python's default the process would then die of it (status -15) after a clean stop. A stop asked for is a
    # finished run: exit status 0, as service managers expect. (Ctrl-C still ends as "interrupted", 130.)
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, log_config=stderr_logging())


def stderr_logging() -> dict:
    """uvicorn's logging, its access lines on standard error like every other message of kvsieve's (uvicorn
    writes them to standard output, which kvsieve keeps for answers)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    return config


def add(sub: argparse._SubParsersAction) -> None:
    """Add serve to the command line."""
    p = options.command(
        sub, "serve", "an OpenAI-compatible server: batching, compressed-context reuse, --upstream", cmd_serve
    )
    options.add_method(p, multi=False, default="full")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        help="require Authorization: Bearer KEY on every endpoint but /health (default: $KVSIEVE_API_KEY, else none)",
    )
    p.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    p.add_argument(
        "--cache-memory",
        default="2GB",
        help="bytes of reusable prompt states kept, LRU (default 2GB; 0 turns reuse off). It bounds the prefix "
        "cache only: the process also holds the model, the running requests' caches and a prefill's working memory "
        "(docs/SERVING.md#memory-what-the-server-holds)",
    )
    p.add_argument(
        "--reuse-budget",
        default="whole",
        help="KV entries a stored context keeps: 'whole' (default: exact reuse, every answer as generate gives it), "
        "a count (2048) or a fraction of the context (0.5), compressed by the method's own policy before the "
        "question is known (smaller states, more of them fit; the record says query_aware=false)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting before 429 (default 64)")
    p.add_argument("--max-batch", type=int, default=16, help="requests prefilling or decoding at once (default 16)")
    p.add_argument(
        "--max-step-tokens",
        type=int,
        default=512,
        help="tokens one engine step runs: a decoding token per running request plus prefill up to this budget, "
        "so a long prompt delays running streams by one slice, not its whole prefill (vLLM's "
        "max_num_batched_tokens; default 512; 0 = whole prefills)",
    )
    p.add_argument("--max-body", default="4MB", help="largest request body (default 4MB)")
    p.add_argument("--max-prompt-tokens", type=int, default=131072, help="longest prompt (default 131072)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request omits it")
    p.add_argument(
        "--upstream",
        metavar="URL",
        help="run only the select stage here and send the kept token ids to this OpenAI-compatible server "
        "(vLLM, SGLang, kvsieve); its API key comes from $KVSIEVE_UPSTREAM_API_KEY",
    )
    p.add_argument(
        "--upstream-timeout",
        type=float,
        default=600,
        help="seconds to wait for the upstream's answer before 504 (default 600)",
    )
    p.add_argument("--upstream-model", help="model name for the upstream (default: the first it lists)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
