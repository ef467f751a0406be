"""Weight-only int8: every linear layer's weights as int8 with one float32 scale per output row.

A decoding step reads every weight once per token, so on a CPU a small model's step is bound by
moving its weights (docs/PERFORMANCE.md): int8 weights are a quarter of float32's bytes.
Activations stay in the model's dtype; only the stored weights change, rounded to the nearest of
255 levels per output row (absmax scaling, symmetric: w ~= scale[o] * q[o, i], |q| <= 127).

How a product runs (`kvsieve.kernels.products.int8_linear`):
- a few rows (decoding steps, up to `KERNEL_ROWS`) on the CPU: the C++ kernel of `kvsieve.kernels.products`
  with a scale, which reads each int8 weight once, widens it in the registers and multiplies-and-sums,
  so no float copy of the weights is ever written (SmolLM2's 211 products, one row: 6.0 ms, against
  12.3 for the inductor-compiled kernel it replaced; 8 rows 18.0 against 39.7), also called from
  inside a compiled graph, except for one row, whose product is traced into the graph (as in
  `kvsieve.kernels.products`). Where the library cannot be built, the dequantized product
  runs instead (`kvsieve.kernels.native` warns once);
- anything else (a prefill, a GPU): the weights dequantized to the activations' dtype, then
  `F.linear`. On a GPU this saves memory and costs time (an H200's captured step: 3.8 -> 5.8 ms; no
  fused int8 GPU kernel is shipped).

The embedding table stays as it is (a step reads one of its rows); a language-model head tied to it
gets an int8 copy of its own. Measured (docs/PERFORMANCE.md, docs/STUDIES.md): perplexity and speed against float32.
"""

from __future__ import annotations

import gc

import torch
from transformers import PreTrainedModel

from kvsieve.errors import KvsieveError
from kvsieve.kernels.products import int8_linear
from kvsieve.memory import release_freed

QUANTIZE_CHOICES = ("none", "int8")
QUANTIZE_ROWS = 4096  # output rows quantized at a time (a 49152-row LM head would need 3 float copies at once)


class Int8Linear(torch.nn.Module):
    """A linear layer whose weight is int8 with a float32 scale per output row (buffers, not parameters: the
    model's dtype stays the activations')."""

    weight: torch.Tensor  # (out_features, in_features) int8, a buffer
    scale: torch.Tensor  # (out_features,) float32, a buffer

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", torch.empty_like(weight, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device))
        for start in range(0, weight.shape[0], QUANTIZE_ROWS):  # float temporaries of a block of rows at a time
            rows = weight[start : start + QUANTIZE_ROWS].float()
            scale = (rows.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            self.weight[start : start + QUANTIZE_ROWS] = torch.round(rows / scale[:, None]).to(torch.int8)
            self.scale[start : start + QUANTIZE_ROWS] = scale
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.weight, self.scale, self.bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (scale x int8)."""
        return self.weight.float() * self.scale[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"


def quantize(model: PreTrainedModel, scheme: str | None) -> PreTrainedModel:
    """Store `model`'s linear layers (every decoder layer's projections and the LM head) as `scheme`, in place:
    "int8" (weight-only, `Int8Linear`) or "none"/None (unchanged)."""
    if scheme in (None, "none"):
        return model
    if scheme != "int8":
        raise KvsieveError(f"Unknown quantization '{scheme}'; choose one of {', '.join(QUANTIZE_CHOICES)}.")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, Int8Linear(child))
    if getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the head is an int8 copy now; the embedding stays
    _release_float_weights(model)
    return model


def _release_float_weights(model: PreTrainedModel) -> None:
    """Give the memory of the replaced float weights back to the system.

    transformers maps a checkpoint's file into memory, and one tensor still using the mapping (the embedding)
    keeps every weight's pages that quantizing read resident: the float parameters left on the CPU get a copy of
    their own, so the mapping closes. The quantizing's temporaries are freed into glibc's heap, which keeps them
    until `malloc_trim`. Measured on SmolLM2 (resident memory after loading and one forward pass): float32 954 MB,
    int8 1143 MB without this, 739 MB with it. On CUDA the caching allocator's free blocks are released.
    """
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.device.type == "cpu":
                parameter.data = parameter.data.clone()
    gc.collect()
    release_freed()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def weight_scheme(model: torch.nn.Module) -> str:
    """How `model`'s linear weights are stored: "int8" (`quantize`d) or "none"."""
    return "int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else "none"
