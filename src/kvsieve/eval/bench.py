"""Time-to-first-token and peak memory, each configuration in its own process.

Machines here are shared and noisy, so configurations are interleaved (every repeat runs every
configuration once) and compared as ratios within the same repeat. Peak memory on CPU is the
worker process's peak resident set size (VmHWM), reset after the model is loaded and warmed up,
so `peak_mb` covers weights plus everything the measured call allocated; `added_mb` is the peak
above the resident size just before the call. On CUDA they are the allocator's (`kvsieve.memory.PeakWatch`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from kvsieve import figures
from kvsieve.errors import KvsieveError
from kvsieve.eval import records
from kvsieve.spec import MethodSpec

if TYPE_CHECKING:
    import torch

    from kvsieve.memory import PeakWatch


@dataclass(frozen=True)
class BenchConfig:
    """One measured run: a method's exact spec (JSON form), the prompt length and the model to load."""

    spec: dict[str, Any]  # MethodSpec.to_dict(): the worker rebuilds the very same stages
    length: int  # prompt tokens
    decode_tokens: int = 32
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None

    @classmethod
    def from_json(cls, text: str) -> BenchConfig:
        return cls(**json.loads(text))

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def peak_watch(device: torch.device) -> PeakWatch:
    """A `PeakWatch` for `device`, or a clear error where its peak memory cannot be read."""
    from kvsieve.memory import PeakWatch

    watch = PeakWatch(device)
    if not watch.measures:
        raise KvsieveError(
            f"Peak memory on {device.type} needs CUDA, or Linux's /proc/self/clear_refs on a CPU; neither is here."
        )
    return watch


def measure(config: BenchConfig) -> dict:
    """Run one configuration in this process and return its timings and memory."""
    from kvsieve.data import prompt_case
    from kvsieve.decode import Sampling
    from kvsieve.engine import run
    from kvsieve.loading import load_model

    spec = MethodSpec.from_dict(config.spec)  # validate before any work
    model, tokenizer = load_model(config.model, device=config.device, dtype=config.dtype, quantize=config.quantize)
    _, prompt = prompt_case(tokenizer, "needle", config.length, 0.5)
    sampling = Sampling(max_new_tokens=config.decode_tokens, ignore_eos=True)  # same step count for every method
    _, warm = prompt_case(tokenizer, "needle", min(2048, config.length), 0.5)
    run(model, tokenizer, warm, method=spec, sampling=sampling)  # warm-up: allocator, kernels
    watch = peak_watch(model.device)
    watch.start()
    result = run(model, tokenizer, prompt, method=spec, sampling=sampling)
    added = watch.peak()
    return {
        "method": spec.name,
        "length": prompt.length,
        "ttft_s": result.prefill_seconds,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "peak_mb": (watch.base + added) / 2**20,
        "added_mb": added / 2**20,
        "prefill_kv_length": result.prefill_kv_length,
        "kv_cache_length": result.kv_cache_length,
        "generated_tokens": len(result.tokens),
        "layer": result.stages[0].details.get("layer") if result.stages[0].stage == "select" else None,
    }


def run_in_process(config: BenchConfig) -> dict:
    """Measure `config` in a fresh Python process (clean peak memory), with this process's fast paths."""
    from kvsieve import fast_paths

    proc = subprocess.run(
        [sys.executable, "-m", "kvsieve.eval.bench", config.to_json()],
        capture_output=True,
        text=True,
        env={**os.environ, **fast_paths.environment()},
    )
    if proc.returncode != 0:
        raise KvsieveError(f"Benchmark worker for {config} failed:\n{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)


def bench(
    specs: Mapping[str, MethodSpec],
    lengths: Sequence[int],
    repeats: int,
    out: Path,
    *,
    decode_tokens: int = 32,
    model: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    quantize: str | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Every (repeat, length, method) in its own process, configurations interleaved; saved to `out`.

    Rows are saved after every run; rerunning with the same settings resumes where it stopped.
    """
    if repeats < 1 or not lengths or not specs:
        raise KvsieveError("bench needs at least one method, one length and one repeat.")
    methods = {name: spec.to_dict() for name, spec in specs.items()}
    settings = {"methods": methods, "decode_tokens": decode_tokens, "model": model, "device": device, "dtype": dtype}
    if quantize not in (None, "none"):  # files written before `quantize` existed still resume
        settings["quantize"] = quantize
    document = records.open_results(out, "bench", settings, fresh=fresh)
    done = {(r["repeat"], r["requested_length"], r["method"]) for r in document["rows"]}
    grid = [(r, n, m) for r in range(repeats) for n in lengths for m in methods if (r, n, m) not in done]
    for rep, length, method in tqdm(grid, desc="bench", unit="run"):
        row = run_in_process(BenchConfig(methods[method], length, decode_tokens, model, device, dtype, quantize))
        document["rows"].append({**row, "repeat": rep, "requested_length": length})
        records.save(out, document)
    if not grid:
        records.save(out, document)
    return document


def summarize(rows: list[dict], baseline: str = "full") -> list[dict]:
    """Per (length, method): min/median/max of TTFT, decode speed and peak memory, and same-repeat ratios vs
    `baseline` (speedup, memory_ratio, added_ratio, decode_ratio)."""
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
                "decode_ratio": spread(decode)
                if (
                    decode := [
                        m["decode_tokens_per_s"] / b["decode_tokens_per_s"]
                        for b, m in pairs
                        if b["decode_tokens_per_s"]
                    ]
                )
                else None,
                "added_ratio": spread(added)
                if (added := [m["added_mb"] / b["added_mb"] for b, m in pairs if b["added_mb"] > 0])
                else None,
            }
        )
    return summary


def plot_scaling(summary: list[dict], path: Path, title: str = "") -> Path:
    """Log-log cost against prompt length per method: TTFT, decode tokens/s, peak memory (median, min-max bars)."""
    plt = figures.pyplot()

    if not summary:
        raise KvsieveError("No benchmark rows to plot yet.")
    panels = [("ttft_s", "time to first token (s)"), ("decode_tokens_per_s", "decode tokens/s"), ("peak_mb", "peak MB")]
    panels = [(key, label) for key, label in panels if any(s[key][1] > 0 for s in summary)]  # a prefill-only run
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for method in dict.fromkeys(s["method"] for s in summary):
        mine = sorted((s for s in summary if s["method"] == method), key=lambda s: s["length"])
        lengths = [s["length"] for s in mine]
        for ax, (key, label) in zip(axes, panels, strict=True):
            low, mid, high = zip(*(s[key] for s in mine), strict=True)
            errors = [[m - lo for m, lo in zip(mid, low, strict=True)], [h - m for m, h in zip(mid, high, strict=True)]]
            ax.errorbar(lengths, mid, yerr=errors, marker="o", capsize=3, label=method)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "cost against prompt length (median, bars: min-max over repeats)")
    return figures.save(fig, path, dpi=100)


if __name__ == "__main__":  # worker entry point: one configuration, one JSON line on stdout
    print(json.dumps(measure(BenchConfig.from_json(sys.argv[1]))))
