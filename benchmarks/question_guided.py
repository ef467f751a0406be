"""Does the question keep the needle in a chunked feed's memory? IMDC with and without `question_guided`.

For a passkey (or needle) case, runs the chunked feed alone (no decoding), guided by the prompt's question
(or by only its last `--question-tokens`) and not, and reports for every layer which share of the needle's
tokens are in the final memory (`FeedOutput.token_indices`: the prompt index of every cache entry), the feed's
time and the process's peak resident memory during it (weights included; Linux), so the runs compare side by
side. Answers are what `kvsieve niah` measures; this is the step before them: whether the memory still holds
what the question asks.

    python benchmarks/question_guided.py --length 16384 --depths 0.1,0.5,0.9 --out runs/question_guided.json
    python benchmarks/question_guided.py --length 16384 --depths 0.5 --question-tokens 6,12,16,all
    python benchmarks/question_guided.py --set feed.pruner=collie   # the authors' pruner, guided
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from kvsieve import load_model, method
from kvsieve.data import prompt_case
from kvsieve.eval.bench import peak_watch
from kvsieve.spec import parse_settings


def needle_span(tokenizer, prompt, case) -> range:
    """Prompt indices of the needle's tokens (found by their characters in the decoded prompt)."""
    ids = prompt.ids[0].tolist()
    start = prompt.context_start + len(
        tokenizer(case.context[: case.needle_start], add_special_tokens=False)["input_ids"]
    )
    length = len(tokenizer(" " + case.needle, add_special_tokens=False)["input_ids"])
    return range(max(start - 1, 0), min(start + length + 1, len(ids)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="imdc")
    parser.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="as on the CLI")
    parser.add_argument("--probe", default="passkey")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument(
        "--question-tokens",
        default="all",
        help="comma-separated: guide with only the question's last N tokens (all: the whole question)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/question_guided.json"))
    args = parser.parse_args()
    model, tokenizer = load_model()
    feed = method(args.method, parse_settings(args.set)).feed
    rows = []
    for depth in [float(d) for d in args.depths.split(",")]:
        case, prompt = prompt_case(tokenizer, args.probe, args.length, depth)
        span = needle_span(tokenizer, prompt, case)
        whole = prompt.tail_len
        counts = [whole if n == "all" else min(int(n), whole) for n in args.question_tokens.split(",")]
        for question in [*counts, 0]:  # 0: unguided
            watch = peak_watch(model.device)
            watch.start()
            start = time.perf_counter()
            with torch.no_grad():
                fed = replace(feed, question_guided=question > 0).prefill(model, prompt.ids, question=question or whole)
            seconds, peak_mb = time.perf_counter() - start, (watch.base + watch.peak()) / 2**20
            by_head = [  # per layer, per KV head: the share of the needle's tokens in that head's memory
                (torch.isin(indices, torch.tensor(list(span))).sum(-1).float() / len(span)).flatten().tolist()
                for indices in fed.token_indices
            ]
            kept = [sum(heads) / len(heads) for heads in by_head]
            rows.append(
                {
                    "depth": depth,
                    "guided": question > 0,
                    "question_tokens": question,
                    "seconds": seconds,
                    "peak_mb": peak_mb,
                    "needle_kept_by_layer": kept,
                    "needle_kept_by_head": by_head,
                }
            )
            print(
                f"depth {depth} question tokens {question} of {whole}: {seconds:.0f} s, peak {peak_mb:.0f} MB; "
                f"needle tokens kept, mean over layers {sum(kept) / len(kept):.2f}, layers keeping at least half "
                f"{sum(k >= 0.5 for k in kept)}/{len(kept)}"
            )
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"command": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
