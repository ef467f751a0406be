"""The decoding step's attention: kvsieve's CPU kernel (`attention.cpp`) where it serves the tensors, PyTorch's
operators everywhere else; the one place that chooses between them.

A decoding step's attention reads the whole cache once for one query per row. On a CPU, PyTorch's products
for it read the cache at a third to a half of the memory's speed (SmolLM2's 30 layers at 2K keys: 7.3 ms of
products against 2.9 ms to read the keys and values with `sum()`); the kernel reads each key and value once,
in chunks shared out among PyTorch's threads, and takes the logits of every query head of a KV head from each
key while it is in the registers (the C++ file says how). It serves float32 and bfloat16 caches (computing in
float32: a bfloat16 cache is widened as it loads, so it reads half the bytes and is never copied to float32) with
head dimensions 16, 32, 64, 96, 128 or 256, one query per row, with or without each row's key count (the engine's
padded batch: a row reads its own keys only), without a logit soft-cap.

`decode_attention` and `decode_attention_probs` (the latter also returns the probabilities, from the same pass over
the keys: the per-step scores of H2O, A2SF and TOVA, `kvsieve.attention.AttentionRows`) are the dispatch: the
kernel (`kernel_attention`, `kernel_attention_probs`: None where it does not serve), else PyTorch's grouped
float32 product (`grouped_attention`, `grouped_probs`: padded rows, soft-caps, and long CPU caches) or SDPA. The
kernel is the operators `torch.ops.kvsieve.decode_attention` and `decode_attention_probs`, which a compiled graph
calls as they are. Where the library cannot be built (no compiler) `kvsieve.kernels.native` warns once and
PyTorch's attention runs; the switch `attention_kernel` (`kvsieve.fast_paths`) turns the kernel off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvsieve import fast_paths
from kvsieve.kernels import native
from kvsieve.models import logit_scale

HEAD_DIMS = (16, 32, 64, 96, 128, 256)


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel serves these tensors: enabled, on a CPU, float32 or bfloat16 (it computes in float32), one
    query per row, a head dimension it is built for, query heads a multiple of the KV heads, keys and values
    contiguous in the last dimension."""
    return (
        fast_paths.current().attention_kernel
        and query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype
        and key.dtype in KERNEL_DTYPES
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
    scale = logit_scale(query.shape[-1], scaling)
    return torch.ops.kvsieve.decode_attention(query, key, value, lengths, scale)


def segment_supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel serves a segmented cache's step (`segment_attention`): as `supports`, with the keys and
    values (total, d)."""
    return supports(query, key[None, None], value[None, None])


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
    scale = logit_scale(query.shape[-1], scaling)
    return torch.ops.kvsieve.decode_attention_probs(query, key, value, lengths, scale)


GROUPED_FROM = 4096  # rows x keys of a CPU decoding step from which the grouped matmul beats SDPA (measured)
# A single query on CUDA: every SDPA kernel but cuDNN's, whose per-shape plans a growing cache rebuilds every step.
SINGLE_QUERY_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """A decoding step's attention: query (b, h, 1, d) over key/value (b, kv_heads, n, d), row b over its first
    `lengths[b]` keys (None: all n; with `lengths` a row may also have several queries, the last of its keys), with
    Gemma 2's logit `softcap`; (b, h, q, d).

    The kernel where it serves the tensors; else the grouped float32 product for padded rows, soft-caps and, on a
    CPU, over at least GROUPED_FROM keys in all (rows x keys), where PyTorch's CPU SDPA kernel was 1.3 to 2x slower
    on decoding's cache views (and faster below); else SDPA, on CUDA never cuDNN's, which SDPA picks for bfloat16
    and which plans anew for every key length: a growing cache paid about 1.2 ms per layer and step on an H200
    (docs/PERFORMANCE.md)."""
    if softcap is None:
        out = kernel_attention(query, key, value, scaling, lengths)
        if out is not None:
            return out
    cpu_long = query.device.type == "cpu" and query.shape[0] * key.shape[2] >= GROUPED_FROM
    if lengths is not None or softcap is not None or cpu_long:
        return grouped_attention(query, key, value, scaling, lengths, None, softcap)
    if query.device.type == "cuda":
        with sdpa_kernel(SINGLE_QUERY_BACKENDS):
            return F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    return F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)


def decode_attention_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention` and its probabilities: ((b, h, 1, d), (b, h, n) float32, each query head's softmax over the
    keys, 0 past a row's length), from the kernel's one pass over the keys where it serves them, else from
    `grouped_probs`."""
    if softcap is None:
        attended = kernel_attention_probs(query, key, value, scaling, lengths)
        if attended is not None:
            return attended
    probs = grouped_probs(query, key, scaling, lengths, None, softcap)
    return attend_values(probs, value), probs[:, :, 0]


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float | None,
    longest: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention over a segmented cache (per-head budgets, `kvsieve.kv.heads`): key/value (total, d), KV head g of row
    b holding the `lengths[b, g]` entries from entry `starts[b, g]` on (`longest` of them at most, given by the
    caller, which knows it without reading the device); query (b, h, q, d), its queries the last q of every head's
    entries (bottom-right causal); `softcap`: Gemma 2's tanh cap on the logits; (b, h, q, d).

    A decoding step on a CPU is the kernel's `segment_attention`, one call per layer that reads each head's entries
    where they lie. Elsewhere (several queries, a soft-cap, CUDA, another dtype) each head's entries are gathered
    into a padded (b, g, longest, d) copy for this layer alone and attended with per-head lengths
    (`grouped_attention`): the copy lives while the layer computes, the cache holds only the segments."""
    if query.shape[2] == 1 and softcap is None and segment_supports(query, key, value) and native.load():
        scale = logit_scale(query.shape[-1], scaling)
        return torch.ops.kvsieve.segment_attention(query, key, value, starts, lengths, scale)
    columns = torch.arange(longest, device=key.device)
    index = (starts[..., None] + columns).clamp(max=key.shape[0] - 1)  # (b, g, longest): past a head's end, masked
    return grouped_attention(query, key[index], value[index], scaling, lengths, None, softcap)


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention through a grouped matmul: query head h reads KV head h // n_rep, K/V never repeated, the
    logits and softmax in float32 (`grouped_probs`). query (b, h, q, d), key/value (b, kv_heads, k, d); returns
    (b, h, q, d).

    `lengths` (b,) marks right padding (the engine's batch of ragged caches): row b holds lengths[b] keys and
    its query i sits at key column lengths[b] - q + i; None: every row holds all k keys. Lengths (b, kv_heads) give
    each KV head of a row its own count (per-head budgets, `segment_attention`). `window`: a query sees
    only the `window` columns ending at its own; `softcap`: Gemma 2's tanh cap on the logits.
    """
    return attend_values(grouped_probs(query, key, scaling, lengths, window, softcap), value)


def grouped_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The probabilities of `grouped_attention`: (b, h, q, k) float32, 0 where a query may not look (`lengths`,
    `window` and `softcap` as there)."""
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    scale = logit_scale(dim, scaling)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * q_len, dim)  # rows: (n_rep, q) per KV head
    # Logits in float32 from float32 operands (no copy in float32): a bfloat16 product rounds logits of 20-50 by
    # up to 0.1-0.2, which SDPA's kernels, accumulating in float32, never do.
    logits = torch.matmul(grouped.float(), key.float().transpose(-1, -2)) * scale  # (b, g, n_rep * q, k)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if lengths is not None or q_len > 1 or (window is not None and k_len > window):
        ends = lengths.to(key.device) if lengths is not None else torch.full((batch,), k_len, device=key.device)
        ends = ends.view(batch, -1)  # (b, 1), or (b, kv_heads): one count per head
        last = ends[..., None] - q_len + torch.arange(q_len, device=key.device)  # (b, 1 or g, q)
        columns = torch.arange(k_len, device=key.device)
        allowed = columns <= last[..., None]  # (b, 1 or g, q, k)
        if window is not None:
            allowed &= columns > last[..., None] - window
        allowed = allowed.repeat(1, 1, heads // kv_heads, 1)  # (b, 1 or g, n_rep * q, k)
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.softmax(-1).view(batch, heads, q_len, k_len)


def attend_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Probabilities (b, h, q, k) times value (b, kv_heads, k, d), query head h reading KV head h // n_rep, in the
    value's dtype: (b, h, q, d)."""
    batch, heads, q_len, k_len = probs.shape
    kv_heads, dim = value.shape[1], value.shape[3]
    grouped = probs.view(batch, kv_heads, heads // kv_heads * q_len, k_len).to(value.dtype)
    return torch.matmul(grouped, value).view(batch, heads, q_len, dim)
