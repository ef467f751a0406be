"""One layer's prefill attention with H2O's scores: SDPA alone, SDPA + the second-pass reference, and
the blocked pass that gives both at once (`kvsieve.attention.accumulate`), for several block sizes.

    python benchmarks/accumulate_kernel.py --keys 2048,8192 --rows 32,64,128,256
    python benchmarks/accumulate_kernel.py --decode --keys 1025,2048,8192   # one decoding step's row

`--decode` times one query row against n cached keys instead (a decoding step under H2O / A2SF):
SDPA alone against the row with its scores, the median of 2000 calls after 50 warm-up calls.

Shapes are SmolLM2-135M's (9 query / 3 KV heads, head size 64), inputs random, float32 on the CPU;
each time is the best of `--repeats`. Pause other work on the machine while it runs.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import kvsieve.attention.accumulate as accumulate
from kvsieve.compress.scorers import accumulated_attention


def best(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(n: int, block_rows: list[int], repeats: int) -> str:
    """One line of timings at `n` keys."""
    q, k, v = torch.randn(1, 9, n, 64), torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64)
    sdpa = best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), repeats)
    second = best(lambda: accumulated_attention(q[0], k[0], 64**-0.5, 1.0), repeats)
    line = [f"{n} keys: SDPA {sdpa:.2f} s, second-pass scores {second:.2f} s"]
    for rows in block_rows:
        accumulate.MAX_ROWS = rows
        blocked = best(lambda: accumulate.accumulating_attention(q, k, v, None, [1.0]), repeats)
        line.append(f"blocked {rows} rows {blocked:.2f} s")
    return ", ".join(line)


def measure_row(n: int) -> str:
    """One decoding step's attention at `n` keys: SDPA alone vs the row with its scores (median of 2000 calls)."""
    q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64)

    def median_us(function) -> float:
        for _ in range(50):
            function()
        times = []
        for _ in range(2000):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1e6

    sdpa = median_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    row = median_us(lambda: accumulate.accumulating_attention(q, k, v, None, [1.0]))
    return f"{n} keys, one query: SDPA {sdpa:.0f} us, attention + scores {row:.0f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="2048,8192", help="prompt lengths (queries = keys)")
    parser.add_argument("--rows", default="32,64,128,256", help="query rows per block")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode", action="store_true", help="time one decoding step's row instead of a prefill")
    args = parser.parse_args()
    for n in [int(x) for x in args.keys.split(",")]:
        line = measure_row(n) if args.decode else measure(n, [int(x) for x in args.rows.split(",")], args.repeats)
        print(line, flush=True)


if __name__ == "__main__":
    main()
