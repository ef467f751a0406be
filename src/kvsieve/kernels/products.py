"""The linear layers' products: kvsieve's C++ product for a decoding step's few rows on a CPU, PyTorch's otherwise;
the one place that chooses between them.

A decoding step multiplies one row per request by every weight matrix, so it is bound by reading the
weights (docs/PERFORMANCE.md). PyTorch's CPU product for a few rows is MKL's matrix-vector
kernel, which on the AMD EPYC host we measure on reads the weights at a third to a half of the
memory's speed. `torch.ops.kvsieve.decode_product` (`products.cpp`, built by `kvsieve.kernels.native`)
reads each weight once, front to back, each weight row multiplied by every input row while it is in
the registers, with fused multiply-adds in independent chains (SmolLM2-135M's 211 products, float32,
2-core AMD EPYC, ms: one row 16.6-17.5 against MKL's 42.8-43.4, against 16.6-18.1 for reading the same
538 MB with `sum()`; 8 rows 32.0-32.3 against 67.1-69.9; bfloat16 weights one row 10.0-10.3 against
21.0-21.6). It replaced a product compiled by inductor (one row 20.0-21.4 ms, 8 rows 44-47), which
also made every new process compile it first.

`FusedLinear` is `torch.nn.Linear` whose forward takes the kernel for up to `FUSED_ROWS` rows on a CPU
(float32 and bfloat16 weights; the rows go in as float32 and come out in their dtype) and PyTorch's product
(`pytorch_product`) otherwise (a prefill, a GPU, float16); inside a caller's own `torch.compile` (the compiled
step) the kernel is called from the graph, except for one row, whose product is traced into it (`traced_product`:
inductor fuses it with the operators around it, which measured faster than the call). `kvsieve.prepare` gives a
model's linear layers this forward (`fuse_linears`). int8 weights (`kvsieve.quantize`) use the same
kernel with a scale. Where the library cannot be built, PyTorch's product runs (`kvsieve.kernels.native` warns
once). The switch `fused_products` (`kvsieve.fast_paths`) turns the kernel off: every product is then
PyTorch's own.

PyTorch's own product of bfloat16 on a CPU that oneDNN cannot multiply bfloat16 on (no AVX-512: our AMD EPYC host
has AVX2 only) takes a slow path: a (4096 x 576) x (576 x 1536) product, SmolLM2's MLP at a 4K prefill, 0.90 s
against 0.15 s for the same product in float32. `pytorch_product` multiplies such bfloat16 in float32 and rounds
the result to bfloat16: what a bfloat16 product computes (it accumulates in float32 too; the two differ in the order
of the sum, one bfloat16 step on 0.013% of that product's outputs). The switch `widened_products` turns it off.
"""

from __future__ import annotations

import functools
from typing import TypeVar

import torch
import torch.nn.functional as F

from kvsieve import fast_paths
from kvsieve.kernels import native

# Rows up to which a CPU product takes the kernel (the kernel's limit; a decoding batch's rows). Per weight dtype,
# SmolLM2's 211 products (ms, kernel vs PyTorch's): float32 1 row 16.6 vs 42.8, 2 rows 16.3 vs 73.5, 4 rows
# 18.9 vs 66.2, 8 rows 32.0 vs 69.9; bfloat16 1 row 10.0 vs 21.5, 2 rows 11.0 vs 22.4, 4 rows 15.1 vs 23.7,
# 8 rows 23.2 vs 26.1. Small weights too: SmolLM2's 60 k and v products (192 x 576), one row, 0.64-0.75 ms vs
# 1.95-2.39. Other dtypes keep PyTorch's product.
KERNEL_ROWS = 8  # the most rows the kernel takes at once (products.cpp's MAX_ROWS)
FUSED_ROWS = {torch.float32: KERNEL_ROWS, torch.bfloat16: KERNEL_ROWS}


def fused_rows(x: torch.Tensor, most: int) -> bool:
    """Whether a product of `x` (..., in) takes a fused kernel: enabled, on a CPU, at most `most` rows."""
    return fast_paths.current().fused_products and x.device.type == "cpu" and x.numel() <= most * x.shape[-1]


