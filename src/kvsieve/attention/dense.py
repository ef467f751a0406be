"""Dense causal attention with bottom-right alignment.

Queries are always the *last* `q_len` positions of the keys (a whole prompt, a chunk after a
memory, or one decoding step). PyTorch's `is_causal=True` aligns top-left, which is only right
when `q_len == k_len`; otherwise, on a CPU, the mask is built here, and on CUDA PyTorch's
`causal_lower_right` bias tells the flash or memory-efficient kernel the alignment, so no mask is
read and the flash kernel (which a mask rules out) runs the chunks of a chunked feed.

Hybrid models' sliding layers (Gemma 2/3, Mistral/Qwen2 with a window) attend within a window W: a query at key
column c sees columns c - W + 1 .. c, as transformers' `sliding_window_overlay` (kv > q - W). Their cache always
holds its entries in time order, so the window is a span of columns (`local_attention`). Gemma 2 also soft-caps its
logits, tanh(logits / cap) * cap, before the softmax.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

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
    chooses among the CPU's kernel, the grouped product and SDPA. Fewer queries than keys: on CUDA
    `lower_right_attention`; elsewhere `masked_attention` under a bottom-right boolean mask.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    if q_len == 1:
        return decode_attention(query, key, value, scaling)
    if q_len == k_len:
        return F.scaled_dot_product_attention(query, key, value, scale=scaling, is_causal=True, enable_gqa=True)
    if query.is_cuda:
        return lower_right_attention(query, key, value, scaling)
    return masked_attention(query, key, value, bottom_right_causal_mask(q_len, k_len, query.device), scaling)


def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """SDPA under a boolean mask (q, k), True where a query may attend a key: query (b, h, q, d), key/value
    (b, kv_heads, k, d). On CUDA the KV heads are repeated, since the memory-efficient kernel takes a mask but not
    grouped heads (PyTorch's math kernel would run); elsewhere they go as they are (`enable_gqa`): on a CPU the same
    values to the bit as repeated ones, and faster (benchmarks/grouped_heads.py: 512 queries over 8,192 keys, 55
    against 69 ms in float32)."""
    if query.is_cuda:
        n_rep = query.shape[1] // key.shape[1]
        return F.scaled_dot_product_attention(
            query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), attn_mask=mask, scale=scaling
        )
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


# PyTorch releases before CausalBias took grouped heads (enable_gqa) need them repeated; `_dispatch` is where the
# bias receives SDPA's arguments (none: take the heads repeated).
_BIAS_TAKES_GROUPS = "enable_gqa" in inspect.signature(getattr(CausalBias, "_dispatch", lambda: None)).parameters


def lower_right_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """Bottom-right causal SDPA without a mask tensor (CUDA): query (b, h, q, d), key/value (b, kv_heads, k, d).

    PyTorch's `causal_lower_right` bias runs the flash kernel in half precision, which takes grouped KV heads as
    they are, or else the memory-efficient kernel, which needs them repeated (float32); both are told the alignment
    instead of reading a (q, k) mask. Where neither applies, PyTorch builds the mask itself.
    """
    grouped = query.dtype in (torch.float16, torch.bfloat16) and _BIAS_TAKES_GROUPS
    if not grouped:
        n_rep = query.shape[1] // key.shape[1]
        key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    bias = causal_lower_right(query.shape[2], key.shape[2])
    extra = {"enable_gqa": True} if grouped else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scaling, **extra)


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
    SDPA under a boolean mask (`masked_attention`); with one, the grouped float32 path (`grouped_attention`).
    """
    q_len, k_len = query.shape[2], key.shape[2]
    offset = k_len - q_len  # query i sits at key column offset + i
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
        blocks.append(masked_attention(query[:, :, start:end], keys, values, allowed, scaling))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
