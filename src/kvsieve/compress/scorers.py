"""Token-importance scorers, shared by every stage that prunes KV.

Each scorer returns one score per KV head and token, shape (kv_heads, n); higher = keep. With
grouped-query attention, query head h belongs to KV head h // n_rep and scores are summed over a
KV head's query heads, so K/V are never repeated. Attention is computed in query chunks: memory
stays O(chunk x n) per head, never an n x n matrix at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvsieve.attention.accumulate import accumulation_weights
from kvsieve.attention.dense import bottom_right_causal_mask
from kvsieve.errors import KvsieveError
from kvsieve.kv.cache import newest_first


def attention_probs(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention (h, q, n) in fp32 of queries (h, q, d) that are the last q of n positions.

    key is (kv_heads, n, d), read by query head h through KV head h // n_rep.
    """
    heads, q_len, dim = query.shape
    kv_heads, n, _ = key.shape
    grouped = query.float().reshape(kv_heads, heads // kv_heads * q_len, dim)  # rows (n_rep, q) per KV head
    logits = torch.bmm(grouped, key.float().transpose(1, 2)).view(heads, q_len, n) * scaling
    if q_len > 1:
        logits = logits.masked_fill(~bottom_right_causal_mask(q_len, n, query.device), float("-inf"))
    return logits.softmax(-1)


def per_kv_head(scores: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum (h, ...) query-head scores into (kv_heads, ...): query head h -> KV head h // n_rep."""
    return scores.view(kv_heads, scores.shape[0] // kv_heads, *scores.shape[1:]).sum(1)


def check_pool_size(size: int) -> None:
    """Pooling sizes are odd (so pooling keeps every position centred), at least 1."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or size % 2 == 0:
        raise KvsieveError(f"A pooling size (pool_size) must be an odd whole number >= 1, got {size!r}.")


def pool_scores(scores: torch.Tensor, size: int, pool: str = "avg") -> torch.Tensor:
    """Pool (kv_heads, n) scores along the tokens (over `size` tokens, stride 1, zero padding), so a token
    scores with its neighbours and a kept span stays whole; size 1 returns them unchanged."""
    if size == 1:
        return scores
    pooling = F.avg_pool1d if pool == "avg" else F.max_pool1d
    return pooling(scores[:, None], kernel_size=size, stride=1, padding=size // 2)[:, 0]


def window_attention(
    query: torch.Tensor, key: torch.Tensor, scaling: float, window: int, pool_size: int = 5, pool: str = "avg"
) -> torch.Tensor:
    """SnapKV: attention the last `window` queries pay to each earlier token, pooled (over `pool_size`, stride 1).

    query (h, q, d) with q >= window (only the last `window` rows are used); key (kv_heads, n, d).
    The window's own tokens get +inf: SnapKV always keeps them.
    """
    n = key.shape[1]
    window = min(window, n, query.shape[1])
    probs = attention_probs(query[:, -window:], key, scaling)  # (h, w, n)
    votes = per_kv_head(probs.sum(1), key.shape[0])[:, : n - window]  # (g, n - w)
    if n > window:
        votes = pool_scores(votes, pool_size, pool)
    return torch.cat([votes, votes.new_full((key.shape[0], window), float("inf"))], dim=1)


def accumulated_attention(
    query: torch.Tensor, key: torch.Tensor, scaling: float, alpha: float, chunk: int = 512
) -> torch.Tensor:
    """A2SF eq. 5: A_k = sum_q alpha^(last - q) S_{q,k}, over the given queries, per KV head.

    alpha = 1 is H2O's accumulated attention; alpha = 0 keeps only the last query's attention.
    query (h, q, d) are the last q of n key positions; key (kv_heads, n, d). Returns (kv_heads, n).
    This second pass is the reference: inside kvsieve's dense prefill the same scores come out of
    the attention itself (`kvsieve.attention.accumulate`), and where they cannot (another prefill
    kernel, a decoding step) this computes them. Softmax normalisation is folded into the query
    weights (w_q / row sum), which halves the passes over each (chunk x n) block.
    """
    heads, q_len, dim = query.shape
    kv_heads, n, _ = key.shape
    n_rep = heads // kv_heads
    total = torch.zeros(kv_heads, n_rep, n, dtype=torch.float32, device=query.device)
    weights, first = accumulation_weights(alpha, q_len, query.device)  # queries before `first` weigh exactly 0
    grouped = query.float().view(kv_heads, n_rep, q_len, dim)
    keys_t = key.float().transpose(1, 2)[:, None]  # (g, 1, d, n)
    for start in range(first, q_len, chunk):
        stop = min(start + chunk, q_len)
        rows = stop - start
        # Keys beyond the chunk's last query are masked anyway; slice them off.
        visible = n - q_len + stop
        logits = torch.matmul(grouped[:, :, start:stop] * scaling, keys_t[..., :visible])  # (g, r, c, visible)
        future = torch.ones(rows, rows, dtype=torch.bool, device=query.device).triu_(1)
        logits[..., visible - rows :].masked_fill_(future, float("-inf"))  # causal: the diagonal block only
        logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        row_weights = weights[start:stop] / logits.sum(-1)  # (g, r, c): alpha^k / softmax denominator
        total[..., :visible] += torch.einsum("grcn,grc->grn", logits, row_weights)
    return total.sum(1)


def visible_counts(q_len: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """How many of the last `q_len` of `n` positions see each key (causal), as float32 (n,).

    Keys before the queries are seen by all q_len; the query block's own key at offset j by
    q_len - j (itself and the queries after it).
    """
    counts = torch.full((n,), float(q_len), dtype=torch.float32, device=device)
    counts[n - q_len :] -= torch.arange(q_len, dtype=torch.float32, device=device)
    return counts


def visible_mean(sums: torch.Tensor, q_len: int, pool_size: int = 5, sinks: int = 0) -> torch.Tensor:
    """ConvPruner's score from column sums (kv_heads, n) of the attention of the last `q_len` queries.

    The sums are average-pooled over positions >= `sinks` (`pool_size`, stride 1, zero padding; the
    first `sinks` keys are left out, so their scores never mix with their neighbours'), then divided
    by the number of queries that can see each key (`visible_counts`): pooling before the division,
    in the authors' order. Float32.
    """
    sums = sums.float()
    n = sums.shape[1]
    first = min(sinks, n)
    if n > first:
        sums = torch.cat([sums[:, :first], pool_scores(sums[:, first:], pool_size)], dim=1)
    return sums / visible_counts(q_len, n, sums.device)


def keep_indices(scores: torch.Tensor, budget: int, sinks: int = 0, recent: int = 0) -> torch.Tensor:
    """Per KV head, the `budget` best positions of (kv_heads, n) scores, sorted ascending.

    The first `sinks` and last `recent` positions are always kept (StreamingLLM's sinks, H2O's
    recent half, SnapKV's window); they count against the budget. Among equal scores the newest
    positions are kept (KNorm's scores tie for repeated tokens in the first layer, where RoPE
    leaves key norms unchanged), so the choice never depends on how topk orders ties.
    """
    kv_heads, n = scores.shape
    if budget >= n:
        return torch.arange(n, device=scores.device).expand(kv_heads, n)
    position = torch.arange(n, device=scores.device)
    protected = (position < sinks) | (position >= n - recent) if recent > 0 else position < sinks
    ranked = scores.float().masked_fill(protected, float("inf"))  # not a mask index, which reads its size back
    age = position.expand(kv_heads, n)
    return torch.topk(newest_first(ranked, age, budget), budget, dim=1).indices.sort(dim=1).values
