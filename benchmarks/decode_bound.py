"""What bounds a batch-1 decoding step on this machine: the matrix products, or the Python around them?

Issue 26 asks for a step within 1.5x the weight-streaming limit. This script measures, on the default model:
1. the weight-streaming limit (one `sum()` over as many float32 bytes as the model's weights);
2. the model's projection matrices (every layer's, distinct tensors, one-row input) through `F.linear`, and as
   `x @ W.T` on transposed contiguous copies; the LM head alone both ways;
3. a decoding step of transformers' own `StaticCache` + SDPA, eager and under `torch.compile(fullgraph=True)`:
   the upper bound of what compiling the step can give (it removes the Python between operators).

    python benchmarks/decode_bound.py --prompt 2048 --steps 20 --out runs/decode_bound.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import StaticCache

from kvsieve import load_model


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e3


def step_times(model, step: Callable, prompt: torch.Tensor, steps: int) -> dict[str, float]:
    """First step and median of the later ones (ms) of a greedy decode over a fresh StaticCache."""
    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps + 8)
    with torch.no_grad():
        position = prompt.shape[1]
        logits = model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(position)).logits
        times = []
        for _ in range(steps + 3):
            token, where = logits[:, -1:].argmax(-1), torch.tensor([position])
            start = time.perf_counter()
            logits = step(input_ids=token, past_key_values=cache, cache_position=where, position_ids=where[None]).logits
            times.append(time.perf_counter() - start)
            position += 1
    later = sorted(times[3:])
    return {"first_ms": times[0] * 1e3, "median_ms": later[len(later) // 2] * 1e3}


def product_times(model) -> dict[str, float]:
    """The weight-streaming limit and the model's matrix products on a one-row input (ms, MB)."""
    matrices = [m.weight for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.lm_head.weight
    weight_bytes = sum(p.numel() for p in model.parameters()) * 4  # tied embeddings counted once
    flat = torch.empty(weight_bytes // 4).normal_()
    rows = {w.shape[1]: torch.randn(1, 1, w.shape[1]) for w in [*matrices, head]}
    transposed = [w.t().contiguous() for w in matrices]
    head_t = head.t().contiguous()
    with torch.no_grad():
        return {
            "weights_mb": weight_bytes / 1e6,
            "stream_limit_ms": min(median_ms(flat.sum, 1) for _ in range(5)),
            "layers_mb": sum(w.numel() for w in matrices) * 4 / 1e6,
            "layers_linear_ms": median_ms(lambda: [F.linear(rows[w.shape[1]], w) for w in matrices], 20),
            "layers_transposed_ms": median_ms(lambda: [rows[w.shape[0]] @ w for w in transposed], 20),
            "head_linear_ms": median_ms(lambda: F.linear(rows[head.shape[1]], head), 50),
            "head_transposed_ms": median_ms(lambda: rows[head.shape[1]] @ head_t, 50),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens before decoding")
    parser.add_argument("--steps", type=int, default=20, help="timed decoding steps")
    parser.add_argument("--out", type=Path, default=Path("runs/decode_bound.json"))
    args = parser.parse_args()
    model, _ = load_model()
    model.config._attn_implementation = "sdpa"  # transformers' own path, not kvsieve's
    result = product_times(model)
    prompt = torch.randint(100, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    result["eager"] = step_times(model, model, prompt, args.steps)
    result["compiled"] = step_times(model, torch.compile(model.forward, fullgraph=True), prompt, args.steps)
    result["eager_again"] = step_times(model, model, prompt, args.steps)
    result["settings"] = {"prompt": args.prompt, "steps": args.steps, "threads": torch.get_num_threads()}
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
