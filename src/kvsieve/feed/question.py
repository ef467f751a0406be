"""The question's votes between chunks: a prompt's question guides what every chunk's pruning keeps.

Beyond the IMDC paper (its authors prune by the chunk's own votes): when the prompt ends in a question, the chunked
feeds (`feed.chunked`, `question_guided`) run it after each chunk, let the pruner score the memory and the chunk from
the question's queries, and drop its entries again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Cache, PreTrainedModel

from kvsieve.attention import Observer, PassReader, attention_hooks
from kvsieve.kv.cache import is_windowed
from kvsieve.models import with_cache


def ask_question(
    model: PreTrainedModel,
    cache: Cache,
    question: torch.Tensor,
    position: int,
    observers: Sequence[Observer | PassReader],
    scores: dict[int, torch.Tensor],
) -> None:
    """Run the question after the chunk (at `position` onwards), let the pruner's `observers` score the keys
    before it into `scores` from the question's queries alone, and drop the question's KV entries again.

    The question's votes alone, not added to the chunk's (whose pass therefore scores nothing): the chunk's own
    votes outnumber the question's and rank what the chunk attends to (SnapKV pruner, IMDC passkeys at 16K:
    added at equal weight 1 of 3 found, alone 3 of 3; docs/STUDIES.md)."""
    positions = torch.arange(position, position + question.shape[1], device=question.device)[None]
    windows = {j: (layer.keys, layer.values, layer.cumulative_length) for j, layer in enumerate(cache.layers)
               if is_windowed(layer)}  # fmt: skip
    with attention_hooks(observers=observers, intermediate=True):
        model.model(input_ids=question, position_ids=positions, **with_cache(model.model, cache), use_cache=True)
    for j, layer in enumerate(cache.layers):
        if j in windows:  # a windowed layer dropped its oldest entries for the question's: it gets them back
            layer.keys, layer.values, layer.cumulative_length = windows[j]
            continue
        keys = layer.keys.shape[2] - question.shape[1]
        layer.keys, layer.values = layer.keys[:, :, :keys], layer.values[:, :, :keys]
        scores[j] = scores[j][:, :keys]
