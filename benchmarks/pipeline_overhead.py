"""What the transformers pipeline task costs over a direct `kvsieve.generate` call: the same passkey question, the
same method and model, timed side by side in one process (alternating, after one warm-up call of each).

    python benchmarks/pipeline_overhead.py --length 4096 --method snapkv --repeats 3

Prints each front's min / median / max wall time of the whole call (prompt building, prefill, decoding, the answer's
dict) and the ratio of the medians; the answers must be the same tokens. Pause other work on the machine meanwhile.
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
    for _ in range(args.repeats):
        for name, call in (("generate", direct), ("pipeline", through_pipeline)):
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; {args.method}, "
          f"{args.length}-token prompt, {len(answers['generate'])} new tokens, {args.repeats} repeats")  # fmt: skip
    for name, values in times.items():
        print(f"{name:9s} min {min(values):.3f} s  median {statistics.median(values):.3f} s  max {max(values):.3f} s")
    ratio = statistics.median(times["pipeline"]) / statistics.median(times["generate"])
    print(f"pipeline / generate (medians): {ratio:.3f}; same tokens: {answers['generate'] == answers['pipeline']}")


if __name__ == "__main__":
    main()
