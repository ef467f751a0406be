"""A full-attention prefill in float32 against bfloat16, side by side in one process (the repeats interleave the two
models, the ratio is taken within a repeat): whether a CPU's bfloat16 units (avx512_bf16, AMX) make bfloat16 the
cheaper dtype for a long evaluation run; and bfloat16 with PyTorch's own product (`widened_products` off), what a CPU
without bfloat16 units pays without kvsieve's float32 product (docs/PERFORMANCE.md).

    python benchmarks/prefill_dtypes.py --tokens 3900 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvsieve
from kvsieve import fast_paths
from kvsieve.engine import prefill
from kvsieve.eval.records import machine
from kvsieve.prompt import Prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--tokens", type=int, default=3900, help="prompt tokens (default 3900, a RULER 4K prompt)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("runs/prefill_dtypes.json"))
    args = parser.parse_args()
    models = {dtype: kvsieve.load_model(args.model, dtype=dtype)[0] for dtype in ("float32", "bfloat16")}
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (1, args.tokens), generator=generator)
    prompt = Prompt(ids, 0, args.tokens)
    runs = {"float32": ("float32", True), "bfloat16": ("bfloat16", True), "bfloat16-unwidened": ("bfloat16", False)}
    seconds: dict[str, list[float]] = {label: [] for label in runs}
    with torch.no_grad():
        for _ in range(args.repeats):
            for label, (dtype, widened) in runs.items():
                with fast_paths.using(widened_products=widened):
                    start = time.perf_counter()
                    prefill(models[dtype], prompt)
                    seconds[label].append(time.perf_counter() - start)
    ratios = [f / b for f, b in zip(seconds["float32"], seconds["bfloat16"], strict=True)]
    unwidened = [u / b for u, b in zip(seconds["bfloat16-unwidened"], seconds["bfloat16"], strict=True)]
    result = {"tokens": args.tokens, "machine": machine(), "seconds": seconds, "float32_over_bfloat16": ratios,
              "unwidened_over_widened": unwidened}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for dtype, values in seconds.items():
        print(f"{dtype:18} " + " ".join(f"{v:.2f}" for v in values) + " s")
    print("float32 / bfloat16 per repeat: " + " ".join(f"{r:.2f}" for r in ratios))
    print("bfloat16 unwidened / widened per repeat: " + " ".join(f"{r:.2f}" for r in unwidened))


if __name__ == "__main__":
    main()
