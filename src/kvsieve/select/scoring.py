"""GemFilter's scoring (arXiv 2409.17422, Algorithm 1), shared by the selector and the layer calibration.

First pass: run layers 0..r-1 on the whole prompt and layer r only up to its post-RoPE query
and key (no later layer, no LM head, no KV cache). The score of token j is the last prompt
token's query times key j, unscaled, summed over all query heads, then average-pooled
(over 5 tokens, stride 1, zero padding), computed in float32 whatever the model's dtype.

Beyond the paper (GemFilter options, all off by default): the last `queries` prompt tokens vote
instead of the last one alone (the question's tokens, as SnapKV's observation window does), each
query's scores can be a softmax (scaled, causal) so every query and head carries the same weight,
and whole blocks of `block` tokens can be kept so a needle is not cut into pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Cache, PreTrainedModel

from kvsieve.attention import StopForward, attention_hooks
from kvsieve.errors import KvsieveError
from kvsieve.models import logit_scale, with_cache


def resolve_count(value: int | float, total: int, what: str) -> int:
    """A count (int >= 1, at most `total`) or a fraction of `total` (float in (0, 1]) -> an int."""
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise KvsieveError(f"{what}={value} is not a fraction in (0, 1]; give a fraction or a token count.")
        return max(1, round(value * total))
    if value < 1:
        raise KvsieveError(f"{what}={value} must be at least 1.")
    if value > total:
        raise KvsieveError(
            f"{what}={value} exceeds the prompt's {total} tokens; nothing would be left out. "
            f"Use a smaller {what} (or a fraction such as 0.25), or run without this method."
        )
    return value


def filter_layer_qk(
    model: PreTrainedModel, ids: torch.Tensor, layer: int, queries: int = 1, cache: Cache | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run layers 0..layer and return layer `layer`'s last `queries` queries (h, w, d) and keys (kv_heads, n, d).

    The forward pass stops inside layer `layer`'s attention (StopForward), so its MLP and all
    later layers never run. No KV cache is built, unless `cache` is given: then `ids` continue the
    prompt prefix it holds (layers 0..layer of it), the keys returned are the prefix's and theirs,
    and the cache keeps both (a state a later prompt with the same prefix continues).
    """
    captured: dict[str, torch.Tensor] = {}

    def capture(layer_idx: int, query: torch.Tensor, key: torch.Tensor) -> None:
        if layer_idx == layer:
            captured["query"], captured["key"] = query[0, :, -queries:], key[0]
            raise StopForward

    with torch.no_grad(), attention_hooks(observers=[capture]):
        try:
            model.model(input_ids=ids, **with_cache(model.model, cache), use_cache=cache is not None)
        except StopForward:
            pass
    if "query" not in captured:
        raise KvsieveError(
            f"GemFilter saw no attention at layer {layer}: the model does not run through kvsieve's attention. "
            "Load it with kvsieve.load_model, or call kvsieve.prepare(model) on a model you loaded yourself."
        )
    return captured["query"], captured["key"]


def gemfilter_scores(
    queries: torch.Tensor, keys: torch.Tensor, pool_size: int = 5, softmax: bool = False
) -> torch.Tensor:
    """Token scores (n,) in fp32: sum over query heads (and queries) of q . k_j, then average-pooled.

    queries (h, d) for the last query alone (the paper), or (h, w, d) for the last w prompt
    queries; keys (kv_heads, n, d), query head h reads KV head h // n_rep. With `softmax`, each
    query head's row becomes softmax(q . k / sqrt(d)) over the keys it can see (causal) before the
    sum, so no query or head dominates by the scale of its logits.
    """
    if queries.dim() == 2:
        queries = queries[:, None]
    heads, w, dim = queries.shape
    kv_heads, n, _ = keys.shape
    grouped = queries.float().reshape(kv_heads, heads // kv_heads * w, dim)  # rows (r, w) per KV head
    logits = torch.bmm(grouped, keys.float().transpose(1, 2))  # (g, r * w, n)
    if softmax:
        visible = torch.arange(n, device=keys.device) <= torch.arange(n - w, n, device=keys.device)[:, None]
        logits = (logits.view(kv_heads, -1, w, n) * logit_scale(dim)).masked_fill(~visible, float("-inf")).softmax(-1)
    scores = logits.reshape(-1, n).sum(0)
    return F.avg_pool1d(scores[None, None], kernel_size=pool_size, stride=1, padding=pool_size // 2)[0, 0]


def top_k_with_tail(scores: torch.Tensor, k: int, tail_len: int, block: int = 1) -> torch.Tensor:
    """The `tail_len` last positions plus the best `k - tail_len` others, sorted ascending.

    block > 1 keeps whole blocks of `block` consecutive tokens (counted from token 0, ranked by
    their mean score) as long as they fit, then fills the rest with the best single tokens.
    """
    n = scores.shape[0]
    body_len, need = n - tail_len, k - tail_len
    body = scores[:body_len]
    chosen = torch.empty(0, dtype=torch.long, device=scores.device)
    whole = min(need // block, body_len // block) if block > 1 else 0
    if whole:
        means = body[: body_len // block * block].view(-1, block).mean(1)
        starts = torch.topk(means, whole).indices * block
        chosen = (starts[:, None] + torch.arange(block, device=scores.device)).flatten()
    if need > chosen.numel():
        rest = body.index_fill(0, chosen, float("-inf"))
        chosen = torch.cat([chosen, torch.topk(rest, need - chosen.numel()).indices])
    tail = torch.arange(body_len, n, device=scores.device)
    return torch.cat([chosen, tail]).sort().values
