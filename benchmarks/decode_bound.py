"""What bounds a batch-1 decoding step on this machine: the matrix products, or the Python around them?

Issue 26 asks for a step within 1.5x the weight-streaming limit. This script measures, on the default model:
1. the weight-streaming limit (one `sum()` over as many bytes as the model's weights, as decode_steps.py);
2. the model's projection matrices (every layer's, distinct tensors, one-row input) through `F.linear`, and as
   `x @ W.T` on transposed contiguous copies; the LM head alone both ways; and for each of `--rows` (a batch of
   decoding steps) the layers' products through `F.linear` and through the model's own layers (kvsieve's fused
   kernel where it applies, see docs/PERFORMANCE.md "Decoding products on the CPU"; with `--quantize int8` the
   int8 layers, against `F.linear` on their dequantized float weights);
3. a decoding step of transformers' own `StaticCache` + SDPA, eager and under `torch.compile(fullgraph=True)`:
   the upper bound of what compiling the step can give (it removes the Python between operators).

    python benchmarks/decode_bound.py --prompt 2048 --steps 20 --out runs/decode_bound.json
    python benchmarks/decode_bound.py --rows 1,2,4,8 --products-only   # only 1. and 2.
    python benchmarks/decode_bound.py --rows 1,4 --products-only --quantize int8
    python benchmarks/decode_bound.py --shapes 64x64,192x576,576x576 --products-only   # and 4. (no model needed)

4. with `--shapes OUTxIN,...`: one row times weights of each shape, F.linear against kvsieve's C++ product
   (`kvsieve.kernels.products.kernel_product`), the weights rotated through about 200 MB so that each comes from memory:
   whether small weights should keep PyTorch's product.
    python benchmarks/decode_bound.py --random-weights CONFIG_DIR --device cuda --dtype bfloat16   # a GPU

5. with `--attention KEYS,...`: one decoding step's attention in every layer alone (the model's heads, float32
   caches of KEYS entries per layer, distinct tensors, for each of `--rows`): PyTorch's (`dense_attention` for one
   row, SDPA, and `grouped_attention` for several, the products), kvsieve's kernel
   (`kvsieve.kernels.attention`), and one `sum()` over the same keys and values (what reading them takes).
    python benchmarks/decode_bound.py --attention 2048,8000 --rows 1,4 --products-only

On CUDA the compiled step uses `mode="reduce-overhead"` (CUDA graphs).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from decode_steps import _sync, random_model, weight_stream_ms
from transformers import StaticCache

from kvsieve import fast_paths, load_model
from kvsieve.attention import dense_attention, grouped_attention
from kvsieve.kernels import attention as decode_kernel
from kvsieve.kernels.products import kernel_product
from kvsieve.quantize import QUANTIZE_CHOICES, Int8Linear, quantize


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def step_times(model, step: Callable, prompt: torch.Tensor, steps: int) -> dict[str, float]:
    """First step and median of the later ones (ms) of a greedy decode over a fresh StaticCache."""
    device = model.device
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps + 8)
    with torch.no_grad():
        position = prompt.shape[1]
        where = torch.arange(position, device=device)
        logits = model(input_ids=prompt, past_key_values=cache, cache_position=where).logits
        times = []
        for _ in range(steps + 3):
            token, where = logits[:, -1:].argmax(-1), torch.tensor([position], device=device)
            _sync(device)
            start = time.perf_counter()
            logits = step(input_ids=token, past_key_values=cache, cache_position=where, position_ids=where[None]).logits
            _sync(device)
            times.append(time.perf_counter() - start)
            position += 1
    later = sorted(times[3:])
    return {"first_ms": times[0] * 1e3, "median_ms": later[len(later) // 2] * 1e3}


def product_times(model, batch_rows: list[int]) -> dict[str, object]:
    """The model's matrix products (ms, MB): one row through F.linear and on transposed copies; `batch_rows` rows
    through F.linear and through kvsieve's product."""
    device, dtype = model.device, model.dtype
    layers = [m for m in model.model.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    matrices = [m.dequantized() if isinstance(m, Int8Linear) else m.weight for m in layers]
    head = model.lm_head.dequantized() if isinstance(model.lm_head, Int8Linear) else model.lm_head.weight
    rows = {w.shape[1]: torch.randn(1, 1, w.shape[1], device=device, dtype=dtype) for w in [*matrices, head]}
    transposed = [w.t().contiguous() for w in matrices]
    head_t = head.t().contiguous()
    with torch.no_grad():
        result: dict[str, object] = {
            "layers_mb": sum(w.numel() * w.element_size() for w in matrices) / 1e6,
            "layers_linear_ms": median_ms(lambda: [F.linear(rows[w.shape[1]], w) for w in matrices], 20, device),
            "layers_transposed_ms": median_ms(lambda: [rows[w.shape[0]] @ w for w in transposed], 20, device),
            "head_linear_ms": median_ms(lambda: F.linear(rows[head.shape[1]], head), 50, device),
            "head_transposed_ms": median_ms(lambda: rows[head.shape[1]] @ head_t, 50, device),
        }
        by_rows = {}
        for count in batch_rows:
            xs = {m.in_features: torch.randn(count, 1, m.in_features, device=device, dtype=dtype) for m in layers}
            by_rows[count] = {
                "pytorch_ms": median_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in matrices], 20, device),
                "kvsieve_ms": median_ms(lambda xs=xs: [m(xs[m.in_features]) for m in layers], 20, device),
            }
            print(f"{len(layers)} layer products, {count} rows: {by_rows[count]}")
        result["layers_by_rows"] = by_rows
    return result


