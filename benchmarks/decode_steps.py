"""Decoding speed under each method's cache, a fixed number of steps, side by side in one process.

`kvsieve bench` decodes until EOS (at most 32 tokens), so methods that stop at different steps
are timed over different counts, and every run loads its own model. This script prefills one
needle prompt per method and then times exactly `--steps` greedy steps on it (EOS ignored),
with the methods interleaved inside every repeat, and reports tokens/s and the ratio to the
first method in the same repeat (min / median / max over repeats). For eviction methods it also
times the eviction itself (`EvictRun.after_step`, median ms per step).

    python benchmarks/decode_steps.py --methods full,snapkv,h2o,a2sf --lengths 2048,8000 --steps 48 --repeats 3 \\
        --out runs/study/decode_steps.json

Pause other work on the machine while it runs (the timings are wall-clock).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvsieve import load_model
from kvsieve.attention import attention_hooks
from kvsieve.data import prompt_case
from kvsieve.decode import step
from kvsieve.eval.bench import spread as bench_spread
from kvsieve.pipeline import prefill
from kvsieve.registry import method


def timed_decode(model, prompt, name: str, steps: int) -> dict:
    """Prefill `prompt` with method `name`, then time `steps` greedy steps; tokens/s and eviction ms per step."""
    done = prefill(model, prompt, method=method(name), reserve=steps + 8)
    cache, logits, position = done.prefilled.cache, done.prefilled.last_logits, done.prefilled.next_position
    run = done.state.evict
    evicting: list[float] = []
    if run is not None:
        run.buffer(cache)
        after_step = run.after_step

        def timed_after_step(c) -> None:
            start = time.perf_counter()
            after_step(c)
            evicting.append(time.perf_counter() - start)

        run.after_step = timed_after_step
    with torch.no_grad(), attention_hooks(observers=run.step_observers() if run is not None else ()):
        start = time.perf_counter()
        for _ in range(steps):
            logits = step(model, cache, torch.argmax(logits).view(1, 1), position, run)
            position += 1
        seconds = time.perf_counter() - start
    return {
        "tokens_per_s": steps / seconds,
        "evict_ms_per_step": statistics.median(evicting) * 1e3 if evicting else None,
        "kv_entries": cache.get_seq_length(),
    }


def spread(values: list[float]) -> dict:
    """kvsieve bench's (min, median, max), named for the JSON record."""
    return dict(zip(("min", "median", "max"), bench_spread(values), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="full,snapkv,h2o,a2sf", help="registry names; the first is the baseline")
    parser.add_argument("--lengths", default="2048,8000", help="prompt lengths in tokens")
    parser.add_argument("--steps", type=int, default=48, help="greedy steps timed per run (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats, methods interleaved within each")
    parser.add_argument("--out", type=Path, default=Path("runs/study/decode_steps.json"), help="output JSON")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")

    names = args.methods.split(",")
    for name in names:
        method(name)  # an unknown name fails here, before any prefill
    model, tokenizer = load_model()
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        _, prompt = prompt_case(tokenizer, "needle", length, 0.5)
        runs = {name: [] for name in names}
        for _ in tqdm(range(args.repeats), desc=f"{length} tokens", unit="repeat"):
            for name in names:
                runs[name].append(timed_decode(model, prompt, name, args.steps))
        base = runs[names[0]]
        for name in names:
            evict = [r["evict_ms_per_step"] for r in runs[name] if r["evict_ms_per_step"] is not None]
            rows.append(
                {
                    "method": name,
                    "length": length,
                    "kv_entries": runs[name][0]["kv_entries"],
                    "tokens_per_s": spread([r["tokens_per_s"] for r in runs[name]]),
                    "ratio": spread(
                        [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs[name], base, strict=True)]
                    ),
                    "evict_ms_per_step": spread(evict) if evict else None,
                }
            )
    record = {
        "command": "python benchmarks/decode_steps.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"{'method':12s} {'tokens':>6s} {'tok/s (min/med/max)':>22s} {'vs ' + names[0]:>20s} {'evict ms':>9s}")
    for r in rows:
        t, q = r["tokens_per_s"], r["ratio"]
        e = f"{r['evict_ms_per_step']['median']:.2f}" if r["evict_ms_per_step"] else "-"
        print(
            f"{r['method']:12s} {r['length']:6d} {t['min']:6.2f} {t['median']:6.2f} {t['max']:6.2f}"
            f"     {q['min']:5.2f} {q['median']:5.2f} {q['max']:5.2f} {e:>9s}"
        )


if __name__ == "__main__":
    main()
