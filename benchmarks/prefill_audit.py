"""Host reads and operators of every prefill path, per decoder layer and per chunk (`kvsieve.eval.host_reads`): what a
GPU would wait on inside a layer (target: nothing), how many operators a chunked feed adds around each pass, and of
those how many launch a kernel on a GPU (views and bare allocations do not).

Counts, not timings: they do not depend on the weights, the machine or its load, so this runs anywhere.

    python benchmarks/prefill_audit.py --tokens 2048 --out runs/prefill_audit.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import kvsieve
from kvsieve import method
from kvsieve.eval.host_reads import audit_prefill
from kvsieve.prompt import Prompt

METHODS = {
    "full": {},
    "fm": {"feed.chunk": 512, "feed.memory": 512},
    "im": {"feed.chunk": 512, "feed.memory": 512},
    "imdc": {"feed.chunk": 512, "feed.memory": 512},
    "gemfilter": {"select.k": 512},
    "critiprefill": {"attention.budget": 512, "attention.segment": 256},
    "snapkv": {"compress.budget": 512},
    "h2o": {"evict.budget": 512},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--out", type=Path, default=Path("runs/prefill_audit.json"))
    args = parser.parse_args()
    model, _ = kvsieve.load_model(args.model)
    ids = torch.randint(100, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    prompt = Prompt(ids, 0, args.tokens)
    rows = []
    print(
        "| method | passes | operators (kernels) per layer call | operators (kernels) outside the layers per pass "
        "| host reads inside layers | host reads outside per pass |"
    )
    print("|---|---|---|---|---|---|")
    for name, settings in METHODS.items():
        audit = audit_prefill(model, prompt, method(name, settings))
        row = {
            "method": name,
            "settings": settings,
            "passes": audit.passes,
            "layer_calls": audit.layer_calls,
            "operators_per_layer": round(audit.operators_per_layer, 1),
            "operators_per_pass": round(audit.operators_per_pass, 1),
            "kernels_per_layer": round(audit.kernels_per_layer, 1),
            "kernels_per_pass": round(audit.kernels_per_pass, 1),
            "reads_in_layers": len(audit.reads_in_layers),
            "reads_per_pass": round(audit.reads_per_pass, 2),
        }
        rows.append(row)
        print(
            f"| {name} | {row['passes']} | {row['operators_per_layer']} ({row['kernels_per_layer']}) "
            f"| {row['operators_per_pass']} ({row['kernels_per_pass']}) "
            f"| {row['reads_in_layers']} | {row['reads_per_pass']} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
