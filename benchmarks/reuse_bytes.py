"""What a stored document costs in the prefix cache: the bytes of one RULER context kept whole (query-aware reuse,
the server's default `--reuse-budget whole`) against the same context kept compressed before any question by each
method's scorer (`--reuse-budget 0.25`, what the RULER board's agnostic mode answers from).

    python benchmarks/reuse_bytes.py --cases CASES --budgets 0.1,0.25,0.5 \
        --methods snapkv,expected-attention,kvzip,adakv-expected-attention --out docs/results/reuse_bytes.json

The board's SmolLM2 4K case (niah_single_1, the first; seed 42, bfloat16; CASES: a board sweep's case folder, made
again from the RULER package where absent): its context, the chat template's user turn up to the question, stored
by `fill_prefix_caches` as the server's prefix cache stores it; bytes are the cache's own count (`PrefixCache.bytes`,
its states' tensors). Written after every row; a rerun with the same --out resumes. Quality-free and timing-free: it may
share the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvsieve import load_model, registry
from kvsieve.engine import PrefixCache, fill_prefix_caches
from kvsieve.eval.ruler import load_cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, required=True, help="a RULER sweep's case folder (`<out>.cases`)")
    parser.add_argument("--task", default="niah_single_1", help="the RULER task whose first case is stored")
    parser.add_argument("--budgets", default="0.1,0.25,0.5", help="reuse budgets, shares of the context")
    parser.add_argument("--methods", default="snapkv,expected-attention,kvzip,adakv-expected-attention")
    parser.add_argument("--out", type=Path, help="write the rows and the command here as JSON")
    args = parser.parse_args()
    model, tokenizer = load_model(dtype=torch.bfloat16)
    case = load_cases(tokenizer, args.task, 4096, 20, 42, args.cases)[0]
    ids = case.prompt.ids[0, : case.boundary].tolist()
    budgets = [float(b) for b in args.budgets.split(",")]
    command = " ".join(["python", *sys.argv])
    document = {"command": command, "context_tokens": len(ids), "rows": []}
    if args.out and args.out.exists():  # resume: rows already measured are kept
        document = json.loads(args.out.read_text())
    done = {(r["method"], r["reuse_budget"]) for r in document["rows"]}
    whole = PrefixCache(model, 10**11)
    with torch.no_grad():
        fill_prefix_caches(model, ids, [(whole, registry.methods("full")["full"])])
        if ("full", "whole") not in done:
            document["rows"].append({"method": "full", "reuse_budget": "whole", "bytes": whole.bytes, "ratio": 1.0})
        for name, spec in registry.methods(args.methods).items():
            for budget in (b for b in budgets if (name, b) not in done):
                cache = PrefixCache(model, 10**11, budget)
                fill_prefix_caches(model, ids, [(cache, spec)])
                row = {"method": name, "reuse_budget": budget, "bytes": cache.bytes, "ratio": cache.bytes / whole.bytes}
                document["rows"].append(row)
                print(json.dumps(row), flush=True)
                if args.out:  # after every row: a long run keeps what it measured
                    args.out.write_text(json.dumps(document, indent=1) + "\n")
    if args.out:
        args.out.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
