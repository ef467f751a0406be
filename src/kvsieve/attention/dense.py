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

from kvsieve.kernels.attention import decode_attention, grouped_attention


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

    Returns (b, h, q, d). A decoding step (one query) goes to `kvsieve.kernels.attention.decode_attention`, which
    chooses among the CPU's kernel, the grouped product and SDPA.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len == 1:
        return decode_attention(query, key, value, scaling)
    if q_len == k_len:
        return F.scaled_dot_product_attention(query, key, value, scale=scaling, is_causal=True, enable_gqa=True)
    n_rep = query.shape[1] // key.shape[1]
    mask = bottom_right_causal_mask(q_len, k_len, query.device)
    return F.scaled_dot_product_attention(
        query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=mask, scale=scaling
    )


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
