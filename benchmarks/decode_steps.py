"""Decoding speed under each method's cache, a fixed number of steps, side by side in one process.

`kvsieve bench` decodes until EOS (at most 32 tokens), so methods that stop at different steps
are timed over different counts, and every run loads its own model. This script prefills one
needle prompt per method and then times exactly `--steps` greedy steps on it (EOS ignored),
with the methods interleaved inside every repeat, and reports tokens/s and the ratio to the
first method in the same repeat (min / median / max over repeats). For eviction methods it also
times the eviction itself (`EvictRun.after_step`, mean ms per step: with `evict.interval` > 1 most
steps evict nothing).

    python benchmarks/decode_steps.py --methods full,snapkv,h2o,a2sf --lengths 2048,8000 --steps 48 --repeats 3 \\
        --out runs/study/decode_steps.json

By default every repeat prefills each method again and times its first steps. `--shared-prefill`
prefills each method once per length and lets every repeat time the next `--steps` steps, so the
timed stretches of the methods follow one another closely with no prefill in between (steadier on
a shared machine; `--steps` x `--repeats` then has to fit in the model's positions). A method
may carry settings, e.g. `h2o:evict.interval=8`:

    python benchmarks/decode_steps.py --methods full,snapkv,h2o,a2sf --lengths 2048,8000 --steps 24 --repeats 7 \\
        --shared-prefill --out runs/study/decode_steps_shared.json

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
from kvsieve.spec import MethodSpec, parse_settings

WARMUP = 2  # untimed steps after a shared prefill (the first steps after a long prefill run slower)


def spec(entry: str) -> MethodSpec:
    """A `--methods` entry: a registry name, optionally with settings, `NAME:PATH=VALUE[:PATH=VALUE]`."""
    name, *settings = entry.split(":")
    return method(name, parse_settings(settings))


class Decoder:
    """One method's prefilled prompt, decoded greedily (EOS ignored) in timed batches of steps."""

    def __init__(self, model, prompt, name: str, reserve: int):
        done = prefill(model, prompt, method=spec(name), reserve=reserve)
        self.model = model
        self.cache, self.logits = done.prefilled.cache, done.prefilled.last_logits
        self.position = done.prefilled.next_position
        self.run = done.state.evict
        self.evicting: list[float] = []
        if self.run is not None:
            self.run.buffer(self.cache)
            after_step = self.run.after_step

            def timed_after_step(cache) -> None:
                start = time.perf_counter()
                after_step(cache)
                self.evicting.append(time.perf_counter() - start)

            self.run.after_step = timed_after_step

    def timed(self, steps: int) -> dict:
        """Decode `steps` more tokens; tokens/s and the eviction's mean ms per step over them."""
        self.evicting.clear()
        observers = self.run.step_observers() if self.run is not None else ()
        with torch.no_grad(), attention_hooks(observers=observers):
            start = time.perf_counter()
            for _ in range(steps):
                token = torch.argmax(self.logits).view(1, 1)
                self.logits = step(self.model, self.cache, token, self.position, self.run)
                self.position += 1
            seconds = time.perf_counter() - start
        return {
            "tokens_per_s": steps / seconds,
            "evict_ms_per_step": statistics.mean(self.evicting) * 1e3 if self.evicting else None,
            "kv_entries": self.cache.get_seq_length(),
        }


def timed_runs(
    model, prompt, names: list[str], steps: int, repeats: int, shared: bool, label: str
) -> dict[str, list[dict]]:
    """Per method, one timing per repeat, the methods interleaved within every repeat.

    Without `shared` every repeat prefills each method afresh and times its first `steps` steps.
    With it every method is prefilled once, decodes `WARMUP` untimed steps, and each repeat then
    times its next `steps` steps: no prefill runs between two timings, so they compare steady
    decoding only.
    """
    runs: dict[str, list[dict]] = {name: [] for name in names}
    if shared:
        decoders = {name: Decoder(model, prompt, name, WARMUP + steps * repeats + 8) for name in names}
        for decoder in decoders.values():
            decoder.timed(WARMUP)
    for _ in tqdm(range(repeats), desc=label, unit="repeat"):
        for name in names:
            decoder = decoders[name] if shared else Decoder(model, prompt, name, steps + 8)
            runs[name].append(decoder.timed(steps))
    return runs


def spread(values: list[float]) -> dict:
    """kvsieve bench's (min, median, max), named for the JSON record."""
    return dict(zip(("min", "median", "max"), bench_spread(values), strict=True))


def command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run."""
    words = ["python benchmarks/decode_steps.py"]
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif value is not False:
            words.append(f"{flag} {value}")
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--methods",
        default="full,snapkv,h2o,a2sf",
        help="registry names, each optionally with settings (h2o:evict.interval=8); the first is the baseline",
    )
    parser.add_argument("--lengths", default="2048,8000", help="prompt lengths in tokens")
    parser.add_argument("--steps", type=int, default=48, help="greedy steps timed per run (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats, methods interleaved within each")
    parser.add_argument(
        "--shared-prefill",
        action="store_true",
        help="prefill each method once per length; every repeat then times its next --steps steps",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/study/decode_steps.json"), help="output JSON")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")

    names = args.methods.split(",")
    for name in names:
        spec(name)  # an unknown name or setting fails here, before any prefill
    model, tokenizer = load_model()
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        _, prompt = prompt_case(tokenizer, "needle", length, 0.5)
        runs = timed_runs(model, prompt, names, args.steps, args.repeats, args.shared_prefill, f"{length} tokens")
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
        "command": command(args),
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    width = max(12, *(len(name) for name in names))
    print(f"{'method':{width}s} {'tokens':>6s} {'tok/s (min/med/max)':>22s} {'vs ' + names[0]:>20s} {'evict ms':>9s}")
    for r in rows:
        t, q = r["tokens_per_s"], r["ratio"]
        e = f"{r['evict_ms_per_step']['median']:.2f}" if r["evict_ms_per_step"] else "-"
        print(
            f"{r['method']:{width}s} {r['length']:6d} {t['min']:6.2f} {t['median']:6.2f} {t['max']:6.2f}"
            f"     {q['min']:5.2f} {q['median']:5.2f} {q['max']:5.2f} {e:>9s}"
        )


if __name__ == "__main__":
    main()
