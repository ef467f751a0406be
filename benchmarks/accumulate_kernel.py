"""One layer's prefill attention with H2O's scores: SDPA alone, SDPA + the second-pass reference, and
the blocked pass that gives both at once (`kvsieve.attention.accumulate`), for several block sizes.

    python benchmarks/accumulate_kernel.py --keys 2048,8192 --rows 32,64,128,256
    python benchmarks/accumulate_kernel.py --decode --keys 1025,2048,8192   # one decoding step's row

`--decode` times one query row against n cached keys instead (a decoding step under H2O / A2SF):
SDPA alone against the row with its scores, the median of 2000 calls after 50 warm-up calls.

`--parts` splits the blocked pass (64-row blocks) into its stages, each line adding one: the
causal QK^T blocks alone, then their softmax, the P V product, the column sums. It also times
an exact alternative that keeps SDPA's fused kernel: SDPA returning each row's log-sum-exp
(PyTorch's CPU flash-attention op), then the column sums as a second fused pass in which the keys
query the queries (sequences reversed, so it is causal too) with the row's -lse as an extra
dimension; its own log-sum-exp is log(column sum).

    python benchmarks/accumulate_kernel.py --parts --keys 8192

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


def measure_parts(n: int, repeats: int) -> str:
    """The blocked pass at `n` keys cut after each stage, and the two-SDPA alternative (see the module doc)."""
    q, k, v = torch.randn(1, 9, n, 64), torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64)
    grouped, keys_t, values, rows = q[0].reshape(3, 3, n, 64) * 64**-0.5, k[0].transpose(1, 2), v[0], 64

    def blocked(stages: int) -> None:
        totals = torch.zeros(3, n)
        for start in range(0, n, rows):
            stop = min(start + rows, n)
            probs = torch.bmm(grouped[:, :, start:stop].reshape(3, -1, 64), keys_t[..., :stop])
            if stages > 1:
                probs = probs.softmax(-1)
            if stages > 2:
                torch.bmm(probs, values[:, :stop])
            if stages > 3:
                totals[:, :stop] += probs.sum(1)

    sdpa = best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), repeats)
    line = [f"{n} keys: SDPA {sdpa:.2f} s"]
    for stages, name in enumerate(("QK^T blocks", "+ softmax", "+ P V", "+ column sums"), start=1):
        line.append(f"{name} {best(lambda stages=stages: blocked(stages), repeats):.2f} s")
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    k_rep, v_rep = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    first = best(lambda: flash(q, k_rep, v_rep, 0.0, True, scale=64**-0.5), repeats)
    lse = flash(q, k_rep, v_rep, 0.0, True, scale=64**-0.5)[1]

    def column_sums() -> torch.Tensor:
        keys_as_queries, queries_as_keys = torch.zeros(1, 9, n, 65), torch.zeros(1, 9, n, 65)
        keys_as_queries[..., :64], keys_as_queries[..., 64] = k_rep.flip(2), 1.0
        queries_as_keys[..., :64], queries_as_keys[..., 64] = q.flip(2) * 64**-0.5, -lse.flip(-1)
        log_sums = flash(keys_as_queries, queries_as_keys, torch.zeros_like(keys_as_queries), 0.0, True, scale=1.0)[1]
        return log_sums.flip(-1).exp().view(3, 3, n).sum(1)

    second = best(column_sums, repeats)
    reference = accumulated_attention(q[0], k[0], 64**-0.5, 1.0)
    error = ((column_sums() - reference).abs() / reference).max()
    line.append(
        f"SDPA with log-sum-exp {first:.2f} s + transposed pass {second:.2f} s (max relative error {error:.1e})"
    )
    return ", ".join(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", default="2048,8192", help="prompt lengths (queries = keys)")
    parser.add_argument("--rows", default="32,64,128,256", help="query rows per block")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode", action="store_true", help="time one decoding step's row instead of a prefill")
    parser.add_argument("--parts", action="store_true", help="time the blocked pass stage by stage (see above)")
    args = parser.parse_args()
    for n in [int(x) for x in args.keys.split(",")]:
        if args.decode:
            line = measure_row(n)
        elif args.parts:
            line = measure_parts(n, args.repeats)
        else:
            line = measure(n, [int(x) for x in args.rows.split(",")], args.repeats)
        print(line, flush=True)


if __name__ == "__main__":
    main()
