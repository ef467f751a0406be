"""The device check: time to first token and peak memory of the prefill methods on one GPU, at the papers' scale,
against full attention and against transformers' own SDPA prefill; writes RESULTS.md and its result files.

Models are random-weight copies of published shapes, built on the device from the configs in benchmarks/configs/
(no download, no tokenizer: the prompts are random token ids, which cost the same as text): Llama-3.1-8B at 32K,
64K and 128K tokens, Gemma 3 270M at 32K. Methods: full, gemfilter, critiprefill, gemfilter-critiprefill, imdc, fm,
snapkv (their registered presets, the papers' settings), plus `transformers`: the same model with transformers'
SDPA attention and no kvsieve stage, run as `model(ids, logits_to_keep=1)`. Every prompt ends in a 32-token
question. Each model is loaded once; every repeat runs every configuration of a length once (interleaved), and
ratios are taken within a repeat (min / median / max). Peak memory is the allocator's peak above the weights.

The whole check is sized to about 8 minutes on one H200: it starts no configuration after `--deadline` seconds and
writes what it measured (the page lists what it did not reach). On a GPU machine with this repository:

    make bench-gpu                    # PYTHONPATH=src python3 benchmarks/gpu_check.py --out $OUT (or runs/gpu)

`--dry-run` runs the same code on a CPU at a tiny scale (two-layer models, 1K tokens, methods' sizes cut to fit):
tests/test_gpu_check.py does, so the script works the first time a device comes. docs/PERFORMANCE.md ("On a GPU")
says what each method runs on CUDA and what this check measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvsieve import method
from kvsieve.engine import prefill
from kvsieve.eval import bench, records
from kvsieve.eval.report_sections import machine_line, spread
from kvsieve.loading import resolve_dtype
from kvsieve.memory import PeakWatch
from kvsieve.preparation import prepare
from kvsieve.prompt import Prompt

CONFIGS = Path(__file__).parent / "configs"
LENGTHS = {"llama-3.1-8b": (131072, 65536, 32768), "gemma-3-270m": (32000,)}
METHODS = ("full", "gemfilter", "critiprefill", "gemfilter-critiprefill", "imdc", "fm", "snapkv")
REFERENCE = "transformers"  # transformers' own SDPA prefill of the same model
QUESTION = 32  # the prompt's last tokens, as a question the question-aware methods observe
# The dry run's sizes: two layers (Gemma: six, one of them global), 1K-token prompts, the methods' budgets cut to fit.
TINY = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
TINY_SETTINGS = {
    "gemfilter": {"select.k": 128},
    "critiprefill": {"attention.segment": 128, "attention.block": 16, "attention.budget": 128},
    "gemfilter-critiprefill": {"select.k": 512, "attention.segment": 128, "attention.block": 16,
                               "attention.budget": 128},
    "imdc": {"feed.chunk": 128, "feed.memory": 128},
    "fm": {"feed.chunk": 128, "feed.memory": 128},
    "snapkv": {"compress.budget": 128},
}  # fmt: skip
# Goals (issue: speed on a GPU): (method, length, what, threshold) read off the medians.
GOALS = [
    ("critiprefill", 131072, "speedup", 2.0, "CritiPrefill at least 2x full attention at 128K (paper: 2.7x)"),
    ("gemfilter", 65536, "speedup", 2.0, "GemFilter at least 2x full attention at 64K"),
    ("imdc", 131072, "speedup", 1 / 1.4, "IMDC no slower than 1.4x full attention's time at 128K"),
    ("imdc", 131072, "memory_ratio", 0.5, "IMDC at most half full attention's peak memory at 128K (above weights)"),
    ("full", 131072, "reference", 0.95, "kvsieve's full attention within 5% of transformers' own prefill at 128K"),
]


def build(name: str, device: torch.device, dtype: torch.dtype, tiny: bool) -> torch.nn.Module:
    """A random-weight model of the config `name` (benchmarks/configs/NAME.json) on `device`, prepared for kvsieve."""
    values = json.loads((CONFIGS / f"{name}.json").read_text())
    if tiny:
        values.update(TINY)
        if "layer_types" in values:  # keep one global layer among the sliding ones
            values["num_hidden_layers"], values["layer_types"] = 6, values["layer_types"][:6]
            values["num_key_value_heads"] = 1
    config = AutoConfig.for_model(**{k: v for k, v in values.items() if not k.startswith("_")})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return prepare(model)


def prompt_of(length: int, vocab: int, device: torch.device) -> Prompt:
    ids = torch.randint(100, vocab - 1, (1, length), generator=torch.Generator().manual_seed(length)).to(device)
    return Prompt(ids, 0, length - QUESTION)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: torch.nn.Module, prompt: Prompt, name: str, tiny: bool) -> dict[str, Any]:
    """One configuration's time to first token (the prefill, first token's logits included) and peak memory."""
    device = model.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
    watch = PeakWatch(device)
    watch.start()
    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        if name == REFERENCE:
            model.set_attn_implementation("sdpa")  # transformers' attention, no kvsieve hook
            try:
                model(input_ids=prompt.ids, use_cache=True, logits_to_keep=1)
            finally:
                synchronize(device)
                prepare(model)
            kv = prompt.length
        else:
            done = prefill(model, prompt, method(name, TINY_SETTINGS.get(name, {}) if tiny else {}))
            synchronize(device)
            kv = done.kv_length
    seconds = time.perf_counter() - start
    added = watch.peak()
    return {"method": name, "length": prompt.length, "ttft_s": seconds, "decode_tokens_per_s": 0.0,
            "peak_mb": (watch.base + added) / 2**20, "added_mb": added / 2**20, "prefill_kv_length": kv}  # fmt: skip


def check_model(
    name: str, lengths: tuple[int, ...], args: argparse.Namespace, deadline: float, out: Path
) -> tuple[dict[str, Any], list[str]]:
    """Every (length, repeat, method) of one model until the deadline; its bench document and what was skipped."""
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype)
    names = [REFERENCE, *METHODS]
    settings = {"model": name, "random_weights": True, "device": device.type, "dtype": args.dtype,
                "methods": {m: {} if m == REFERENCE else method(m).to_dict() for m in names}}  # fmt: skip
    document = records.open_results(out / f"{name}.json", "bench", settings, fresh=True)
    skipped: list[str] = []
    start = time.perf_counter()
    model = build(name, device, dtype, args.dry_run)
    vocab = model.config.vocab_size
    print(f"{name}: built in {time.perf_counter() - start:.0f} s", flush=True)
    warm = prompt_of(min(4096, min(lengths) // 2), vocab, device)
    for m in names:  # allocator, cuBLAS, the compiled block-sparse kernel
        measure(model, warm, m, args.dry_run)
    for length in lengths:
        prompt = prompt_of(length, vocab, device)
        for repeat in range(args.repeats):
            for m in names:
                if time.perf_counter() > deadline:
                    skipped.append(f"{name} {m} at {length} (repeat {repeat + 1})")
                    continue
                try:
                    row = measure(model, prompt, m, args.dry_run)
                except torch.OutOfMemoryError as error:
                    skipped.append(f"{name} {m} at {length}: out of memory ({str(error).splitlines()[0]})")
                    continue
                document["rows"].append({**row, "repeat": repeat, "requested_length": length})
                records.save(out / f"{name}.json", document)
                print(f"{name} {length} r{repeat} {m}: {row['ttft_s']:.3f} s, peak {row['peak_mb']:.0f} MB", flush=True)
    del model
    return document, skipped


def goals(summaries: dict[str, list[dict]]) -> list[str]:
    """The goals table, read off the Llama-shape medians."""
    rows = {(s["method"], s["length"]): s for s in summaries.get("llama-3.1-8b", [])}
    lines = ["| goal | measured (median) | met |", "|---|---|---|"]
    for name, length, what, threshold, text in GOALS:
        mine = rows.get((name, length))
        if what == "reference":
            reference = rows.get((REFERENCE, length))
            value = mine["ttft_s"][1] / reference["ttft_s"][1] if mine and reference else None
            shown = f"{value:.3f}x transformers' time" if value is not None else "not measured"
            met = value is not None and value <= 1 / threshold
        else:
            value = mine[what][1] if mine and mine[what] else None
            shown = f"{value:.2f}x" if value is not None else "not measured"
            met = value is not None and (value >= threshold if what == "speedup" else value <= threshold)
        lines.append(f"| {text} | {shown} | {'yes' if met else 'no' if value is not None else '-'} |")
    fm, imdc = rows.get(("fm", 131072)), rows.get(("imdc", 131072))
    if fm and imdc:
        faster = imdc["ttft_s"][1] < fm["ttft_s"][1]
        lines.append(f"| IMDC faster than FM at 128K | {imdc['ttft_s'][1]:.2f} s vs {fm['ttft_s'][1]:.2f} s "
                     f"| {'yes' if faster else 'no'} |")  # fmt: skip
    return lines


def page(documents: dict[str, dict], skipped: list[str], figure: Path | None, command: str) -> str:
    """docs/gpu/RESULTS.md: per model and length, every configuration against full attention; the goals."""
    any_doc = next(iter(documents.values()))
    lines = ["# kvsieve on a GPU", "",
             f"Generated by `benchmarks/gpu_check.py` on {time.strftime('%Y-%m-%d')}; every number is read from the "
             "result files beside this page. Regenerate rather than edit.", "",
             f"**Machine**: {machine_line(any_doc['machine'])}", "", "```bash", command, "```", "",
             "Random-weight models of published shapes (benchmarks/configs/), bfloat16, random prompt ids ending in "
             f"a {QUESTION}-token question. TTFT is the prefill up to the first token's logits; `peak GB` the "
             "allocator's peak (weights included). Ratios are taken within a repeat, then min / median / max. "
             f"`{REFERENCE}` is the same model run by transformers' own SDPA attention, without kvsieve.",
             ""]  # fmt: skip
    order = {name: i for i, name in enumerate([REFERENCE, *METHODS])}
    summaries = {
        name: sorted(bench.summarize(doc["rows"]), key=lambda s: order[s["method"]]) for name, doc in documents.items()
    }
    lines += ["## Goals", "", *goals(summaries), ""]
    for name, summary in summaries.items():
        for length in sorted({s["length"] for s in summary}, reverse=True):
            lines += [f"## {name}, {length} tokens", "",
                      "| method | TTFT s (min/med/max) | speedup vs full (min/med/max) | peak GB (med) "
                      "| peak vs full (min/med/max) | KV entries after prefill |",
                      "|---|---|---|---|---|---|"]  # fmt: skip
            kv = {r["method"]: r["prefill_kv_length"] for r in documents[name]["rows"] if r["length"] == length}
            for s in (s for s in summary if s["length"] == length):
                peak = s["peak_mb"][1] / 1024
                lines.append(f"| {s['method']} | {spread(s['ttft_s'])} | {spread(s['speedup'])} | {peak:.1f} "
                             f"| {spread(s['memory_ratio'])} | {kv[s['method']]} |")  # fmt: skip
            lines.append("")
    if figure is not None:
        lines += [f"![time to first token and peak memory against prompt length]({figure.name})", ""]
    if skipped:
        lines += ["## Not measured", "", *(f"- {item}" for item in skipped), ""]
    links = ", ".join(f"[{name}.json]({name}.json)" for name in documents)
    return "\n".join([*lines, f"Raw rows: {links}.", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/gpu"), help="folder for RESULTS.md and its files")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=420, help="seconds after which no configuration starts")
    parser.add_argument("--dry-run", action="store_true", help="tiny models and prompts (on a CPU: tests)")
    args = parser.parse_args()
    if args.dry_run and args.device == "cuda" and not torch.cuda.is_available():
        args.device = "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.deadline
    documents, skipped = {}, []
    order = ["gemma-3-270m", "llama-3.1-8b"]  # Gemma's one length first: a minute, then the long ones
    for name in order:
        lengths = (1024,) if args.dry_run else LENGTHS[name]
        documents[name], missed = check_model(name, lengths, args, deadline, args.out)
        skipped += missed
    rows = [row for row in documents["llama-3.1-8b"]["rows"] if row["method"] != REFERENCE]
    figure = bench.plot_scaling(bench.summarize(rows), args.out / "scaling.png") if rows else None
    (args.out / "RESULTS.md").write_text(page(documents, skipped, figure, records.command_line()))
    print(f"wrote {args.out / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
