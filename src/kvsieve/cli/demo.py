"""`kvsieve demo`: one needle question answered by several methods side by side."""

from __future__ import annotations

import argparse

from kvsieve.cli import options

DEMO_METHODS = "full,gemfilter,critiprefill,snapkv,a2sf,imdc"


def cmd_demo(args: argparse.Namespace) -> None:
    """Answer a needle question from a Paul Graham essays haystack with each method: answer, time to first token and KV
    entries side by side."""
    from kvsieve.data import needle_case
    from kvsieve.decode import Sampling
    from kvsieve.engine import generate
    from kvsieve.eval.grading import contains, rouge1_recall

    specs = options.specs_of(args)
    model, tokenizer = options.load(args)
    case = needle_case(tokenizer, args.length, args.depth)
    print(
        f"Haystack: {args.length} tokens of Paul Graham essays; needle at {args.depth:.0%} depth:\n  {case.needle}\n"
        f"Question: {case.question}\n"
    )
    # One short warm-up answer first, so the first method timed does not pay for one-time setup.
    generate(model, tokenizer, case.context[:2000], case.question, sampling=Sampling(max_new_tokens=2))
    sampling = Sampling(max_new_tokens=args.max_new_tokens)
    results = {}
    for name, spec in specs.items():
        print(f"--- {name} ({spec.describe()}):\n    ", end="", flush=True)
        result = generate(
            model,
            tokenizer,
            case.context,
            case.question,
            method=spec,
            sampling=sampling,
            stream=lambda p: print(p, end="", flush=True),
        )
        results[name] = result
        print("\n")
    first = next(iter(specs))
    print(
        f"{'method':<16} {'answer has the needle':>21} {'ROUGE-1':>8} {'TTFT s':>7} {'vs ' + first:>9} {'KV kept':>8}"
    )
    for name, result in results.items():
        speed = results[first].prefill_seconds / result.prefill_seconds
        print(
            f"{name:<16} {'yes' if contains(result.text, case.answer) else 'no':>21} "
            f"{rouge1_recall(result.text, case.answer):>8.2f} {result.prefill_seconds:>7.2f} {speed:>8.2f}x "
            f"{result.prefill_kv_length:>8}"
        )
    print(
        f"\nOne document, one run each: times are indicative, not a benchmark (kvsieve bench repeats and "
        f"interleaves). 'KV kept' is the cache entries per layer and KV head after prefill, of "
        f"{results[first].prompt_tokens} prompt tokens. docs/RESULTS.md has every method over whole grids."
    )
    print("See what GemFilter kept: kvsieve inspect --context FILE --question ...; every method: kvsieve methods")


def add(sub: argparse._SubParsersAction) -> None:
    """Add demo to the command line."""
    p = options.command(sub, "demo", "needle question on a long essay haystack, answered by several methods", cmd_demo)
    p.add_argument("--length", type=int, default=4000, help="haystack length in tokens (default 4000)")
    p.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (default 0.5)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="longest answer in tokens (default 48)")
    options.add_method(p, multi=True, default=DEMO_METHODS)