def kernel_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """x (..., in) times a contiguous `weight` (out, in), float32, bfloat16 or int8 with its float32 `scale` per
    output row, through the C++ kernel: (..., out) in float32; None where the library could not be built.

    A decoding step calls this about 200 times (SmolLM2), so a float32 contiguous `x` goes to the kernel as it is:
    a reshape, a no-op `to` and a `view` around every call took 3-4 us of its 12 (docs/STUDIES.md)."""
    if not native.load():
        return None
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32, memory_format=torch.contiguous_format)
    return torch.ops.kvsieve.decode_product(x, weight, scale)


def traced_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(1, in) x (out, in) -> (1, out) as a compiled graph traces a decoding step's one row: each weight row times the
    row, summed, (out, 1) then transposed (the form the compiled step was measured with; inductor accumulates in
    float32 and fuses the product with the operators around it)."""
    return (weight.unsqueeze(1) * x.unsqueeze(0)).sum(-1).t().contiguous()


# Rows up to which a product inside a compiled graph (the CPU's compiled step) is traced into it (`traced_product`):
# inductor fuses one row's product with the norms around it, which measured faster than calling the kernel from the
# graph (SmolLM2, full attention at 2K: 23.2 vs 25.1 ms; int8 12.6 vs 12.8). Several rows call the kernel from the
# graph: the traced several-row product read the weights far slower (4 / 8 rows, traced -> kernel, float32 52.8 ->
# 43.9 / 91.5 -> 70.2 ms a step, int8 40.4 -> 31.1 / 71.1 -> 51.3; docs/STUDIES.md).
TRACED_ROWS = 1


@functools.cache
def native_bfloat16() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU (its own check: AVX-512 or Arm's bfloat16); where it does not,
    PyTorch's CPU product of bfloat16 takes a slow path. An unknown answer counts as native (nothing changes)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def pytorch_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; bfloat16 on a CPU without native bfloat16 products is multiplied in float32 and
    rounded back (the module docstring says why), unless the switch `widened_products` is off or a graph is being
    compiled (inductor chooses its own product)."""
    if (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and fast_paths.current().widened_products
        and not torch.compiler.is_compiling()
        and not native_bfloat16()
    ):
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(torch.bfloat16)
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the kernel where `fused_rows(x)` (`kernel_product`, also from inside a
    compiled graph); inside a compiled graph (the CPU's compiled step) a product of `TRACED_ROWS` row is traced into
    it instead (`traced_product`)."""
    out = None
    if not torch.is_grad_enabled():
        if torch.compiler.is_compiling() and x.dtype in FUSED_ROWS and fused_rows(x, TRACED_ROWS):
            out = traced_product(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
        elif fused_rows(x, FUSED_ROWS.get(x.dtype, 0)) and weight.dtype == x.dtype and weight.is_contiguous():
            out = kernel_product(x, weight)
            out = out.to(x.dtype) if out is not None and out.dtype != x.dtype else out
    if out is None:
        return pytorch_product(x, weight, bias)
    return out if bias is None else out + bias


class FusedLinear(torch.nn.Linear):
    """`torch.nn.Linear` whose few-row CPU products take the fused kernel (same parameters, same state dict)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # Linear's own name for it
        return linear(input, self.weight, self.bias)


M = TypeVar("M", bound=torch.nn.Module)  # the model `fuse_linears` is given, returned as it came


def fuse_linears(model: M) -> M:
    """Give every plain `torch.nn.Linear` in `model` the fused forward, in place (its class becomes `FusedLinear`;
    parameters, tied weights and the state dict are untouched)."""
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = FusedLinear
    return model


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) times int8 `weight` (out, in) with per-row `scale` (out,), plus `bias`; in x's dtype
    (`kvsieve.quantize`'s layers). The kernel for up to `KERNEL_ROWS` rows on a CPU (one row in a compiled graph:
    traced), else the weights dequantized to x's dtype and PyTorch's product (`pytorch_product`)."""
    out = None
    if fused_rows(x, KERNEL_ROWS):
        if torch.compiler.is_compiling() and fused_rows(x, TRACED_ROWS):  # one row in a compiled graph: traced
            flat = x.reshape(-1, x.shape[-1]).float()
            out = (traced_product(flat, weight) * scale).view(*x.shape[:-1], weight.shape[0])
        else:
            out = kernel_product(x, weight, scale)  # (..., out)
        out = out.to(x.dtype) if out is not None and out.dtype != x.dtype else out
    if out is None:
        out = pytorch_product(x, (weight.float() * scale[:, None]).to(x.dtype), None)
    return out if bias is None else out + bias
