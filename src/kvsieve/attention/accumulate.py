"""Accumulated attention (A2SF eq. 5; H2O's column sums at alpha = 1) and each key's largest attention (KVzip's
score), computed inside the attention.

H2O and A2SF score each prompt key by the attention the prompt's queries pay it,
A_k = sum_q alpha^(last - q) S_{q,k}. Computed after the prefill this is a second pass over the
prompt (QK^T, softmax, column sums) that costs more than the attention itself. Here it is a
by-product of the attention: the queries are processed in blocks of rows, each block's softmax
rows give both the attention output (P V) and the key scores (w^T P), and only the causal part of
each block (keys up to the block's last query) is computed. Memory: one (heads x rows x keys)
block at a time, never an n x n matrix.

One query is the one-row case (a feed's pass of one token): its attention row is the scores. Decoding steps
hand their rows to the eviction through `AttentionRows` instead, a padded batch's included (eq. 6).

Queries whose weight alpha^(last - q) underflows to 0 in float32 (A2SF's small alpha: 0.2^64 == 0)
add nothing to the scores; their rows go through plain SDPA, and only the trailing rows are
blocked. `accumulated_attention` in `kvsieve.compress.scorers` is the plain reference these
scores are tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvsieve.attention.dense import dense_attention
from kvsieve.models import logit_scale

BLOCK_ELEMENTS = 1 << 23  # softmax entries per row block (32 MB in float32): bounds the scoring memory
MAX_ROWS = 64  # query rows per block: 64 measured fastest on a 2-core CPU at 2K and 8K keys (32-256 tried)


def accumulation_weights(alpha: float, q_len: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
    """(alpha^(q_len - 1 - q) for q < q_len in float32 on `device`, the first query whose weight is not 0).

    For small alpha, alpha^k falls below the smallest float32 (2^-149) after a few dozen steps: those queries weigh
    exactly 0 here, whatever the device's `pow` rounds them to, and contribute nothing. Which ones is decided from
    alpha and q_len alone, in Python (`weighted_queries`), and the weights are made on the device: nothing is copied
    or read between the host and the device inside a layer.
    """
    if q_len == 1:  # one query (a one-token pass)
        return torch.ones(1, device=device), 0
    exponents = torch.arange(q_len - 1, -1, -1, dtype=torch.float32, device=device)
    weights = torch.pow(torch.full((), float(alpha), dtype=torch.float32, device=device), exponents)  # 0 ** 0 == 1
    first = q_len - weighted_queries(alpha, q_len)
    weights[:first].zero_()
    return weights, first


def weighted_queries(alpha: float, q_len: int) -> int:
    """How many of the last `q_len` queries weigh at least the smallest float32, 2^-149: alpha^k >= 2^-149."""
    if alpha >= 1:
        return q_len
    if alpha <= 0:
        return 1  # 0 ** 0 == 1, every other weight 0
    return min(q_len, math.floor(149 * math.log(2) / -math.log(alpha)) + 1)


@dataclass(frozen=True)
class AccumulatedScores:
    """An observer asking for every layer's accumulated attention (kv_heads, n) of its keys.

    Passed among the observers of `attention_hooks`. Where kvsieve's attention computes a dense
    pass it delivers the scores from that pass: `receive(layer, scores, queries)`, `queries` being
    how many queries were summed; anywhere else (another prefill kernel, batched padding) it is
    called like any observer and computes them itself with `reference(query, key, scaling)` (the
    second pass).
    """

    alpha: float
    receive: Callable[[int, torch.Tensor, int], None]
    reference: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        self.receive(layer, self.reference(query[0], key[0], logit_scale(query.shape[-1])), query.shape[2])


@dataclass(frozen=True)
class AttentionMaxima:
    """An observer asking for every layer's largest attention per key: (kv_heads, n) float32, the most any of the
    pass's queries (and the KV head's query heads) pays each key (KVzip's score). Where kvsieve's attention computes a
    dense pass it delivers them from that pass's own softmax rows (`accumulating_attention`), so the keys' logits are
    computed once; anywhere else it is called like any observer and computes them with `reference(query, key,
    scaling)` (query (h, q, d), key (kv_heads, n, d)).

    `within` (a bool mask over the entries cached before the pass): the softmax the maxima are taken from runs over
    those entries and the pass's own keys only (KVzip's sinks and repeated chunk), the others scoring 0; None: over
    every key the query sees."""

    receive: Callable[[int, torch.Tensor], None]
    reference: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    within: torch.Tensor | None = None

    def columns(self, n: int, q: int) -> torch.Tensor | None:
        """The (n,) bool mask of the keys of a pass of `q` queries over `n` keys (its own the last q) that the maxima's
        softmax runs over; None: all. A layer that holds fewer cached entries (a sliding window's latest) reads the
        mask's last ones."""
        if self.within is None:
            return None
        cached = n - q
        if not 0 <= cached <= self.within.shape[0]:
            raise ValueError(
                f"A pass of {q} queries over {n} keys does not follow the {self.within.shape[0]} entries its maxima "
                "are normalised within."
            )
        own = torch.ones(q, dtype=torch.bool, device=self.within.device)
        return torch.cat([self.within[self.within.shape[0] - cached :], own])

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        scale = logit_scale(query.shape[-1])
        keep = self.columns(key.shape[2], query.shape[2])
        if keep is None:
            self.receive(layer, self.reference(query[0], key[0], scale))
            return
        keep = keep.to(key.device)
        scores = torch.zeros(key.shape[1], key.shape[2], dtype=torch.float32, device=key.device)
        scores[:, keep] = self.reference(query[0], key[0][:, keep], scale)  # the pass's own keys stay its last
        self.receive(layer, scores)


@dataclass(frozen=True)
class PassReader:
    """An observer that reads a layer's values besides its query and keys: `receive(layer, query, key, value)`, query
    (b, h, q, d) and key (b, kv_heads, n, d) post-RoPE, value (b, kv_heads, n, d). Passed among the observers of
    `attention_hooks`, like a plain observer; prompt scorers that read values (Expected Attention's ||v||) get them
    here (`kvsieve.compress.stages.score_observers`)."""

    receive: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class AttentionRows:
    """An observer asking for a decoding step's attention: `receive(layer, probs, kv_heads)` with probs (b, h, n)
    float32, each row's one query over its keys (0 past the row's length in a padded batch), and the layer's KV
    heads (query head h reads KV head h // (h / kv_heads)). kvsieve's attention hands over
    the probabilities it attends with: from the CPU kernel's own pass where it serves the step
    (`kernel_attention_probs`, the keys read once for both), else from `grouped_probs`. Per-step eviction scores
    that read only the new query's attention (H2O, A2SF, TOVA: `Policy.step_reads_attention`) take them here
    instead of computing them again. Decoding steps only: a forward with more than one query per row refuses it."""

    receive: Callable[[int, torch.Tensor, int], None]


def accumulating_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    alphas: Sequence[float],
    maxima: bool = False,
    within: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """Causal attention (1, h, q, d) of the last q of n positions, A2SF eq. 5's scores per alpha and, with `maxima`,
    each key's largest attention over every query and the KV head's query heads (`AttentionMaxima`; else None), from
    the softmax over the keys of the (n,) bool mask `within` where given (`AttentionMaxima.columns`), else over all.

    query (1, h, q, d), key/value (1, kv_heads, n, d), bottom-right causal. Scores are float32
    (kv_heads, n), summed over each KV head's query heads (h // n_rep). Softmax in float32 or
    wider (float64 stays float64), the output in the value dtype.
    """
    _, heads, q_len, dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    n_rep = heads // kv_heads
    scale = logit_scale(dim, scaling)
    device = query.device
    compute = torch.promote_types(query.dtype, torch.float32)
    if q_len == 1:  # one query: its attention row is every alpha's score (weight alpha^0 = 1)
        grouped_row = query[0].reshape(kv_heads, n_rep, dim).to(compute) * scale
        probs = torch.bmm(grouped_row, key[0].transpose(1, 2).to(compute)).softmax(-1)  # (g, n_rep, n)
        out = torch.bmm(probs, value[0].to(compute)).view(1, heads, 1, dim).to(query.dtype)
        row = probs.sum(1).float()
        rows = [row.clone() for _ in alphas]
        return out, rows, _highest(probs, within).float() if maxima else None
    plans = [accumulation_weights(alpha, q_len, device) for alpha in alphas]
    first = 0 if maxima else min(start for _, start in plans)  # the maxima read every row
    totals = [torch.zeros(kv_heads, n, dtype=compute, device=device) for _ in alphas]
    best = torch.zeros(kv_heads, n, dtype=compute, device=device) if maxima else None
    out = torch.empty_like(query)
    if first > 0:  # rows that no score needs: plain SDPA over the keys they see
        seen = n - q_len + first
        out[:, :, :first] = dense_attention(query[:, :, :first], key[:, :, :seen], value[:, :, :seen], scaling)
    weights = [w.to(compute) for w, _ in plans]
    grouped = query[0].reshape(kv_heads, n_rep, q_len, dim)
    keys_t = key[0].transpose(1, 2).to(compute)  # (g, d, n)
    values = value[0].to(compute)  # (g, n, d)
    rows = max(1, min(MAX_ROWS, BLOCK_ELEMENTS // max(1, heads * n)))
    for start in range(first, q_len, rows):
        stop = min(start + rows, q_len)
        block = stop - start
        visible = n - q_len + stop  # keys beyond the block's last query are masked anyway
        rows_q = grouped[:, :, start:stop].reshape(kv_heads, n_rep * block, dim).to(compute) * scale
        logits = torch.bmm(rows_q, keys_t[..., :visible]).view(kv_heads, n_rep, block, visible)
        if block > 1:  # causal: the diagonal block only
            future = torch.ones(block, block, dtype=torch.bool, device=device).triu_(1)
            logits[..., visible - block :].masked_fill_(future, float("-inf"))
        probs = logits.softmax(-1).view(kv_heads, n_rep * block, visible)
        rows_out = torch.bmm(probs, values[:, :visible]).view(kv_heads, n_rep, block, dim)
        out[0, :, start:stop] = rows_out.reshape(heads, block, dim).to(out.dtype)
        for total, w in zip(totals, weights, strict=True):
            row_weights = w[start:stop].repeat(n_rep).expand(kv_heads, 1, n_rep * block)
            total[:, :visible] += torch.bmm(row_weights, probs)[:, 0]
        if best is not None:
            allowed = within[:visible] if within is not None else None
            torch.maximum(best[:, :visible], _highest(probs, allowed), out=best[:, :visible])
    return out, [total.float() for total in totals], best.float() if best is not None else None


def _highest(probs: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Each key's largest probability over the rows (dim 1) of (g, rows, k) `probs`, a softmax over k keys; where
    `allowed` (k,) is given, of the softmax over those keys alone, 0 for the others (every row holds its own key,
    always allowed).

    The softmax over fewer keys is the whole one divided by their share of each row, so no second exponential (nor
    a read of the device) is needed. Its one limit: a row whose allowed keys all lie some 87 logits below another key
    (their share underflows float32) adds nothing, where the softmax over them alone would give them its weights."""
    if allowed is None:
        return probs.amax(1)
    allowed = allowed.to(probs.device)
    share = torch.matmul(probs, allowed.to(probs.dtype)).unsqueeze(-1)  # (g, rows, 1)
    return (probs / share.clamp_min(torch.finfo(probs.dtype).tiny)).amax(1).masked_fill_(~allowed, 0.0)
