"""Decoding speed under each method's cache, a fixed number of steps, side by side in one process.

`kvsieve bench` decodes until EOS (at most 32 tokens), so methods that stop at different steps
are timed over different counts, and every run loads its own model. This script prefills one
needle prompt per method and then times exactly `--steps` greedy steps on it (EOS ignored), through
the engine's decoding batch (`kvsieve.engine.DecodeBatch`, what `kvsieve generate`, `run` and
the server step), with the methods interleaved inside every repeat. It reports the time per step
(one token for each of `--batches` rows), tokens/s and the ratio to the first method in the same
repeat (min / median / max over repeats). For eviction methods it also times the eviction itself
(`EvictRun.after_step`, mean ms per step and row: with `evict.interval` > 1 most steps evict nothing).

The weight-streaming limit is the time to read a tensor as large as the weights a step reads once
(`tensor.sum()`; `step_bytes`), the least a batch-1 decoding step can take when memory bandwidth bounds
it. It is measured just before and just after every timed stretch (the fastest of those 6 reads), so each
repeat's step time is a multiple of the limit measured beside it (`x_weight_limit`; the limits themselves in
`weight_stream_ms`): on a VM whose memory speed drifts over minutes, a limit measured once at the start
(the record's top-level `weight_stream_ms`, fastest of 5) can be off by more than the steps differ.
`--quantize none,int8` times the same methods with int8 weights too (`kvsieve.quantize`),
after the float32 ones, in the same run (rows `METHOD+int8`, each against its own scheme's limit).

    python benchmarks/decode_steps.py --methods full,snapkv,h2o,a2sf --lengths 2048,8000 --steps 48 --repeats 3 \\
        --out runs/study/decode_steps.json

Rows of a batch decode copies of one prefilled prompt (`--batches 1,4,8`). `--profile` runs
torch.profiler over one extra timed stretch per method and batch and reports where a step's time
goes: the decoder layers' attention and MLP modules, the LM head, the eviction, and the time no
operator accounts for (Python, dispatch), with the slowest operators.

By default every repeat prefills each method again and times its first steps. `--shared-prefill`
prefills each method once per length and lets every repeat time the next `--steps` steps, so the
timed stretches of the methods follow one another closely with no prefill in between (steadier on
a shared machine; `--steps` x `--repeats` then has to fit in the model's positions). A method
may carry settings, e.g. `h2o:evict.interval=8`:

    python benchmarks/decode_steps.py --methods full,snapkv,h2o,a2sf --lengths 2048,8000 --steps 24 --repeats 7 \\
        --shared-prefill --out runs/study/decode_steps_shared.json

On CUDA the batch captures its steps as CUDA graphs (`kvsieve.engine.static_step`) where no row evicts;
`--cuda-graphs both` times every method twice, captured (its name) and eager (`NAME/eager`), side by side,
and reports the captures and the seconds they took (each capture includes one eager step).
On a CPU a step's products of a few rows run through kvsieve's compiled kernel (`kvsieve.kernels.products`);
`--fused-products both` also times every method with PyTorch's own products (`NAME/pytorch`).
`--compiled-steps both` also times every method with the batch's whole step compiled on the CPU
(`NAME/compiled`, `DecodeBatch(compiled=True)`; rows that evict take the ordinary step there); each
timing records its batch's first step (`first_step_s`: there, the compile). A CPU step's attention runs
through kvsieve's decoding attention kernel (`kvsieve.kernels.attention`); `--attention-kernel both`
also times every method with PyTorch's attention (`NAME/torch-attention`).

Pause other work on the machine while it runs (the timings are wall-clock).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

from kvsieve import fast_paths, load_model, prepare
from kvsieve.data import prompt_case
from kvsieve.engine import DecodeBatch, PrefillResult, Row, prefill
from kvsieve.eval.bench import spread as bench_spread
from kvsieve.kv.cache import wrap_cache
from kvsieve.prompt import Prompt
from kvsieve.quantize import quantize
from kvsieve.registry import method
from kvsieve.spec import MethodSpec, parse_settings

WARMUP = 2  # untimed steps after a shared prefill (the first steps after a long prefill run slower)
PARTS = ("self_attn", "mlp", "lm_head", "evict")  # the parts of a step the profile names


def spec(entry: str) -> MethodSpec:
    """A `--methods` entry: a registry name, optionally with settings, `NAME:PATH=VALUE[:PATH=VALUE]`."""
    name, *settings = entry.split(":")
    return method(name, parse_settings(settings))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_bytes(model) -> int:
    """The bytes of weights a batch-1 decoding step reads: every parameter and buffer (int8 weights are
    buffers) once, tied ones once, but not the input embedding table (a step reads one row of it) unless
    the LM head is that table."""
    head = model.get_output_embeddings().weight
    embedding = model.get_input_embeddings().weight
    unique = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    if embedding.data_ptr() != head.data_ptr():
        unique.pop(embedding.data_ptr())
    return sum(t.numel() * t.element_size() for t in unique.values())


class WeightStream:
    """A float32 tensor of `step_bytes(model)`, read with `sum()`: the floor of a batch-1 decoding step, which
    reads every weight once. Kept for a whole run, so that the limit can be measured beside every timed stretch
    (a VM's memory speed can drift by more than the steps differ: docs/STUDIES.md)."""

    def __init__(self, model):
        self.device = model.device
        self.flat = torch.ones(step_bytes(model) // 4, dtype=torch.float32, device=model.device)

    def ms(self, repeats: int = 5) -> float:
        """One read's time, fastest of `repeats`."""
        times = []
        for _ in range(repeats):
            _sync(self.device)
            start = time.perf_counter()
            self.flat.sum()
            _sync(self.device)
            times.append(time.perf_counter() - start)
        return min(times) * 1e3


def weight_stream_ms(model, repeats: int = 5) -> float:
    """The weight-streaming limit of `model`'s batch-1 step, measured once (`WeightStream`)."""
    return WeightStream(model).ms(repeats)


class Decoder:
    """A method's prefilled prompt, copied into `rows` rows of the engine's decoding batch and decoded
    greedily (EOS ignored) in timed stretches of steps. The prefill itself is left as it was."""

    def __init__(self, model, done: PrefillResult, rows: int, variant: Variant):
        self.model = model
        self.variant = variant
        cache, first = done.prefilled.cache, int(torch.argmax(done.prefilled.last_logits))
        self.batch = DecodeBatch(model, static=variant.static, compiled=variant.compiled)
        self.first_step_s: float | None = None  # the batch's first step (a compiled step's compile time)
        self.evicting: list[float] = []
        for _ in range(rows):
            row_cache = wrap_cache(model, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])
            row_evict = copy.deepcopy(done.state.evict)
            if row_evict is not None and not self.batch.static:  # a captured step's eviction runs on the GPU
                self._time_evictions(row_evict)
            self.batch.add(Row(first, done.prefilled.next_position, row_evict), row_cache)

    def _time_evictions(self, run) -> None:
        after_step = run.after_step

        def timed_after_step(cache) -> None:
            start = time.perf_counter()
            with torch.profiler.record_function("evict"):
                after_step(cache)
            self.evicting.append(time.perf_counter() - start)

        run.after_step = timed_after_step

    def timed(self, steps: int, stream: WeightStream | None = None) -> dict:
        """Decode `steps` more tokens per row; ms per step, tokens/s (all rows) and the eviction's ms per step
        and row; with `stream`, the weight-streaming limit measured just before and just after the stretch
        (fastest of 3 reads each side, `limit_ms`)."""
        limits = [stream.ms(3)] if stream is not None else []
        self.evicting.clear()
        before = fast_paths.configure(fused_products=self.variant.fused, attention_kernel=self.variant.kernel)
        _sync(self.model.device)
        start = time.perf_counter()
        for _ in range(steps):
            if self.first_step_s is None:
                begun = time.perf_counter()
                logits = self.batch.step()
                self.first_step_s = time.perf_counter() - begun
            else:
                logits = self.batch.step()
            for row, token in zip(self.batch.rows, torch.argmax(logits, dim=-1).tolist(), strict=True):
                row.token = token
        _sync(self.model.device)
        seconds = time.perf_counter() - start
        limits += [stream.ms(3)] if stream is not None else []
        fast_paths.configure(fused_products=before.fused_products, attention_kernel=before.attention_kernel)
        return {
            "ms_per_step": seconds / steps * 1e3,
            "tokens_per_s": steps * len(self.batch) / seconds,
            "evict_ms_per_step": statistics.mean(self.evicting) * 1e3 if self.evicting else None,
            "kv_entries": self.batch.entries(0),
            "captures": self.batch.captures,
            "capture_s": self.batch.capture_seconds,
            "first_step_s": self.first_step_s,
            "limit_ms": min(limits) if limits else None,
        }


@contextmanager
def labelled_parts(model):
    """Name every decoder layer's attention and MLP module and the LM head in the profiler's events."""
    handles, open_ranges = [], []

    def enter(name):
        def hook(module, args):
            open_ranges.append(torch.profiler.record_function(name).__enter__())

        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for name, module in model.named_modules():
        part = name.rsplit(".", 1)[-1]
        if part in PARTS:
            handles += [module.register_forward_pre_hook(enter(part)), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def profiled(decoder: Decoder, steps: int, top: int = 12) -> dict:
    """One timed stretch under torch.profiler: ms per step in each named part, in operators, and the slowest
    operators by their own time (ms per step)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if decoder.model.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with labelled_parts(decoder.model), torch.profiler.profile(activities=activities) as prof:
        timing = decoder.timed(steps)
    events = prof.key_averages()
    parts = defaultdict(float)
    for event in events:
        if event.key in PARTS:
            parts[event.key] += event.cpu_time_total / 1e3 / steps
    operators = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
    in_operators = sum(e.self_cpu_time_total for e in operators) / 1e3 / steps
    return {
        "ms_per_step": timing["ms_per_step"],  # under the profiler (slower than unprofiled)
        "parts_ms": {part: round(parts[part], 3) for part in PARTS},
        "operators_ms": round(in_operators, 3),
        "outside_operators_ms": round(timing["ms_per_step"] - in_operators, 3),
        "top_operators_ms": {e.key: round(e.self_cpu_time_total / 1e3 / steps, 3) for e in operators[:top]},
    }


@dataclass(frozen=True)
class Variant:
    """How a timed label decodes: its method, its batch's `static` (None: the default, CUDA graphs on CUDA),
    whether the CPU's few-row products take the fused kernel (`kvsieve.kernels.products`), whether the CPU's step is
    compiled, whether the CPU's attention takes kvsieve's kernel (`kvsieve.kernels.attention`)."""

    method: str
    static: bool | None
    fused: bool
    compiled: bool
    kernel: bool


def variants(
    names: list[str], cuda_graphs: str, fused_products: str, compiled_steps: str = "off", attention_kernel: str = "on"
) -> dict[str, Variant]:
    """Each timed label's `Variant`; `both` adds every method as `NAME/eager` (CUDA graphs off), `NAME/pytorch`
    (PyTorch's products), `NAME/compiled` (the step compiled) or `NAME/torch-attention` (PyTorch's attention)."""
    base = {
        name: Variant(
            name,
            False if cuda_graphs == "off" else None,
            fused_products != "off",
            compiled_steps == "on",
            attention_kernel != "off",
        )
        for name in names
    }
    labels = dict(base)
    for option, suffix, change in (
        (cuda_graphs, "eager", {"static": False}),
        (fused_products, "pytorch", {"fused": False}),
        (compiled_steps, "compiled", {"static": None, "compiled": True}),
        (attention_kernel, "torch-attention", {"kernel": False}),
    ):
        if option == "both":
            labels |= {f"{name}/{suffix}": replace(variant, **change) for name, variant in base.items()}
    return labels


def timed_runs(model, prompt, names: list[str], args, label: str) -> dict[int, tuple[dict, dict]]:
    """Per batch size and method label (`variants`), one timing per repeat, the labels interleaved within every
    repeat (and a profile of each with `args.profile`).

    Each method prefills once; every batch size decodes copies of that prefill. Without `shared_prefill`
    every repeat starts new copies and times their first `steps` steps. With it every method's batch
    decodes `WARMUP` untimed steps, and each repeat then times its next `steps` steps: no copying runs
    between two timings, so they compare steady decoding only.
    """
    steps, repeats, shared = args.steps, args.repeats, args.shared_prefill
    reserve = WARMUP + steps * (repeats + 1) + 8
    done = {name: prefill(model, prompt, method=spec(name), reserve=reserve) for name in names}
    labels = variants(names, args.cuda_graphs, args.fused_products, args.compiled_steps, args.attention_kernel)
    stream = WeightStream(model)

    def decoder_of(name: str, rows: int) -> Decoder:
        return Decoder(model, done[labels[name].method], rows, labels[name])

    results = {}
    for rows in [int(b) for b in args.batches.split(",")]:
        runs: dict[str, list[dict]] = {name: [] for name in labels}
        if shared:
            decoders = {name: decoder_of(name, rows) for name in labels}
            for decoder in decoders.values():
                decoder.timed(WARMUP)
        for _ in tqdm(range(repeats), desc=f"{label} x {rows}", unit="repeat"):
            for name in labels:
                decoder = decoders[name] if shared else decoder_of(name, rows)
                runs[name].append(decoder.timed(steps, stream))
        profiles = {}
        if args.profile:
            for name in labels:
                decoder = decoders[name] if shared else decoder_of(name, rows)
                if not shared:
                    decoder.timed(steps)  # profile steady steps, not the first ones
                profiles[name] = profiled(decoder, steps)
        results[rows] = (runs, profiles)
    return results


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


def random_model(args: argparse.Namespace) -> tuple[torch.nn.Module, None]:
    """`--random-weights`: the architecture of CONFIG_DIR's config.json, random weights, on --device in --dtype."""
    config = AutoConfig.from_pretrained(args.random_weights)
    dtype = getattr(torch, args.dtype or "float32")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    return prepare(AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)), None


def both_ways(parser: argparse.ArgumentParser, flag: str, default: str, on: str, off: str, suffix: str) -> None:
    """A setting timed `on`, `off` or `both` ways (every method also as NAME/`suffix`, the way not the default)."""
    parser.add_argument(
        flag,
        choices=("on", "off", "both"),
        default=default,
        help=f"on: {on}; off: {off}; both: every method both ways, the other way as NAME/{suffix}, side by side",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--methods",
        default="full,snapkv,h2o,a2sf",
        help="registry names, each optionally with settings (h2o:evict.interval=8); the first is the baseline",
    )
    parser.add_argument("--lengths", default="2048,8000", help="prompt lengths in tokens")
    parser.add_argument("--batches", default="1", help="rows decoded together, e.g. 1,4,8 (copies of one prompt)")
    parser.add_argument("--steps", type=int, default=48, help="greedy steps timed per run (EOS ignored)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats, methods interleaved within each")
    parser.add_argument(
        "--shared-prefill",
        action="store_true",
        help="prefill each method once per length; every repeat then times its next --steps steps",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("auto", "off", "both"),
        default="auto",
        help="auto: the batch's default (steps without eviction captured on CUDA); off: eager steps; both: every "
        "method captured and as NAME/eager, side by side",
    )
    both_ways(
        parser,
        "--fused-products",
        "on",
        "a CPU step's few-row products through kvsieve's compiled kernel (the default, `kvsieve.kernels.products`)",
        "PyTorch's products",
        "pytorch",
    )
    both_ways(
        parser,
        "--compiled-steps",
        "off",
        "the CPU's whole decoding step compiled (`DecodeBatch(compiled=True)`)",
        "the default",
        "compiled",
    )
    both_ways(
        parser,
        "--attention-kernel",
        "on",
        "a CPU step's attention through kvsieve's kernel (the default, `kvsieve.kernels.attention`)",
        "PyTorch's attention",
        "torch-attention",
    )
    parser.add_argument(
        "--quantize",
        default="none",
        help="weight schemes timed one after the other in this run, e.g. none,int8 (`kvsieve.quantize`); rows of "
        "a scheme other than none are named METHOD+SCHEME, their ratios against the first scheme's first method",
    )
    parser.add_argument("--profile", action="store_true", help="also profile one stretch per method (torch.profiler)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: the model's loading dtype)")
    parser.add_argument(
        "--random-weights",
        type=Path,
        default=None,
        metavar="CONFIG_DIR",
        help="a model built from this folder's config.json with random weights, fed random token ids (a machine "
        "without the embedded model: a step's time does not depend on the weights' values)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/study/decode_steps.json"), help="output JSON")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error("--steps and --repeats must be at least 1")

    names = args.methods.split(",")
    for name in names:
        spec(name)  # an unknown name or setting fails here, before any prefill
    schemes = args.quantize.split(",")
    model, tokenizer = random_model(args) if args.random_weights else load_model(device=args.device, dtype=args.dtype)
    models = {scheme: quantize(copy.deepcopy(model) if scheme != "none" else model, scheme) for scheme in schemes}
    limits = {scheme: weight_stream_ms(m) for scheme, m in models.items()}
    rows, bases = [], {}
    for length in [int(n) for n in args.lengths.split(",")]:
        if tokenizer is None:  # random ids, the last 20 a question (as the needle prompt's tail)
            ids = torch.randint(100, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
            prompt = Prompt(ids.to(model.device), context_start=0, context_len=length - 20)
        else:
            _, prompt = prompt_case(tokenizer, "needle", length, 0.5)
        for scheme, scheme_model in models.items():
            suffix = "" if scheme == "none" else f"+{scheme}"
            timed = timed_runs(scheme_model, prompt, names, args, f"{length} tokens {scheme}")
            for batch, (runs, profiles) in timed.items():
                base = bases.setdefault((length, batch), runs[names[0]])  # the first scheme's first method
                for name in runs:
                    evict = [r["evict_ms_per_step"] for r in runs[name] if r["evict_ms_per_step"] is not None]
                    step_ms = [r["ms_per_step"] for r in runs[name]]
                    beside = [r["limit_ms"] for r in runs[name]]  # the limit measured around each stretch
                    rows.append(
                        {
                            "method": name + suffix,
                            "quantize": scheme,
                            "weight_stream_ms": spread(beside),
                            "length": length,
                            "batch": batch,
                            "kv_entries": runs[name][0]["kv_entries"],
                            "ms_per_step": spread(step_ms),
                            "x_weight_limit": spread([ms / lim for ms, lim in zip(step_ms, beside, strict=True)]),
                            "tokens_per_s": spread([r["tokens_per_s"] for r in runs[name]]),
                            "ratio": spread(
                                [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs[name], base, strict=True)]
                            ),
                            "evict_ms_per_step": spread(evict) if evict else None,
                            "captures": runs[name][-1]["captures"],
                            "capture_s": runs[name][-1]["capture_s"],
                            "first_step_s": runs[name][0]["first_step_s"],
                            "profile": profiles.get(name),
                        }
                    )
    record = {
        "command": command(args),
        "machine": platform.processor() or platform.machine(),
        "device": str(model.device),
        "dtype": str(model.dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "weight_stream_ms": limits,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    for scheme, limit in limits.items():
        print(f"weight-streaming limit ({scheme}) at the start: {limit:.2f} ms per step")
    width = max(12, *(len(r["method"]) for r in rows))
    print(
        f"{'method':{width}s} {'tokens':>6s} {'batch':>5s} {'ms/step (min/med/max)':>22s} {'limit':>6s} {'x limit':>7s}"
        f" {'vs ' + names[0]:>18s} {'evict ms':>9s}"
    )
    for r in rows:
        t, q = r["ms_per_step"], r["ratio"]
        e = f"{r['evict_ms_per_step']['median']:.2f}" if r["evict_ms_per_step"] else "-"
        print(
            f"{r['method']:{width}s} {r['length']:6d} {r['batch']:5d}"
            f" {t['min']:6.1f} {t['median']:6.1f} {t['max']:6.1f} {r['weight_stream_ms']['median']:6.1f}"
            f"  {r['x_weight_limit']['median']:6.2f}   {q['min']:5.2f} {q['median']:5.2f} {q['max']:5.2f} {e:>9s}"
            + (f"  ({r['captures']} CUDA graphs, {r['capture_s']:.2f} s)" if r["captures"] else "")
        )
        if r["profile"]:
            p = r["profile"]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in p["parts_ms"].items())
            tops = ", ".join(f"{k[6:]} {v:.1f}" for k, v in list(p["top_operators_ms"].items())[:6])
            outside = p["outside_operators_ms"]
            print(f"    profile ms/step {p['ms_per_step']:.1f}: {parts}; outside operators {outside:.1f}")
            print(f"    slowest operators: {tops}")


if __name__ == "__main__":
    main()
