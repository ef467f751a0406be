"""One layer's prefill attention: dense SDPA vs CritiPrefill, measured side by side in one run.

    python benchmarks/critiprefill_kernel.py --lengths 2048,4096,8192 --repeats 5 --out runs/critiprefill_kernel.json

Random post-RoPE-like q/k/v with SmolLM2-135M's attention shapes (9 query heads, 3 KV heads,
head_dim 64, fp32 by default). CritiPrefill is timed on a layer index past its dense layers, so
its time includes Algorithm 1 (estimation), the block selection and the sparse attention; at
lengths where no segment has more candidate blocks than the budget it falls back to dense (the
"sparse segments" column says how many of the segments ran sparse). Dense and CritiPrefill
alternate within every repeat, so machine noise hits both alike; the speedup is the ratio of
medians. The thread count is PyTorch's default unless --threads is given. `--flex` adds the fused kernel CUDA runs
(FlexAttention over the BlockMask, `kvsieve.kernels.block_sparse`, compiled by inductor for this device), on the
same selection: whether it beats the gathered path here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvsieve.attention.critiprefill import CritiPrefill, sparse_segments
from kvsieve.attention.dense import dense_attention
from kvsieve.kernels import block_sparse


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _summary(times: list[float]) -> dict[str, float]:
    return {"min_s": min(times), "median_s": statistics.median(times), "max_s": max(times)}


def bench_length(
    length: int, kernel: CritiPrefill, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict:
    generator = torch.Generator(device=device).manual_seed(length)
    shape_q = (1, args.heads, length, args.head_dim)
    shape_kv = (1, args.kv_heads, length, args.head_dim)
    query = torch.randn(shape_q, generator=generator, device=device, dtype=dtype)
    key = torch.randn(shape_kv, generator=generator, device=device, dtype=dtype)
    value = torch.randn(shape_kv, generator=generator, device=device, dtype=dtype)
    layer = kernel.dense_layers  # the first sparse layer (the later ones add only one fusion step)
    runs = {
        "dense": lambda: dense_attention(query, key, value, None),
        "critiprefill": lambda: kernel.begin()(layer, query, key, value, None),
    }
    if args.flex and kernel.begin().select(layer, query, key) is not None:

        def flex() -> torch.Tensor:
            selection = kernel.begin().select(layer, query, key)
            allowed = selection.allowed_blocks()
            return block_sparse.segment_block_attention(query, key, value, allowed, kernel.segment, kernel.block, None)

        runs["flex"] = flex
    with torch.inference_mode():
        for fn in runs.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, fn in runs.items():
                times[name].append(_timed(fn))
        error = (runs["critiprefill"]() - runs["dense"]()).abs().max().item()
    sparse = len(sparse_segments(length, length, kernel.segment, kernel.block, kernel.budget))
    dense_s, sparse_s = _summary(times["dense"]), _summary(times["critiprefill"])
    flex = {}
    if "flex" in times:
        flex = {
            "flex": _summary(times["flex"]),
            "flex_speedup": dense_s["median_s"] / _summary(times["flex"])["median_s"],
        }
    return {
        **flex,
        "length": length,
        "segments": -(-length // kernel.segment),
        "sparse_segments": sparse,
        "dense": dense_s,
        "critiprefill": sparse_s,
        "speedup": dense_s["median_s"] / sparse_s["median_s"],
        "max_abs_diff_vs_dense": error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096,8192", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--segment", type=int, default=512)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: PyTorch's choice)")
    parser.add_argument("--flex", action="store_true", help="also time the FlexAttention kernel (compiled here)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    kernel = CritiPrefill(segment=args.segment, block=args.block, budget=args.budget)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(
        f"{kernel} | heads {args.heads}/{args.kv_heads} x {args.head_dim}, {args.dtype} on {device}, "
        f"{torch.get_num_threads()} threads, {args.repeats} repeats"
    )
    header = (
        f"{'length':>7} {'sparse/segs':>11} | {'dense min / median / max (s)':>28} | "
        f"{'critiprefill min / median / max (s)':>35} | {'speedup':>8} {'max|diff|':>10}"
    )
    print(header)
    rows = []
    for length in lengths:
        row = bench_length(length, kernel, args, device, dtype)
        rows.append(row)
        d, c = row["dense"], row["critiprefill"]
        print(
            f"{length:>7} {row['sparse_segments']:>5}/{row['segments']:<5} | "
            f"{d['min_s']:8.4f} / {d['median_s']:8.4f} / {d['max_s']:8.4f} | "
            f"{c['min_s']:11.4f} / {c['median_s']:9.4f} / {c['max_s']:9.4f} | "
            f"{row['speedup']:7.2f}x {row['max_abs_diff_vs_dense']:10.3g}"
            + (
                f" | flex median {row['flex']['median_s']:.4f} s, {row['flex_speedup']:.2f}x dense"
                if "flex" in row
                else ""
            )
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "kernel": {k: getattr(kernel, k) for k in ("segment", "block", "budget", "alpha", "dense_layers")},
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "device": str(device),
            "threads": torch.get_num_threads(),
            "repeats": args.repeats,
        }
        args.out.write_text(json.dumps({"config": meta, "results": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
