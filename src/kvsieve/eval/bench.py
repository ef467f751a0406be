"""Time-to-first-token and peak memory, each configuration in its own process.

Machines here are shared and noisy, so configurations are interleaved (every repeat runs every
configuration once) and compared as ratios within the same repeat. Peak memory on CPU is the
worker process's peak resident set size (VmHWM), reset after the model is loaded and warmed up,
so `peak_mb` covers weights plus everything the measured call allocated; `added_mb` is the peak
above the resident size just before the call. On CUDA it is `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from kvsieve.errors import KvsieveError

# Tokens of chat template and question around the context, so a bench "length" is the prompt's.
PROMPT_OVERHEAD = 64


@dataclass(frozen=True)
class BenchConfig:
    method: str  # "full", "gemfilter" or a KV method name (snapkv, h2o, a2sf, streaming, local)
    length: int  # prompt tokens
    k: int = 1024
    layer: int | None = None
    budget: int = 1024
    alpha: float = 0.2
    decode_tokens: int = 32
    model: str | None = None
    chunk: int = 1024
    memory: int = 1024
    schedule: str | None = None
    pruner: str = "snapkv"


def method_stages(
    method: str,
    *,
    k: int | float = 1024,
    layer: int | None = None,
    budget: int | float = 1024,
    alpha: float = 0.2,
    fusion_alpha: float = 0.25,
    chunk: int = 1024,
    memory: int = 1024,
    schedule: str | None = None,
    pruner: str = "snapkv",
) -> dict:
    """The pipeline stages a method name stands for in benchmarks and evaluation grids.

    full: nothing; gemfilter: GemFilter(k, layer); critiprefill: CritiPrefill (paper sizes) with
    `fusion_alpha`; fm / im / imdc: chunked feeds (chunk, memory, schedule, pruner); KV methods
    compress the cache to `budget` after a full prefill and, where they have a per-step rule (all
    but SnapKV), keep evicting to the same budget while decoding.
    """
    from kvsieve.attention.critiprefill import CritiPrefill
    from kvsieve.compress.methods import METHODS, make_method, supports_decode
    from kvsieve.compress.stages import Compress, Evict
    from kvsieve.feed.chunked import FEEDS, make_feed
    from kvsieve.select.gemfilter import GemFilter

    if method == "full":
        return {}
    if method in FEEDS:
        pruning = make_method(pruner, alpha=alpha)
        return {"feed": make_feed(method, chunk=chunk, memory=memory, schedule=schedule, pruner=pruning)}
    if method == "gemfilter":
        return {"select": GemFilter(k=k, layer=layer)}
    if method == "critiprefill":
        return {"attention": CritiPrefill(alpha=fusion_alpha)}
    if method in METHODS:
        kv_method = make_method(method, alpha=alpha)
        stages = {"compress": Compress(kv_method, budget)}
        if supports_decode(kv_method):
            stages["evict"] = Evict(kv_method, budget)
        return stages
    raise KvsieveError(
        f"Unknown method '{method}'; use full, gemfilter, critiprefill, fm, im, imdc or one of {', '.join(METHODS)}."
    )


def stages_for(config: BenchConfig) -> dict:
    """The stages of one bench configuration."""
    return method_stages(
        config.method,
        k=config.k,
        layer=config.layer,
        budget=config.budget,
        alpha=config.alpha,
        chunk=config.chunk,
        memory=config.memory,
        schedule=config.schedule,
        pruner=config.pruner,
    )


def _memory_status(field: str) -> float:
    """A VmRSS / VmHWM value of this process in MB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KvsieveError(f"/proc/self/status has no {field}; peak memory needs Linux.")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def measure(config: BenchConfig) -> dict:
    """Run one configuration in this process and return its timings and memory."""
    import torch

    from kvsieve.decode import Sampling
    from kvsieve.eval.data import needle_case
    from kvsieve.models import load_model
    from kvsieve.pipeline import run
    from kvsieve.prompt import build_prompt

    model, tokenizer = load_model(config.model)
    stages_for(config)  # validate before any work
    case = needle_case(tokenizer, config.length - PROMPT_OVERHEAD, 0.5)
    prompt = build_prompt(tokenizer, case.context, case.question)
    sampling = Sampling(max_new_tokens=config.decode_tokens)
    warm = build_prompt(tokenizer, needle_case(tokenizer, 2 * config.k, 0.5).context, case.question)
    run(model, tokenizer, warm, sampling=sampling, **stages_for(config))  # warm-up: allocator, kernels
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _reset_peak_rss()
    before = _memory_status("VmRSS")
    result = run(model, tokenizer, prompt, sampling=sampling, **stages_for(config))
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _memory_status("VmHWM")
    return {
        "method": config.method,
        "length": prompt.length,
        "ttft_s": result.prefill_seconds,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "peak_mb": peak,
        "added_mb": peak - (0 if cuda else before),
        "prefill_kv_length": result.prefill_kv_length,
        "kv_cache_length": result.kv_cache_length,
        "generated_tokens": len(result.tokens),
        "layer": result.stages[0].details.get("layer") if config.method == "gemfilter" else None,
    }


