"""GemFilter's scoring (gemfilter.md, Algorithm 1), shared by the selector and the layer calibration.

First pass: run layers 0..r-1 on the whole prompt and layer r only up to its post-RoPE query
and key (no later layer, no LM head, no KV cache). The score of token j is the last prompt
token's query times key j, unscaled, summed over all query heads, then average-pooled
(kernel 5, stride 1, zero padding), computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from kvsieve.attention import StopForward, attention_hooks
from kvsieve.errors import KvsieveError


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


def filter_layer_qk(model: PreTrainedModel, ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run layers 0..layer and return layer `layer`'s last query (h, d) and keys (kv_heads, n, d).

    The forward pass stops inside layer `layer`'s attention (StopForward), so its MLP and all
    later layers never run, and no KV cache is built.
    """
    captured: dict[str, torch.Tensor] = {}

    def capture(layer_idx: int, query: torch.Tensor, key: torch.Tensor) -> None:
        if layer_idx == layer:
            captured["query"], captured["key"] = query[0, :, -1], key[0]
            raise StopForward

    with torch.no_grad(), attention_hooks(observers=[capture]):
        try:
            model.model(input_ids=ids, use_cache=False)
        except StopForward:
            pass
    if "query" not in captured:
        raise KvsieveError(
            f"GemFilter saw no attention at layer {layer}: the model does not run through kvsieve's attention. "
            "Load it with kvsieve.load_model, or call kvsieve.prepare(model) on a model you loaded yourself."
        )
    return captured["query"], captured["key"]


def gemfilter_scores(query_last: torch.Tensor, keys: torch.Tensor, kernel: int = 5) -> torch.Tensor:
    """Token scores (n,) in fp32: sum over query heads of q_last . k_j, then average-pooled.

    query_last (h, d); keys (kv_heads, n, d), query head h reads KV head h // n_rep.
    """
    heads, dim = query_last.shape
    kv_heads = keys.shape[0]
    grouped = query_last.float().view(kv_heads, heads // kv_heads, dim)  # (g, r, d)
    scores = torch.einsum("grd,gnd->n", grouped, keys.float())
    return F.avg_pool1d(scores[None, None], kernel_size=kernel, stride=1, padding=kernel // 2)[0, 0]


def top_k_with_tail(scores: torch.Tensor, k: int, tail_len: int) -> torch.Tensor:
    """The `tail_len` last positions plus the best `k - tail_len` others, sorted ascending."""
    n = scores.shape[0]
    body = torch.topk(scores[: n - tail_len], k - tail_len).indices
    tail = torch.arange(n - tail_len, n, device=scores.device)
    return torch.cat([body, tail]).sort().values
