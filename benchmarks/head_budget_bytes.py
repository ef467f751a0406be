"""KV bytes held after compression, measured from the cache's tensors: per-head budgets (a segmented cache) against
one count per head and against full attention, and how unequal the heads' counts are.

    python benchmarks/head_budget_bytes.py --length 4096 --budgets 0.1,0.25,0.5 \
        --methods snapkv,adakv,expected-attention,adakv-expected-attention --out docs/results/head_budget_bytes.json

SmolLM2 float32, one passkey prompt. For each method and budget b: the cache's bytes after the prefill and its
compression (`kvsieve.kv.cache.cache_nbytes`: keys and values as allocated), their ratio to b x full attention's,
and for per-head budgets the longest head's count over the layer's mean (what a padded layer would hold instead).
Quality-free and timing-free: it may share the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvsieve import load_model, method
from kvsieve.data import prompt_case
from kvsieve.engine import prefill
from kvsieve.kv.cache import cache_nbytes
from kvsieve.kv.heads import is_segmented


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="passkey prompt tokens (default 4096)")
    parser.add_argument("--budgets", default="0.1,0.25,0.5", help="compression budgets (shares of the prompt)")
    parser.add_argument("--methods", default="snapkv,adakv,expected-attention,adakv-expected-attention")
    parser.add_argument("--out", type=Path, help="write the rows and the command here as JSON")
    args = parser.parse_args()
    rows = []
    model, tokenizer = load_model(dtype=torch.float32)
    _, prompt = prompt_case(tokenizer, "passkey", args.length, 0.5)
    with torch.no_grad():
        full = cache_nbytes(prefill(model, prompt).prefilled.cache)
    rows.append({"method": "full", "tokens": prompt.length, "kv_bytes": full})
    print(json.dumps(rows[-1]), flush=True)
    for name in args.methods.split(","):
        for budget in (float(b) for b in args.budgets.split(",")):
            with torch.no_grad():
                cache = prefill(model, prompt, method(name, {"compress.budget": budget})).prefilled.cache
            held = cache_nbytes(cache)
            segmented = [layer for layer in cache.layers if is_segmented(layer)]
            spread = [round(layer.longest * layer.kv_heads / layer.entries, 2) for layer in segmented]
            line = {
                "method": name,
                "budget": budget,
                "kv_bytes": held,
                "of_budget_x_full": round(held / (budget * full), 4),
                "longest_head_over_mean": [min(spread), max(spread)] if spread else None,
            }
            rows.append(line)
            print(json.dumps(line), flush=True)
    if args.out:
        command = "python benchmarks/head_budget_bytes.py " + " ".join(sys.argv[1:])
        document = {"kind": "head_budget_bytes", "command": command, "model": "SmolLM2-135M float32", "rows": rows}
        args.out.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