def run_in_process(config: BenchConfig) -> dict:
    """Measure `config` in a fresh Python process (clean peak memory)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvsieve.eval.bench", json.dumps(config.__dict__)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise KvsieveError(f"Benchmark worker for {config} failed:\n{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def bench(methods: Sequence[str], lengths: Sequence[int], repeats: int, **options) -> list[dict]:
    """Every (repeat, length, method) in its own process, configurations interleaved.

    `options` are the other BenchConfig fields (k, layer, budget, alpha, decode_tokens, model,
    chunk, memory, schedule, pruner).
    """
    if repeats < 1 or not lengths or not methods:
        raise KvsieveError("bench needs at least one method, one length and one repeat.")
    for method in methods:
        stages_for(BenchConfig(method, lengths[0], **options))  # fail fast on a bad name or option
    rows = []
    grid = [(r, n, m) for r in range(repeats) for n in lengths for m in methods]
    for rep, length, method in tqdm(grid, desc="bench", unit="run"):
        row = run_in_process(BenchConfig(method, length, **options))
        rows.append({**row, "repeat": rep, "requested_length": length})
    return rows


def summarize(rows: list[dict], baseline: str = "full") -> list[dict]:
    """Per (length, method): min/median/max of TTFT and peak memory, and same-repeat ratios vs `baseline`."""
    summary = []
    keys = sorted({(r["requested_length"], r["method"]) for r in rows})
    for length, method in keys:
        mine = {r["repeat"]: r for r in rows if r["requested_length"] == length and r["method"] == method}
        base = {r["repeat"]: r for r in rows if r["requested_length"] == length and r["method"] == baseline}
        pairs = [(base[i], mine[i]) for i in mine if i in base]
        summary.append(
            {
                "length": length,
                "method": method,
                "ttft_s": spread([r["ttft_s"] for r in mine.values()]),
                "decode_tokens_per_s": spread([r["decode_tokens_per_s"] for r in mine.values()]),
                "peak_mb": spread([r["peak_mb"] for r in mine.values()]),
                "added_mb": spread([r["added_mb"] for r in mine.values()]),
                "speedup": spread([b["ttft_s"] / m["ttft_s"] for b, m in pairs]) if pairs else None,
                "memory_ratio": spread([m["peak_mb"] / b["peak_mb"] for b, m in pairs]) if pairs else None,
                "added_ratio": spread(added)
                if (added := [m["added_mb"] / b["added_mb"] for b, m in pairs if b["added_mb"] > 0])
                else None,
            }
        )
    return summary


if __name__ == "__main__":  # worker entry point: one configuration, one JSON line on stdout
    print(json.dumps(measure(BenchConfig(**json.loads(sys.argv[1])))))
