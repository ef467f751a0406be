"""The second pass a policy may read (`Policy.second_pass`, KVzip's context reconstruction): its passes run on top of
the prompt's cache, each scored by the policy like any pass (`score_observers`) and then dropped (`ask_question`),
so the cache ends as it began; an entry's score is its best over the passes (each pass scoring the entries its
`Reread.within` names)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import Cache, PreTrainedModel

from kvsieve.compress.policy import Policy
from kvsieve.compress.stages import score_observers
from kvsieve.feed.question import ask_question
from kvsieve.models import architecture


def second_pass_scores(
    model: PreTrainedModel, cache: Cache, ids: torch.Tensor, policy: Policy, encode: Callable[[str], list[int]]
) -> dict[int, torch.Tensor]:
    """`policy`'s scores (kv_heads, n) per scored layer of `cache`, which holds `ids` (1, n) at positions 0 .. n-1,
    from its second pass: the elementwise maximum over its passes, each run at positions n onwards, as the policy
    makes its scores of it (`Policy.from_second_pass`)."""
    arch = architecture(model)
    best: dict[int, torch.Tensor] = {}
    for reread in policy.second_pass(ids, encode):
        scores: dict[int, torch.Tensor] = {}
        observers = score_observers(policy, scores, arch=arch, within=reread.within)
        with torch.no_grad():
            ask_question(model, cache, reread.tokens, ids.shape[1], observers, scores)
        for layer, layer_scores in scores.items():
            best[layer] = layer_scores if layer not in best else torch.maximum(best[layer], layer_scores)
    return {layer: policy.from_second_pass(layer_best) for layer, layer_best in best.items()}
