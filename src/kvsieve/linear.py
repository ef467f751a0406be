"""How the model's linear layers multiply a decoding step's few rows on a CPU: one compiled kernel.

A decoding step multiplies one row per request by every weight matrix, so it is bound by reading the
weights (docs/STUDIES.md, issue 26). PyTorch's CPU product for a few rows is MKL's matrix-vector
kernel, which on the AMD EPYC host we measure on reads the weights at a third to a half of the
memory's speed: the 211 products of one SmolLM2-135M step took 44.6 ms, against 16 ms for reading
the same 538 MB with `sum()`. The product written as `(w * x).sum(-1)` with the weight's rows
outermost (`float_product`) and compiled by inductor reads each weight once, in order, with vector
instructions, each weight row multiplied by every input row while it is in the cache: 21.7 ms for
the same products. Weights under `FUSED_MIN_WEIGHT` elements sit in the caches, where MKL is as fast
without a compiled call's overhead, so they keep PyTorch's product.

`float_products` is that kernel, compiled at its first call (`kvsieve.compiled`: shapes are dynamic,
so a few compilations serve every layer, and inductor caches them on disk for later processes) with
its compile time logged; where it cannot be compiled (no C++ compiler), the ordinary product runs,
with one warning.
`FusedLinear` is `torch.nn.Linear` whose forward takes the kernel for up to `FUSED_ROWS` rows on a
CPU (4 in float32, 1 in bfloat16: where it measured faster) and `F.linear` otherwise (a prefill, a
GPU); inside a caller's own `torch.compile` the product is traced into the caller's graph instead.
`kvsieve.prepare` gives a model's linear layers this forward (`fuse_linears`). int8 weights
(`kvsieve.quantize`) use the same kernel with a scale. `KVSIEVE_FUSED_PRODUCTS=0` (or
`set_enabled(False)`) turns the kernel off: every product is then PyTorch's own.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from kvsieve.compiled import Compiled

# Rows up to which a CPU product of float weights takes the fused kernel, per dtype, where it measured faster
# than PyTorch's (the 211 products of a SmolLM2 step, 2-core AMD EPYC, ms): float32 1 row 21.7 vs 44.6,
# 4 rows 37.9 vs 62.5, 8 rows 55.7 vs 54.8 (and whole steps of 8 rows 10-16% slower, of 4 rows 0-15% faster);
# bfloat16 1 row 15.2 vs 24.3, 4 rows 43.1 vs 26.1; float16 1 row 15.1 vs 9.2 (never). Other dtypes keep
# PyTorch's product. With the rows-outermost form (`float_product`; `benchmarks/decode_bound.py --rows`, the 210
# layer products): float32 1 row 24.1 vs 35.7, 2 rows 26.1 vs 53.9, 4 rows 32.8 vs 52.9; at 8 rows that form was
# slower than the old one (46.2 vs 38.3 ms), and bfloat16 past one row still lost (4 rows 27.1 vs 17.6): limits kept.
FUSED_ROWS = {torch.float32: 4, torch.bfloat16: 1}
# Weights (elements) from which a product takes the kernel. A smaller weight sits in the caches, where MKL's
# product is as fast or faster and a compiled call's ~20 us of Python and guards dominate (one row, us,
# float32 / bfloat16, weights rotated from memory): 64x64 6 vs 52; 256x128 20 vs 36 / 25 vs 36; 192x576 (SmolLM2's
# k and v) 42 vs 46 / 37 vs 40; 512x256 65 vs 76 in one run and 63 vs 48 in another; 384x576 83 vs 63 / 54 vs 45;
# 576x576 119 vs 78 / 64 vs 55 (float32 again: `benchmarks/decode_bound.py --shapes`). So SmolLM2's k and v products
# stay PyTorch's (60 fewer compiled calls a step) and a tiny test model compiles nothing.
FUSED_MIN_WEIGHT = 1 << 17
_enabled = os.environ.get("KVSIEVE_FUSED_PRODUCTS", "1") != "0"


def set_enabled(enabled: bool) -> None:
    """Use the fused kernels for a CPU's few-row products (the default) or PyTorch's own products."""
    global _enabled
    _enabled = enabled


def fused_rows(x: torch.Tensor, most: int) -> bool:
    """Whether a product of `x` (..., in) takes a fused kernel: enabled, on a CPU, at most `most` rows."""
    return _enabled and x.device.type == "cpu" and x.numel() <= most * x.shape[-1]


def float_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(rows, in) x (out, in) -> (rows, out), each weight read once (inductor accumulates in float32).

    Written with the weight's rows outermost, (out, rows) then transposed, so that the kernel multiplies one
    weight row by every input row while it is in the cache: with the rows outermost, each input row streamed
    the whole weight again (SmolLM2's 180 layer products, float32, medians of 15: 2 rows 24.8 -> 20.2 ms,
    4 rows 31.2 -> 24.8 ms, one row the same)."""
    return (weight.unsqueeze(1) * x.unsqueeze(0)).sum(-1).t().contiguous()


