"""GemFilter (gemfilter.md, Algorithm 1): early-layer token selection.

First pass: run layers 0..r-1 on the whole prompt and layer r only up to its post-RoPE query
and key (no later layer, no LM head, no KV cache). The score of token j is the last prompt
token's query times key j, unscaled, summed over all query heads, then average-pooled
(kernel 5, stride 1, zero padding). The top-k tokens, sorted back into input order, are what the
second pass (the full model, fresh positions 0..k-1) sees. Unlike the reference code we keep the
prompt's tail (question + chat-template suffix) by default, so the question always survives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from kvsieve.attention import StopForward, attention_hooks
from kvsieve.errors import KvsieveError
from kvsieve.models import architecture
from kvsieve.prompt import Prompt
from kvsieve.select import Selection


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
    tail = torch.arange(n - tail_len, n)
    return torch.cat([body, tail]).sort().values


@dataclass(frozen=True)
class GemFilter:
    """GemFilter selection options.

    k: tokens to keep, a count or a fraction of the prompt (paper: 1024 or 2048).
    layer: 0-based filter layer; None uses the layer `kvsieve calibrate` recorded for this
        model, else the middle layer.
    kernel: average-pooling kernel (odd, paper: 5).
    keep_tail: always keep the question and chat-template suffix (not in the reference code).
    """

    k: int | float = 1024
    layer: int | None = None
    kernel: int = 5
    keep_tail: bool = True
    name: str = "gemfilter"

    def filter_layer(self, model: PreTrainedModel) -> int:
        """The layer this selector uses for `model`, validated."""
        from kvsieve.select.calibrate import calibrated_layer

        num_layers = architecture(model).num_layers
        layer = self.layer
        if layer is None:
            layer = calibrated_layer(model)
            if layer is None:
                layer = num_layers // 2
        if not 0 <= layer < num_layers:
            raise KvsieveError(
                f"Filter layer {layer} is out of range: this model has {num_layers} layers (0..{num_layers - 1})."
            )
        return layer

    def select(self, model: PreTrainedModel, prompt: Prompt) -> Selection:
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise KvsieveError(f"Pooling kernel must be an odd number >= 1, got {self.kernel}.")
        layer = self.filter_layer(model)
        n = prompt.length
        k = resolve_count(self.k, n, "k")
        tail_len = prompt.tail_len if self.keep_tail else 0
        if k <= tail_len:
            raise KvsieveError(
                f"k={k} leaves no room besides the prompt's tail ({tail_len} tokens of question and "
                "chat-template suffix). Raise k, or turn keep_tail off."
            )
        start = time.perf_counter()
        query_last, keys = filter_layer_qk(model, prompt.ids, layer)
        scores = gemfilter_scores(query_last, keys, self.kernel)
        indices = top_k_with_tail(scores, k, tail_len)
        return Selection(
            indices=indices,
            details={"layer": layer, "k": k, "kept_tail": tail_len, "first_pass_seconds": time.perf_counter() - start},
        )
