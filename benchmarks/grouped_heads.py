"""A chunk's attention over more keys than queries under a boolean mask: KV heads repeated per query head against
grouped heads passed as they are (`enable_gqa`), side by side in one run (`kvsieve.attention.dense.masked_attention`).

    python benchmarks/grouped_heads.py --repeats 7 --out runs/grouped_heads.json

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64), random q/k/v, a bottom-right causal mask.
The two alternate within every repeat; each row gives min/median/max milliseconds and whether the outputs are equal
to the bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvsieve.attention.dense import bottom_right_causal_mask, repeat_kv

SHAPES = ((512, 1024), (1024, 2048), (512, 8192))  # (queries, keys): chunks after a memory, a last segment


def repeated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask)


def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: PyTorch's)")
    parser.add_argument("--out", type=Path, default=Path("runs/grouped_heads.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for queries, keys in SHAPES:
            generator = torch.Generator().manual_seed(0)
            q = torch.randn(1, 9, queries, 64, generator=generator).to(dtype)
            k, v = (torch.randn(1, 3, keys, 64, generator=generator).to(dtype) for _ in range(2))
            mask = bottom_right_causal_mask(queries, keys)
            times: dict[str, list[float]] = {"repeated": [], "grouped": []}
            equal = torch.equal(repeated(q, k, v, mask), grouped(q, k, v, mask))  # also a warm-up of both
            for _ in range(args.repeats):
                for run in (repeated, grouped):
                    start = time.perf_counter()
                    run(q, k, v, mask)
                    times[run.__name__].append((time.perf_counter() - start) * 1e3)
            row = {"dtype": str(dtype).removeprefix("torch."), "queries": queries, "keys": keys, "equal": equal}
            for name, values in times.items():
                row[f"{name}_ms"] = [round(min(values), 2), round(statistics.median(values), 2), round(max(values), 2)]
            rows.append(row)
            print(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
