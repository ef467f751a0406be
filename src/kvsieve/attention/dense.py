"""Dense causal attention with bottom-right alignment.

Queries are always the *last* `q_len` positions of the keys (a whole prompt, a chunk after a
memory, or one decoding step). PyTorch's `is_causal=True` aligns top-left, which is only right
when `q_len == k_len`; otherwise the mask is built here.

Hybrid models' sliding layers (Gemma 2/3, Mistral/Qwen2 with a window) attend within a window W: a query at key
column c sees columns c - W + 1 .. c, as transformers' `sliding_window_overlay` (kv > q - W). Their cache always
holds its entries in time order, so the window is a span of columns (`local_attention`). Gemma 2 also soft-caps its
logits, tanh(logits / cap) * cap, before the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvsieve.attention.decode_kernel import kernel_attention

GROUPED_FROM = 4096  # rows x keys of a CPU decoding step from which the grouped matmul beats SDPA (measured)
# A single query on CUDA: every SDPA kernel but cuDNN's, whose per-shape plans a growing cache rebuilds every step.
SINGLE_QUERY_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def bottom_right_causal_mask(q_len: int, k_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (q_len, k_len) mask, True where query i (position k_len - q_len + i) may attend key j."""
    offset = k_len - q_len
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    return cols <= rows + offset


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, kv_heads, n, d) -> (b, kv_heads * n_rep, n, d): query head h reads KV head h // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal SDPA. query (b, h, q, d); key/value (b, kv_heads, k, d), never stored repeated.

    Returns (b, h, q, d). A decoding step (one query) on the CPU takes kvsieve's kernel where it serves the
    tensors (`decode_kernel`), else, over at least GROUPED_FROM keys in all (rows x keys), `grouped_attention`:
    PyTorch's CPU SDPA kernel was 1.3 to 2x slower there on decoding's cache views, and faster below. On CUDA
    a single query never goes to cuDNN, which SDPA picks for bfloat16 and which plans anew for every key length:
    a growing cache paid about 1.2 ms per layer and step on an H200 (docs/STUDIES.md, issue 26).
    """
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len == 1 and query.device.type == "cpu":
        out = kernel_attention(query, key, value, scaling)
        if out is not None:
            return out
        if query.shape[0] * k_len >= GROUPED_FROM:
            return grouped_attention(query, key, value, scaling)
    if q_len == 1 and query.device.type == "cuda":
        with sdpa_kernel(SINGLE_QUERY_BACKENDS):
            return F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
    if q_len == 1 or q_len == k_len:
        return F.scaled_dot_product_attention(query, key, value, scale=scaling, is_causal=q_len > 1, enable_gqa=True)
    n_rep = query.shape[1] // key.shape[1]
    mask = bottom_right_causal_mask(q_len, k_len, query.device)
    return F.scaled_dot_product_attention(
        query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=mask, scale=scaling
    )


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
    its query i sits at key column lengths[b] - q + i; None: every row holds all k keys. `window`: a query sees
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
    scale = dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * q_len, dim)  # rows: (n_rep, q) per KV head
    # Logits in float32 from float32 operands (no copy in float32): a bfloat16 product rounds logits of 20-50 by
    # up to 0.1-0.2, which SDPA's kernels, accumulating in float32, never do.
    logits = torch.matmul(grouped.float(), key.float().transpose(-1, -2)) * scale  # (b, g, n_rep * q, k)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if lengths is not None or q_len > 1 or (window is not None and k_len > window):
        ends = lengths.to(key.device) if lengths is not None else torch.full((batch,), k_len, device=key.device)
        last = ends[:, None] - q_len + torch.arange(q_len, device=key.device)  # (b, q)
        columns = torch.arange(k_len, device=key.device)[None, None, :]
        allowed = columns <= last[:, :, None]  # (b, q, k)
        if window is not None:
            allowed &= columns > last[:, :, None] - window
        allowed = allowed.repeat(1, heads // kv_heads, 1)[:, None]  # (b, 1, n_rep * q, k)
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.softmax(-1).view(batch, heads, q_len, k_len)


def attend_values(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Probabilities (b, h, q, k) times value (b, kv_heads, k, d), query head h reading KV head h // n_rep, in the
    value's dtype: (b, h, q, d)."""
    batch, heads, q_len, k_len = probs.shape
    kv_heads, dim = value.shape[1], value.shape[3]
    grouped = probs.view(batch, kv_heads, heads // kv_heads * q_len, k_len).to(value.dtype)
    return torch.matmul(grouped, value).view(batch, heads, q_len, dim)


LOCAL_BLOCK = 512  # queries per block of `local_attention`: each block's mask is LOCAL_BLOCK x (LOCAL_BLOCK + W)


def local_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention (bottom-right) where a query sees only the `window` key columns ending at its own (None: every
    earlier one), with Gemma 2's logit soft-cap where `softcap` is set. query (b, h, q, d), key/value
    (b, kv_heads, k, d); returns (b, h, q, d).

    Queries go in blocks of LOCAL_BLOCK, each over the key columns its window reaches, so a sliding layer costs
    O(q * (block + W)) and no (q, k) mask is ever built, however long the prompt. Without a soft-cap a block is
    PyTorch's SDPA with a boolean mask; with one, the grouped float32 path (`grouped_attention`).
    """
    q_len, k_len = query.shape[2], key.shape[2]
    offset = k_len - q_len  # query i sits at key column offset + i
    if q_len == 1 and softcap is None:  # a decoding step: the last `window` columns, through the fast paths
        first = -window if window else 0
        return dense_attention(query, key[:, :, first:], value[:, :, first:], scaling)
    n_rep = query.shape[1] // key.shape[1]
    blocks = []
    for start in range(0, q_len, LOCAL_BLOCK):
        end = min(start + LOCAL_BLOCK, q_len)
        low = max(0, offset + start - window + 1) if window is not None else 0
        high = offset + end  # one past the block's last query's column
        keys, values = key[:, :, low:high], value[:, :, low:high]
        if softcap is not None:
            blocks.append(grouped_attention(query[:, :, start:end], keys, values, scaling, None, window, softcap))
            continue
        rows = torch.arange(offset + start, offset + end, device=query.device)[:, None]
        columns = torch.arange(low, high, device=query.device)[None, :]
        allowed = columns <= rows
        if window is not None:
            allowed &= columns > rows - window
        keys, values = repeat_kv(keys, n_rep), repeat_kv(values, n_rep)
        queries = query[:, :, start:end]
        blocks.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=scaling))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
