"""CritiPrefill: block-sparse prefill attention driven by segment-wise criticality.

Paper: Lv et al., "CritiPrefill: A Segment-wise Criticality-based Approach for Prefilling
Acceleration in LLMs" (arXiv 2409.12490), reference code github.com/66RING/CritiPrefill.
Use it as `kvsieve.run(..., attention=CritiPrefill())`: every multi-token forward pass
(a whole prompt, GemFilter's scoring pass, a chunk after a memory) then runs through it.

Queries are split into *segments* of `segment` tokens (counted from the first query), keys into
*blocks* of `block` tokens (counted from key 0). Queries are the last `q_len` of the `k_len` keys
(bottom-right causality), so query segment s starts at key position p_s = k_len - q_len + s*segment.

Algorithm 1 (criticality estimation, `criticality_scores`):
  representatives are the element-wise max and min over a segment's queries and over a block's
  keys; per query head the raw score of (segment, block) is
      max(mean(qmax.kmax, qmin.kmax), mean(qmax.kmin, qmin.kmin))
  (the reference code: the four products, unscaled, combined before one softmax; the
  paper's listing writes a softmax per product). Scores are averaged over the query heads of a
  GQA group (head h belongs to KV head h // n_rep, as in the reference code), so every selection
  is per KV head and shared by the group's query heads. Block-causal mask: segment s scores only
  its *candidate* blocks, the n_s = p_s // block blocks that end at or before p_s, i.e. lie wholly
  before the segment's first query; the softmax runs over those (computed in float32).
  Layer fusion (Algorithm 1, line 14): S = alpha * S_current + (1 - alpha) * S_previous, where
  S_previous is the previous layer's fused score; paper alpha = 0.25. (The reference code weights
  the current layer 0.75, i.e. alpha = 0.75 here.) Fusion starts at the layer after the first
  sparse layer; the first sparse layer (index `dense_layers`) uses its own scores.

Algorithm 2 (pruned attention, `select_blocks` + `sparse_attention`):
  each segment attends, per KV head, to its top budget // block candidate blocks plus its local
  window: keys from n_s * block (the start of the block holding p_s) to its last query, with
  bottom-right causal alignment. When k_len - q_len and the segment start are block-aligned (a
  whole prompt) the local window is exactly the segment's own tokens, as in the reference code.
  All sparse segments have the same shape, so they run as one batched SDPA call over (KV head,
  segment), with the query heads of a group folded into the query axis (K/V never repeated).

Dense fallbacks (kvsieve.attention.dense.dense_attention): the first `dense_layers` layers
(paper/code: layer 0), the last segment of every pass (paper/code), and every segment with no
more candidate blocks than the budget holds (it would select them all), so prompts shorter than
about budget + 2 * segment tokens are simply dense. Unlike the reference code, nothing crashes
on short prompts or small budgets.

Causality: no query ever attends a later key (`BlockSelection.mask()` is a subset of the bottom-right
causal mask). As in the paper, *which* earlier blocks a query attends depends on the max/min over
its whole segment, so a token can influence the selection of earlier queries of its own segment
(never of earlier segments). Generation is unaffected (the last segment is dense); per-position
teacher-forced logits (perplexity) carry this within-segment look-ahead.

`CritiPrefill` is frozen configuration; `begin()` returns the prefill attention of one request
(`CritiPrefillRun`), which keeps the previous layer's fused scores between the layer calls of
one forward pass. It starts afresh (no fusion) whenever a call's layer index is not above the
previous call's (a new forward pass), the shapes change (another prompt or chunk), or a layer
runs dense; `reset()` does it explicitly. Concurrent requests each use their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvsieve.attention.dense import bottom_right_causal_mask, dense_attention
from kvsieve.errors import KvsieveError
from kvsieve.kernels import block_sparse
from kvsieve.spec import component, option

if TYPE_CHECKING:
    from kvsieve.models import Architecture


@dataclass(frozen=True)
class BlockSelection:
    """What one layer's sparse attention attends to.

    Segments `first .. first + indices.shape[2] - 1` are sparse; earlier segments and the last
    one are dense. `indices` (b, kv_heads, m, budget // block) holds each sparse segment's
    selected block ids per KV head, ascending. `scores` (b, kv_heads, n_segments, n_blocks) are
    the (fused) criticality scores the selection was made from.
    """

    q_len: int
    k_len: int
    segment: int
    block: int
    first: int
    indices: torch.Tensor
    scores: torch.Tensor

    @property
    def num_sparse(self) -> int:
        return self.indices.shape[2]

    def allowed_blocks(self) -> torch.Tensor:
        """Boolean (b, kv_heads, segments, ceil(k_len / block)): which key blocks each query segment may attend,
        before causality. Dense segments: every block. A sparse segment s: its chosen blocks and the blocks of
        its local window (those from n_s on, n_s = p_s // block). This table is the kernel's block mask
        (`kvsieve.kernels.block_sparse`); the gathered path reads `indices` instead."""
        b, kv_heads, m, _ = self.indices.shape
        device = self.indices.device
        n_blocks = -(-self.k_len // self.block)
        table = torch.ones(b, kv_heads, -(-self.q_len // self.segment), n_blocks, dtype=torch.bool, device=device)
        if m:
            chosen = torch.zeros(b, kv_heads, m, n_blocks, dtype=torch.bool, device=device).scatter_(
                -1, self.indices, True
            )
            segments = range(self.first, self.first + m)
            window = ~candidate_mask(self.q_len, self.k_len, self.segment, self.block, segments, n_blocks, device)
            table[:, :, self.first : self.first + m] = chosen | window
        return table

    def mask(self) -> torch.Tensor:
        """Boolean (b, kv_heads, q_len, k_len): True where a query attends a key (`allowed_blocks` spread over the
        rows and keys, within the bottom-right causal mask). Built by scatter, independently of the gathered
        `sparse_attention`, so tests can compare the two."""
        rows = torch.arange(self.q_len, device=self.indices.device) // self.segment
        spread = self.allowed_blocks()[:, :, rows].repeat_interleave(self.block, dim=-1)[..., : self.k_len]
        return spread & bottom_right_causal_mask(self.q_len, self.k_len, self.indices.device)


def candidate_blocks(q_len: int, k_len: int, segment: int, block: int) -> list[int]:
    """n_s for every query segment: how many whole blocks lie before the segment's first query."""
    offset = k_len - q_len
    n_segments = -(-q_len // segment)
    return [(offset + s * segment) // block for s in range(n_segments)]


def candidate_mask(
    q_len: int, k_len: int, segment: int, block: int, segments: range, n_blocks: int, device: torch.device
) -> torch.Tensor:
    """Boolean (len(segments), n_blocks): block j is a candidate of segment s (j < n_s, `candidate_blocks`).

    Computed on `device` from the shapes (no list copied to it: on CUDA that copy waits for the stream).
    """
    firsts = (k_len - q_len) + torch.arange(segments.start, segments.stop, device=device) * segment
    return torch.arange(n_blocks, device=device) < torch.div(firsts, block, rounding_mode="floor")[:, None]


def sparse_segments(q_len: int, k_len: int, segment: int, block: int, budget: int, dense_prefix: int = 0) -> range:
    """Segments computed sparsely: not the last, more candidate blocks than the budget, and starting
    at or after position `dense_prefix` (the reference code's `threshold_len`)."""
    top = budget // block
    counts = candidate_blocks(q_len, k_len, segment, block)
    offset = k_len - q_len
    last = len(counts) - 1
    first = next((s for s in range(last) if counts[s] > top and offset + s * segment >= dense_prefix), last)
    return range(first, max(first, last))


def _representatives(x: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max and min over consecutive groups of `size` tokens (a short last group kept).

    x (b, heads, n, d) -> two (b, heads, ceil(n / size), d) float32 tensors.
    """
    b, heads, n, d = x.shape
    full = n // size * size
    groups = x[:, :, :full].reshape(b, heads, n // size, size, d)
    high, low = groups.amax(dim=3), groups.amin(dim=3)
    if full < n:
        high = torch.cat([high, x[:, :, full:].amax(dim=2, keepdim=True)], dim=2)
        low = torch.cat([low, x[:, :, full:].amin(dim=2, keepdim=True)], dim=2)
    return high.float(), low.float()


def criticality_scores(query: torch.Tensor, key: torch.Tensor, segment: int, block: int) -> torch.Tensor:
    """Algorithm 1 for one layer, without fusion: softmax over each segment's candidate blocks.

    query (b, h, q, d), key (b, kv_heads, k, d) -> float32 (b, kv_heads, n_segments, k // block):
    row s sums to 1 over blocks 0 .. n_s - 1 and is 0 elsewhere (all 0 when n_s = 0).
    """
    b, heads, q_len, d = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    n_rep = heads // kv_heads
    n_blocks = k_len // block
    q_max, q_min = _representatives(query, segment)  # (b, h, n_seg, d)
    k_max, k_min = _representatives(key[:, :, : n_blocks * block], block)  # (b, kv, n_blk, d)
    n_segments = q_max.shape[2]
    # Query head h = g * n_rep + r reads KV head g: fold each group's reps into one matrix.
    reps = torch.cat([q_max, q_min], dim=2).reshape(b, kv_heads, n_rep * 2 * n_segments, d)
    shape = (b, kv_heads, n_rep, 2, n_segments, n_blocks)
    with_kmax = (reps @ k_max.transpose(-1, -2)).reshape(shape).mean(dim=3)  # mean(qmax.kmax, qmin.kmax)
    with_kmin = (reps @ k_min.transpose(-1, -2)).reshape(shape).mean(dim=3)  # mean(qmax.kmin, qmin.kmin)
    raw = torch.maximum(with_kmax, with_kmin).mean(dim=2)  # (b, kv, n_seg, n_blk), group mean
    valid = candidate_mask(q_len, k_len, segment, block, range(n_segments), n_blocks, raw.device)
    probs = torch.softmax(raw.masked_fill(~valid, float("-inf")), dim=-1)
    return probs.nan_to_num(0.0)  # segments with no candidate block: all -inf -> NaN -> 0


def select_blocks(scores: torch.Tensor, candidates: torch.Tensor, top: int) -> torch.Tensor:
    """Algorithm 2, line 8: the `top` best candidate blocks of each row, ascending block ids.

    scores (..., n_segments, n_blocks); candidates (n_segments, n_blocks) bool (`candidate_mask`): other blocks are
    never chosen, even when scores tie at 0. Every row needs at least `top` candidates: `sparse_segments` lists only
    such segments (checking it here would read the device back to the host in every layer).
    """
    masked = scores.masked_fill(~candidates, float("-inf"))
    return torch.topk(masked, top, dim=-1).indices.sort(dim=-1).values


def sparse_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, selection: BlockSelection, scaling: float | None
) -> torch.Tensor:
    """Algorithm 2: dense prefix segments, batched sparse segments, dense last segment.

    query (b, h, q, d); key/value (b, kv_heads, k, d) -> (b, h, q, d). Where the kernels seam serves it (CUDA,
    `kvsieve.kernels.block_sparse.serves`) the whole pass is one FlexAttention kernel over `allowed_blocks`;
    elsewhere the sparse segments' keys are gathered and run as one batched SDPA call, between two dense calls.
    """
    b, heads, q_len, d = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    n_rep = heads // kv_heads
    seg, blk, m = selection.segment, selection.block, selection.num_sparse
    offset = k_len - q_len
    lo, hi = selection.first * seg, (selection.first + m) * seg  # query rows of the sparse segments
    if m == 0:
        return dense_attention(query, key, value, scaling)
    if block_sparse.serves(query, seg):
        fused = block_sparse.segment_block_attention(query, key, value, selection.allowed_blocks(), seg, blk, scaling)
        if fused is not None:
            return fused
    out = query.new_empty(b, heads, q_len, d)
    if lo > 0:
        out[:, :, :lo] = dense_attention(
            query[:, :, :lo], key[:, :, : offset + lo], value[:, :, : offset + lo], scaling
        )
    device = query.device
    r = offset % blk  # keys of the block holding p_s that precede the segment (0 when aligned)
    top = selection.indices.shape[-1]
    # Absolute key positions per (b, kv head, segment): the selected blocks, then the local window.
    chosen = (selection.indices[..., None] * blk + torch.arange(blk, device=device)).flatten(-2)
    starts = offset + torch.arange(selection.first, selection.first + m, device=device) * seg - r
    local = (starts[:, None] + torch.arange(r + seg, device=device)).expand(b, kv_heads, m, r + seg)
    positions = torch.cat([chosen, local], dim=-1)  # (b, kv, m, top * blk + r + seg)
    bi = torch.arange(b, device=device)[:, None, None, None]
    gi = torch.arange(kv_heads, device=device)[None, :, None, None]
    n_keys = positions.shape[-1]
    k_sel = key[bi, gi, positions].reshape(b, kv_heads * m, n_keys, d)
    v_sel = value[bi, gi, positions].reshape(b, kv_heads * m, n_keys, d)
    # Fold each group's query heads into the query axis, so K/V are never repeated:
    # (b, h, m * seg, d) -> (b, kv, n_rep, m, seg, d) -> (b, kv * m, n_rep * seg, d)
    q_sel = query[:, :, lo:hi].reshape(b, kv_heads, n_rep, m, seg, d).transpose(2, 3)
    q_sel = q_sel.reshape(b, kv_heads * m, n_rep * seg, d)
    # Every selected key precedes the segment; the local window is bottom-right causal.
    window = bottom_right_causal_mask(seg, r + seg, device)
    mask = torch.cat([torch.ones(seg, top * blk, dtype=torch.bool, device=device), window], dim=1)
    sparse = F.scaled_dot_product_attention(q_sel, k_sel, v_sel, attn_mask=mask.repeat(n_rep, 1), scale=scaling)
    target = out[:, :, lo:hi].view(b, kv_heads, n_rep, m, seg, d)
    target.copy_(sparse.view(b, kv_heads, m, n_rep, seg, d).transpose(2, 3))
    if hi < q_len:
        out[:, :, hi:] = dense_attention(query[:, :, hi:], key, value, scaling)
    return out


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KvsieveError(f"CritiPrefill {name} must be a positive whole number of tokens; got {value!r}.")


@component("critiprefill", "attention")
@dataclass(frozen=True)
class CritiPrefill:
    """CritiPrefill options; `begin()` gives the prefill attention of one request.

    segment: query segment size (paper 512); block: KV block size (32), must divide segment;
    budget: tokens of earlier KV blocks each segment attends besides its own (paper 1024, code
    2048), rounded down to whole blocks; alpha: weight of the current layer's scores in the
    layer fusion S = alpha * S_cur + (1 - alpha) * S_prev (paper 0.25; 1 turns fusion off);
    dense_layers: the first layers computed densely (paper code: 1).
    """

    segment: int = option(512, "query segment size in tokens (paper 512)")
    block: int = option(32, "KV block size in tokens, divides segment (paper 32)")
    budget: int = option(1024, "earlier KV tokens each segment attends besides its own (paper 1024, code 2048)")
    alpha: float = option(0.25, "layer fusion: weight of the current layer's scores (paper 0.25, code 0.75)")
    dense_layers: int = option(1, "first layers computed densely (paper code: 1)")
    dense_prefix: int = option(0, "query segments starting before this position stay dense (code: 4096)")

    def __post_init__(self) -> None:
        _check_size("segment", self.segment)
        _check_size("block", self.block)
        _check_size("budget", self.budget)
        if self.segment % self.block:
            raise KvsieveError(
                f"CritiPrefill segment ({self.segment}) must be a multiple of block ({self.block}), "
                "e.g. segment 512 with block 32."
            )
        if self.budget < self.block:
            raise KvsieveError(
                f"CritiPrefill budget ({self.budget}) must hold at least one block ({self.block} tokens); "
                "raise the budget or lower the block size."
            )
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 <= self.alpha <= 1:
            raise KvsieveError(
                f"CritiPrefill alpha must be between 0 and 1 (weight of the current layer); got {self.alpha!r}."
            )
        if isinstance(self.dense_layers, bool) or not isinstance(self.dense_layers, int) or self.dense_layers < 0:
            raise KvsieveError(f"CritiPrefill dense_layers must be a whole number >= 0; got {self.dense_layers!r}.")
        if isinstance(self.dense_prefix, bool) or not isinstance(self.dense_prefix, int) or self.dense_prefix < 0:
            raise KvsieveError(
                f"CritiPrefill dense_prefix must be a position >= 0 (reference code 4096); got {self.dense_prefix!r}."
            )

    @property
    def name(self) -> str:
        return self.tag

    def check_model(self, arch: Architecture) -> None:
        """Refuse settings this model cannot have (called by `kvsieve.engine.pipeline.prefill`)."""
        if self.dense_layers > arch.num_layers:
            raise KvsieveError(
                f"CritiPrefill dense_layers={self.dense_layers}, but this model has {arch.num_layers} layers; "
                f"give at most {arch.num_layers} (all dense)."
            )

    def begin(self) -> CritiPrefillRun:
        """A fresh prefill attention for one request: `attend(layer, query, key, value, scaling) -> (b, h, q, d)`."""
        return CritiPrefillRun(self)


@dataclass
class CritiPrefillRun:
    """The prefill attention of one request: keeps the previous layer's fused scores between layer calls."""

    config: CritiPrefill
    layer: int | None = None
    scores: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget the previous layer's scores (the next sparse layer starts without fusion)."""
        self.layer, self.scores = None, None

    def select(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> BlockSelection | None:
        """Algorithm 1 with layer fusion, then the top blocks; None where the layer runs dense."""
        c = self.config
        b, heads, q_len, _ = query.shape
        kv_heads, k_len = key.shape[1], key.shape[2]
        if heads % kv_heads or key.shape[0] != b or q_len > k_len:
            raise KvsieveError(
                f"CritiPrefill needs query (b, h, q, d) and key (b, kv_heads, k, d) with h a multiple of "
                f"kv_heads and q <= k; got {tuple(query.shape)} and {tuple(key.shape)}."
            )
        segments = sparse_segments(q_len, k_len, c.segment, c.block, c.budget, c.dense_prefix)
        if layer < c.dense_layers or len(segments) == 0:
            self.reset()
            return None
        scores = criticality_scores(query, key, c.segment, c.block)
        previous = self.scores
        if (
            previous is not None
            and self.layer is not None
            and c.dense_layers < layer
            and self.layer < layer
            and previous.shape == scores.shape
            and previous.device == scores.device
        ):
            scores = c.alpha * scores + (1 - c.alpha) * previous
        self.layer, self.scores = layer, scores
        candidates = candidate_mask(q_len, k_len, c.segment, c.block, segments, scores.shape[-1], scores.device)
        rows = scores[:, :, segments.start : segments.stop]
        indices = select_blocks(rows, candidates, c.budget // c.block)
        return BlockSelection(q_len, k_len, c.segment, c.block, segments.start, indices, scores)

    def __call__(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        selection = self.select(layer, query, key)
        if selection is None:
            return dense_attention(query, key, value, scaling)
        return sparse_attention(query, key, value, selection, scaling)


__all__ = [
    "CritiPrefill",
    "CritiPrefillRun",
    "BlockSelection",
    "candidate_blocks",
    "candidate_mask",
    "criticality_scores",
    "select_blocks",
    "sparse_attention",
    "sparse_segments",
]
