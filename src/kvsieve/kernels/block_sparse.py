"""A prefill's block-sparse attention as one fused kernel: PyTorch's FlexAttention driven by a BlockMask.

The pattern is segment-by-block: queries are the last q of k keys (query row i sits at key position k - q + i),
grouped into segments of `segment` rows counted from the first query; keys are grouped into blocks of `block`
counted from key 0. Row i attends key j where j <= k - q + i (bottom-right causal) and
`allowed[b, g, i // segment, j // block]`, g being the row's KV head (query head h reads KV head h // n_rep).
CritiPrefill's selection is such a table (`kvsieve.attention.critiprefill.BlockSelection.allowed_blocks`: its dense
segments all True, each sparse segment its chosen blocks and its local window).

FlexAttention computes only the tiles the BlockMask lists: a tile of q_tile rows by kv_tile keys is *full* where every
query of it may attend every key (no mask evaluated) and *partial* where some may (the table and causality evaluated
per element); tiles with nothing to attend are skipped. No key or value is gathered or copied, the query heads read
their KV head in place (`enable_gqa`), and the BlockMask is built from the table with tensor operators only (no read
back to the host), so a layer's attention is one kernel launch plus a few small ones for the mask.

Where it runs (`serves`): on CUDA, with the switch `flex_attention` on (`kvsieve.fast_paths`), for segments that are
whole multiples of FLEX_TILE (the kernel's tile; CritiPrefill's default segment 512 with block 32 gives 128 x 128
tiles). Elsewhere CritiPrefill gathers each segment's keys and calls SDPA (`kvsieve.attention.critiprefill`): on the
CPU FlexAttention's compiled kernel measured 3.6x slower than that at 8K (docs/PERFORMANCE.md, "On a GPU"), and its
uncompiled form builds the whole score matrix. Tests run this module on the CPU, uncompiled and compiled, against the
gathered path.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvsieve import fast_paths
from kvsieve.compiled import Compiled

FLEX_TILE = 128  # FlexAttention's default tile: its kernels' row and key blocks divide it


def serves(query: torch.Tensor, segment: int) -> bool:
    """Whether the fused kernel runs this attention: on CUDA, switched on, segments whole multiples of FLEX_TILE."""
    return fast_paths.current().flex_attention and query.device.type == "cuda" and segment % FLEX_TILE == 0


def tiles(segment: int, block: int, tile: int = FLEX_TILE) -> tuple[int, int]:
    """(q_tile, kv_tile) of the BlockMask: the largest divisor of `segment` up to `tile` (a row tile never spans two
    segments) and the least multiple of `block` that `tile` divides (a key tile holds whole blocks)."""
    return math.gcd(segment, tile), math.lcm(block, tile)


def padded_table(allowed: torch.Tensor, q_len: int, k_len: int, segment: int, block: int, q_tile: int, kv_tile: int):
    """`allowed` (b, kv, segments, blocks) widened to every segment and block a tile reaches, the new blocks True
    (they lie after every segment's first query, in its local window), so mask lookups never leave the table."""
    segments = -(-(-(-q_len // q_tile) * q_tile) // segment)
    blocks = -(-k_len // kv_tile) * kv_tile // block
    b, kv_heads, have_segments, have_blocks = allowed.shape
    table = allowed.new_ones(b, kv_heads, max(segments, have_segments), max(blocks, have_blocks))
    table[:, :, :have_segments, :have_blocks] = allowed
    return table


def block_mask(
    allowed: torch.Tensor, q_len: int, k_len: int, heads: int, segment: int, block: int, tile: int = FLEX_TILE
) -> BlockMask:
    """The BlockMask of the segment-by-block pattern (module docstring) for `heads` query heads.

    Tile (t, j) is full where causality lets every row of the tile see every key of it (its last key at or before
    the tile's first query) and every block of it is allowed for the tile's segment; partial where some row may see
    some key and some block is allowed; the rest are skipped. Per row tile, the listed key tiles come first
    (a stable sort of the flags), as FlexAttention reads them.
    """
    q_tile, kv_tile = tiles(segment, block, tile)
    table = padded_table(allowed, q_len, k_len, segment, block, q_tile, kv_tile)
    b, kv_heads = table.shape[:2]
    n_rep = heads // kv_heads
    device = table.device
    n_q, n_kv = -(-q_len // q_tile), -(-k_len // kv_tile)
    offset = k_len - q_len
    row_tiles = torch.arange(n_q, device=device)
    rows = table[:, :, row_tiles * q_tile // segment, : n_kv * kv_tile // block]  # (b, kv, n_q, blocks)
    per_tile = rows.reshape(b, kv_heads, n_q, n_kv, kv_tile // block)
    every, some = per_tile.all(dim=-1), per_tile.any(dim=-1)
    first_query = offset + row_tiles * q_tile  # key position of each row tile's first and last query
    last_query = offset + torch.clamp((row_tiles + 1) * q_tile, max=q_len) - 1
    key_tiles = torch.arange(n_kv, device=device)
    sees_all = (key_tiles + 1) * kv_tile - 1 <= first_query[:, None]  # (n_q, n_kv)
    sees_some = key_tiles * kv_tile <= last_query[:, None]
    full = (every & sees_all).repeat_interleave(n_rep, dim=1)
    partial = (some & sees_some & ~(every & sees_all)).repeat_interleave(n_rep, dim=1)

    def listed(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort((~flags).to(torch.uint8), dim=-1, stable=True)
        return flags.sum(dim=-1, dtype=torch.int32), order.to(torch.int32)

    shift = torch.tensor(offset, device=device)  # a tensor, so a compiled kernel is not specialised to one offset

    def mask_mod(batch: torch.Tensor, head: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx + shift) & table[batch, head // n_rep, q_idx // segment, kv_idx // block]

    partial_count, partial_order = listed(partial)
    full_count, full_order = listed(full)
    return BlockMask.from_kv_blocks(
        partial_count,
        partial_order,
        full_count,
        full_order,
        BLOCK_SIZE=(q_tile, kv_tile),
        mask_mod=mask_mod,
        **_supported(seq_lengths=(q_len, k_len), compute_q_blocks=False),
    )


_FROM_KV_BLOCKS = set(inspect.signature(BlockMask.from_kv_blocks).parameters)


def _supported(**keywords: object) -> dict[str, object]:
    """The keywords this PyTorch's `BlockMask.from_kv_blocks` takes: the sequence lengths and skipping the backward
    pass's indices came in later releases than the oldest torch kvsieve supports, which works out both itself."""
    return {name: value for name, value in keywords.items() if name in _FROM_KV_BLOCKS}


def segment_block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    segment: int,
    block: int,
    scaling: float | None,
    compiled: bool = True,
    tile: int = FLEX_TILE,
) -> torch.Tensor | None:
    """Attention of the segment-by-block pattern through FlexAttention: query (b, h, q, d), key/value
    (b, kv_heads, k, d), `allowed` (b, kv_heads, segments, blocks) bool; returns (b, h, q, d), or None where the
    kernel could not be compiled (`kvsieve.compiled` says so once; the caller runs its own path).

    `compiled` runs FlexAttention's fused kernel, compiled at its first use: on CUDA with dynamic shapes, so a new
    prompt length does not compile it again; on the CPU (tests only) once per shape, as PyTorch 2.13's CPU kernel
    fails to build with dynamic shapes. Uncompiled, PyTorch evaluates the same mask over the whole score matrix.
    """
    mask = block_mask(allowed, query.shape[2], key.shape[2], query.shape[1], segment, block, tile)
    if not compiled:
        return _flex(query, key, value, mask, scaling)
    return _FUSED[query.device.type == "cuda"](query, key, value, mask, scaling)


def _flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask, scaling: float | None
) -> torch.Tensor:
    return flex_attention(query, key, value, block_mask=mask, scale=scaling, enable_gqa=True)


_FUSED = {dynamic: Compiled("block-sparse attention", _flex, dynamic=dynamic) for dynamic in (True, False)}