float_products = Compiled("fused product, float weights", float_product)

# Rows up to which a product inside a compiled graph (the CPU's compiled step) is traced into it, per dtype (more:
# PyTorch's product in the graph). The compiled step serves at most `engine.batch.COMPILED_ROWS` rows.
TRACED_ROWS = {torch.float32: 8, torch.bfloat16: 1}


def traced_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(rows, in) x (out, in) -> (rows, out) as a compiled graph should trace it: `float_product` for one row,
    rows first for several. Inside a graph inductor keeps `float_product`'s (out, rows) result in that layout,
    so the next product's sum runs over a strided dimension and inductor vectorises across the rows instead
    (SmolLM2's step, 4 SnapKV rows at 2K, ordinary -> compiled: 66.0 -> 287.5 ms as `float_product`, and in
    another run 59.3 -> 50.0 ms rows first; docs/STUDIES.md)."""
    if x.shape[0] == 1:
        return float_product(x, weight)
    return (x.unsqueeze(1) * weight.unsqueeze(0)).sum(-1)


def plain_rows(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x (..., in) as a new contiguous (rows, in) tensor (in `dtype`, default x's): no view of another tensor and no
    storage offset. Dynamo guards a view's base and offset too, so views as inputs made a kernel per kind of
    view (7 compilations for one layer shape in the tests) and which one a product took could depend on how its
    input was made; a copy of a decoding step's few rows costs about 2 microseconds."""
    flat = x.reshape(-1, x.shape[-1])
    if dtype is None or dtype == x.dtype:
        return flat.clone(memory_format=torch.contiguous_format)
    return flat.to(dtype, memory_format=torch.contiguous_format)  # another dtype: always a new tensor


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the fused kernel where `fused_rows(x)` and the weight has at least
    `FUSED_MIN_WEIGHT` elements; inside a compiled graph (the CPU's compiled step) the product of up to
    `TRACED_ROWS` rows is traced into it (`traced_product`) whatever the weight's size (SmolLM2's k and v
    products: 60 calls to MKL's product, 2.5 ms of a 32 ms step)."""
    out = None
    if not torch.is_grad_enabled():
        if torch.compiler.is_compiling():  # inside a caller's compiled graph: inductor fuses the product into it
            if fused_rows(x, TRACED_ROWS.get(x.dtype, 0)):
                out = traced_product(x.reshape(-1, x.shape[-1]), weight)
        elif fused_rows(x, FUSED_ROWS.get(x.dtype, 0)) and weight.numel() >= FUSED_MIN_WEIGHT:
            out = float_products(plain_rows(x), weight.detach())  # detached: dynamo compiles a Parameter's shape
    if out is None:
        return F.linear(x, weight, bias)
    out = out if bias is None else out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class FusedLinear(torch.nn.Linear):
    """`torch.nn.Linear` whose few-row CPU products take the fused kernel (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def fuse_linears(model: torch.nn.Module) -> torch.nn.Module:
    """Give every plain `torch.nn.Linear` in `model` the fused forward, in place (its class becomes `FusedLinear`;
    parameters, tied weights and the state dict are untouched)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = FusedLinear
    return model


def warm_up(model: torch.nn.Module) -> float:
    """Compile now the fused kernels that `model`'s decoding steps will call (one row and several), by running
    one token through it for 1 and 2 rows; seconds spent. A server calls it before serving, so that no request
    waits for the compile (SmolLM2 on the 2-core VM: 11.5 s with an empty inductor cache, 3.0 s with a warm
    one). Nothing compiles where the kernels are not used (a GPU, `KVSIEVE_FUSED_PRODUCTS=0`)."""
    device = next(model.parameters()).device
    if not _enabled or device.type != "cpu":
        return 0.0
    start = time.perf_counter()
    with torch.no_grad():
        for rows in (1, 2):
            model(input_ids=torch.zeros((rows, 1), dtype=torch.long, device=device), use_cache=False)
    return time.perf_counter() - start