def shape_times(shapes: list[tuple[int, int]], dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """One row times weights of each (out, in) shape on the CPU (us per product): F.linear and kvsieve's kernel."""
    result = {}
    for out_features, in_features in shapes:
        count = min(400, max(1, 200_000_000 // (out_features * in_features * 4)))
        weights = [torch.randn(out_features, in_features, dtype=dtype) for _ in range(count)]
        x = torch.randn(1, in_features, dtype=dtype)
        with torch.no_grad():
            pytorch = median_ms(lambda x=x, weights=weights: [F.linear(x, w) for w in weights], 7, x.device)
            fused = median_ms(lambda x=x, weights=weights: [kernel_product(x, w) for w in weights], 7, x.device)
        result[f"{out_features}x{in_features}"] = {"pytorch_us": pytorch * 1e3 / count, "fused_us": fused * 1e3 / count}
        print(f"{out_features} x {in_features}, one row: {result[f'{out_features}x{in_features}']}")
    return result


def attention_times(model, key_counts: list[int], batch_rows: list[int]) -> dict[str, dict[str, float]]:
    """One step's attention in every layer (ms): PyTorch's, kvsieve's kernel and a `sum()` of the same cache."""
    config, result = model.config, {}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for keys, rows in [(keys, rows) for keys in key_counts for rows in batch_rows]:
        layers = [
            (torch.randn(rows, heads, 1, dim), *torch.randn(2, rows, kv_heads, keys, dim).unbind())
            for _ in range(config.num_hidden_layers)
        ]
        lengths = torch.full((rows,), keys)

        def pytorch(layers=layers, lengths=lengths, rows=rows):
            if rows == 1:  # what a lone row's step calls (SDPA below GROUPED_FROM keys)
                return [dense_attention(q, k, v, None) for q, k, v in layers]
            return [grouped_attention(q, k, v, None, lengths) for q, k, v in layers]

        def kernel(layers=layers, lengths=lengths):
            return [decode_kernel.kernel_attention(q, k, v, None, lengths) for q, k, v in layers]

        with fast_paths.using(attention_kernel=False):
            times = {"pytorch_ms": median_ms(pytorch, 15, model.device)}
        times["kernel_ms"] = median_ms(kernel, 15, model.device)
        times["sum_ms"] = median_ms(lambda layers=layers: [(k.sum(), v.sum()) for _, k, v in layers], 15, model.device)
        result[f"{keys} keys x {rows} rows"] = times
        print(f"attention, {keys} keys, {rows} rows: {times}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens before decoding")
    parser.add_argument("--steps", type=int, default=20, help="timed decoding steps")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: the model's loading dtype)")
    parser.add_argument("--random-weights", type=Path, default=None, metavar="CONFIG_DIR", help="as decode_steps.py")
    parser.add_argument("--rows", default="1,4", help="rows of the layer products through F.linear and kvsieve's")
    parser.add_argument("--quantize", default=None, choices=QUANTIZE_CHOICES, help="weights as in `kvsieve.quantize`")
    parser.add_argument("--shapes", default=None, help="OUTxIN,... : one row, F.linear against kvsieve's kernel (4.)")
    parser.add_argument("--attention", default=None, help="KEYS,... : one step's attention alone (5.)")
    parser.add_argument("--products-only", action="store_true", help="skip the decoding steps (3.)")
    parser.add_argument("--out", type=Path, default=Path("runs/decode_bound.json"))
    args = parser.parse_args()
    model, _ = random_model(args) if args.random_weights else load_model(device=args.device, dtype=args.dtype)
    model = quantize(model, args.quantize)
    model.set_attn_implementation("sdpa")  # transformers' own path, not kvsieve's
    batch_rows = [int(n) for n in args.rows.split(",")]
    result = {"weight_stream_ms": weight_stream_ms(model), **product_times(model, batch_rows)}
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
        result["shapes"] = shape_times(shapes, model.dtype)
    if args.attention:
        result["attention"] = attention_times(model, [int(n) for n in args.attention.split(",")], batch_rows)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, model.config.vocab_size, (1, args.prompt), generator=generator).to(model.device)
    mode = "reduce-overhead" if model.device.type == "cuda" else None  # CUDA graphs on a GPU
    if not args.products_only:
        result["eager"] = step_times(model, model, prompt, args.steps)
        compiled = torch.compile(model.forward, fullgraph=True, mode=mode)
        result["compiled"] = step_times(model, compiled, prompt, args.steps)
        result["eager_again"] = step_times(model, model, prompt, args.steps)
    result["settings"] = {
        "prompt": args.prompt,
        "steps": args.steps,
        "rows": batch_rows,
        "quantize": args.quantize,
        "threads": torch.get_num_threads(),
        "device": str(model.device),
        "dtype": str(model.dtype),
        "compile_mode": mode,
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
