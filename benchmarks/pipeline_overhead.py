"""What the transformers pipeline task costs over a direct `kvsieve.generate` call: the same passkey question, the
same method and model, timed side by side in one process (in turns, the first of each turn alternating, after one
warm-up call of each).

    python benchmarks/pipeline_overhead.py --length 4096 --method snapkv --repeats 3

Prints each front's min / median / max wall time of the whole call (prompt building, prefill, decoding, the answer's
dict) and the ratio of the medians; the answers must be the same tokens. Then the pipeline's own cost, which does not
grow with the prompt, measured where it is not lost in the long call's noise: a short prompt, one new token, many
calls of each, the difference of the medians. Pause other work on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import pipeline

import kvsieve
from kvsieve import Sampling
from kvsieve.data import prompt_case
from kvsieve.integrations.pipeline_task import TASK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens (default 4096)")
    parser.add_argument("--method", default="snapkv", help="the preset both fronts run (default snapkv)")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens at most (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each front (default 3)")
    parser.add_argument("--short-repeats", type=int, default=40, help="calls of each on a short prompt (default 40)")
    args = parser.parse_args()
    pipe = pipeline(TASK)
    model, tokenizer = pipe.model, pipe.tokenizer
    case, _ = prompt_case(tokenizer, "passkey", args.length, 0.5)
    spec = kvsieve.method(args.method)

    def direct() -> list[int]:
        result = kvsieve.generate(model, tokenizer, case.context, case.question, method=spec,
                                  sampling=Sampling(max_new_tokens=args.tokens))  # fmt: skip
        return result.tokens

    def through_pipeline() -> list[int]:
        return pipe(case.context, question=case.question, method=spec, max_new_tokens=args.tokens)[0]["tokens"]

    times: dict[str, list[float]] = {"generate": [], "pipeline": []}
    answers = {"generate": direct(), "pipeline": through_pipeline()}  # warm-up, and the answers compared
    fronts = [("generate", direct), ("pipeline", through_pipeline)]
    for repeat in range(args.repeats):  # the order alternates: neither front always runs second
        for name, call in fronts if repeat % 2 == 0 else fronts[::-1]:
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; {args.method}, "
          f"{args.length}-token prompt, {len(answers['generate'])} new tokens, {args.repeats} repeats")  # fmt: skip
    for name, values in times.items():
        print(f"{name:9s} min {min(values):.3f} s  median {statistics.median(values):.3f} s  max {max(values):.3f} s")
    ratio = statistics.median(times["pipeline"]) / statistics.median(times["generate"])
    print(f"pipeline / generate (medians): {ratio:.3f}; same tokens: {answers['generate'] == answers['pipeline']}")
    # The pipeline's own work (its arguments, the generation config, the answer's dict) does not grow with the
    # prompt: on a short one, many calls, its median cost shows above the noise that hides it at 4K.
    short = " ".join(case.context.split()[:40])
    fixed: dict[str, list[float]] = {"generate": [], "pipeline": []}
    calls = {
        "generate": lambda: kvsieve.generate(model, tokenizer, short, case.question, method=spec,
                                             sampling=Sampling(max_new_tokens=1)),
        "pipeline": lambda: pipe(short, question=case.question, method=spec, max_new_tokens=1),
    }  # fmt: skip
    for repeat in range(args.short_repeats):
        for name in ("generate", "pipeline") if repeat % 2 == 0 else ("pipeline", "generate"):
            start = time.perf_counter()
            calls[name]()
            fixed[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in fixed.items()}
    extra = medians["pipeline"] - medians["generate"]
    share = extra / statistics.median(times["generate"])
    print(f"short prompt, 1 new token, {args.short_repeats} calls each: generate median "
          f"{medians['generate'] * 1e3:.1f} ms, pipeline {medians['pipeline'] * 1e3:.1f} ms: "
          f"the pipeline's own cost {extra * 1e3:+.1f} ms, {share:+.3%} of the long call")  # fmt: skip


if __name__ == "__main__":
    main()
