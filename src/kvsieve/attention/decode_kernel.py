"""The CPU's decoding attention kernel (`decode_kernel.cpp`, built with kvsieve's other kernels by `kvsieve.native`).

A decoding step's attention reads the whole cache once for one query per row. On a CPU, PyTorch's products
for it read the cache at a third to a half of the memory's speed (SmolLM2's 30 layers at 2K keys: 7.3 ms of
products against 2.9 ms to read the keys and values with `sum()`); the kernel reads each key and value once,
in chunks shared out among PyTorch's threads, and takes the logits of every query head of a KV head from each
key while it is in the registers (the C++ file says how). It serves float32 caches with head dimensions 16,
32, 64, 96, 128 or 256, one query per row, with or without each row's key count (the engine's padded batch).

`kernel_attention_probs` also returns the attention's probabilities, from the same pass over the keys (the
per-step scores of H2O, A2SF and TOVA: `kvsieve.attention.AttentionRows`).

It is the operators `torch.ops.kvsieve.decode_attention` and `decode_attention_probs`, which a compiled graph
calls as they are. Where the
library cannot be built (no compiler), `kernel_attention` returns None (`kvsieve.native` warns once) and the
caller runs PyTorch's attention. The switch `attention_kernel` (`kvsieve.fast_paths`) turns it off.
"""

from __future__ import annotations

import torch

from kvsieve import fast_paths, native

HEAD_DIMS = (16, 32, 64, 96, 128, 256)


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel serves these tensors: enabled, on a CPU, float32, one query per row, a head dimension it
    is built for, query heads a multiple of the KV heads, keys and values contiguous in the last dimension."""
    return (
        fast_paths.current().attention_kernel
        and query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype == torch.float32
        and query.shape[2] == 1
        and query.shape[-1] in HEAD_DIMS
        and query.shape[1] % key.shape[1] == 0
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )


def kernel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """A decoding step's attention through the kernel: query (b, h, 1, d), key/value (b, kv_heads, n, d), row b
    attending to its first `lengths[b]` keys (None: all n); (b, h, 1, d), or None where the kernel does not serve
    these tensors (`supports`) or could not be built."""
    if not supports(query, key, value) or not native.load():
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.kvsieve.decode_attention(query, key, value, lengths, scale)


def kernel_attention_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`kernel_attention` and its probabilities: ((b, h, 1, d), (b, h, n) float32, each query head's softmax over the
    keys, 0 past a row's length), from one pass over the keys; None where `kernel_attention` would be."""
    if not supports(query, key, value) or not native.load():
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.kvsieve.decode_attention_probs(query, key, value, lengths, scale)
