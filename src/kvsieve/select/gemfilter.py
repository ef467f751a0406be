"""GemFilter ("Discovering the Gems in Early Layers", arXiv 2409.17422, Algorithm 1): early-layer token selection.

The first pass runs layers 0..r (layer r only up to its post-RoPE query and key) and scores
every token by the last query (`kvsieve.select.scoring`). The top-k tokens, sorted back into
input order, are what the second pass (the full model, fresh positions 0..k-1) sees. Unlike the
reference code we keep the prompt's tail (question + chat-template suffix) by default, so the
question always survives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
from transformers import Cache, PreTrainedModel

from kvsieve.compress.scorers import check_pool_size
from kvsieve.errors import KvsieveError
from kvsieve.models import architecture
from kvsieve.prompt import Prompt
from kvsieve.select import Selection
from kvsieve.select.layers import calibrated_layer
from kvsieve.select.scoring import filter_layer_qk, gemfilter_scores, resolve_count, top_k_with_tail
from kvsieve.spec import component, option


@component("gemfilter", "select")
@dataclass(frozen=True)
class GemFilter:
    """GemFilter selection options.

    k: tokens to keep, a count or a fraction of the prompt (paper: 1024 or 2048).
    layer: 0-based filter layer; None is the middle layer (num_layers // 2), the same on every
        machine; "calibrated" reads the layer `kvsieve calibrate` recorded for this model.
    pool_size: tokens each score is average-pooled over (odd, paper: 5).
    keep_tail: always keep the question and chat-template suffix (not in the reference code).
    queries, softmax, block: beyond the paper (`kvsieve.select.scoring`): how many last prompt
        queries vote (paper 1), a softmax per query before summing (paper: raw q.k), and keeping
        whole blocks of `block` tokens (paper: single tokens, 1).
    """

    k: int | float = option(1024, "tokens to keep: a count (1024) or a fraction of the prompt (0.25)")
    layer: int | Literal["calibrated"] | None = option(
        None, "0-based filter layer; none = the middle layer; calibrated = what `kvsieve calibrate` recorded"
    )
    pool_size: int = option(5, "tokens each score is average-pooled over, odd (paper 5)", was="kernel")
    keep_tail: bool = option(True, "always keep the question and chat-template suffix (reference code: false)")
    queries: int = option(1, "the last prompt queries that vote (paper: 1, the last token)")
    softmax: bool = option(False, "softmax per query head before summing the votes (paper: raw q.k)")
    block: int = option(1, "keep whole blocks of this many tokens (paper: 1, single tokens)")

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int | float) or self.k <= 0:
            raise KvsieveError(f"GemFilter k must be a token count >= 1 or a fraction in (0, 1], got {self.k!r}.")
        if isinstance(self.k, float) and self.k > 1:
            raise KvsieveError(f"GemFilter k={self.k} is not a fraction in (0, 1]; give a fraction or a whole count.")
        if self.layer is not None and self.layer != "calibrated":
            if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
                raise KvsieveError(
                    f"GemFilter layer must be a 0-based layer index, none or 'calibrated'; got {self.layer!r}."
                )
        check_pool_size(self.pool_size)
        for name in ("queries", "block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KvsieveError(f"GemFilter {name} must be a whole number >= 1 (paper: 1); got {value!r}.")
        if not isinstance(self.softmax, bool):
            raise KvsieveError(f"GemFilter softmax must be true or false; got {self.softmax!r}.")

    @property
    def name(self) -> str:
        return self.tag

    @classmethod
    def calibrated(cls, model: PreTrainedModel, **options) -> GemFilter:
        """GemFilter at the layer `kvsieve calibrate` recorded for `model` (refuses when there is none)."""
        return cls(layer=_recorded_layer(model), **options)

    def filter_layer(self, model: PreTrainedModel) -> int:
        """The layer this selector uses for `model`, validated."""
        arch = architecture(model)
        num_layers, usable = arch.num_layers, arch.global_layers
        if not usable:
            raise KvsieveError(
                f"GemFilter scores the prompt at a global attention layer, and every layer of this "
                f"'{arch.model_type}' model attends within a sliding window of {max(w for w in arch.windows if w)} "
                "tokens, so its last queries never see the start of a long prompt. Use a method without a select stage."
            )
        layer = self.layer
        if layer is None:  # the middle layer, or on a hybrid model the global layer nearest to it
            layer = min(usable, key=lambda j: (abs(j - num_layers // 2), j))
        elif layer == "calibrated":
            layer = _recorded_layer(model)
        if not 0 <= layer < num_layers:
            raise KvsieveError(
                f"Filter layer {layer} is out of range: this model has {num_layers} layers (0..{num_layers - 1})."
            )
        if layer not in usable:
            raise KvsieveError(
                f"Filter layer {layer} attends within a sliding window of {arch.windows[layer]} tokens, so its last "
                f"queries never see the start of a long prompt; choose a global layer: {', '.join(map(str, usable))}."
            )
        return layer

    def select(self, model: PreTrainedModel, prompt: Prompt, cache: Cache | None = None) -> Selection:
        """The k kept positions of `prompt`. `cache` holds layers 0..r of the prompt's first tokens (a
        stored prefix, see `first_pass`): then only the rest runs, and is added to it."""
        layer = self.filter_layer(model)
        n = prompt.length
        if isinstance(self.k, int) and self.k >= n:  # nothing to leave out: the whole prompt, and the record says so
            note = f"k={self.k} >= the prompt's {n} tokens: every token kept, no selection pass"
            details = {"layer": layer, "k": n, "kept_tail": 0, "first_pass_seconds": 0.0, "note": note}
            return Selection(indices=torch.arange(n, device=prompt.ids.device), details=details)
        k = resolve_count(self.k, n, "k")
        # The prompt's question (a stand-in for one nobody marked, `kvsieve.prompt.question_tail`, takes at most half
        # of k), else the voting queries, whose last one gives the first answer token's logits.
        tail_len = prompt.tail_len if prompt.asked else min(prompt.tail_len, k // 2)
        tail_len = (tail_len or min(self.queries, k - 1)) if self.keep_tail else 0
        if k <= tail_len:
            raise KvsieveError(
                f"k={k} leaves no room besides the prompt's tail ({tail_len} tokens of question and "
                "chat-template suffix). Raise k, or turn keep_tail off."
            )
        start = time.perf_counter()
        ids = prompt.ids if cache is None else prompt.ids[:, cache.get_seq_length() :]
        queries, keys = filter_layer_qk(model, ids, layer, min(self.queries, n), cache)
        indices = self.choose(queries, keys, k, tail_len)
        return Selection(
            indices=indices,
            details={"layer": layer, "k": k, "kept_tail": tail_len, "first_pass_seconds": time.perf_counter() - start},
        )

    def first_pass(self, model: PreTrainedModel, ids: torch.Tensor, cache: Cache) -> None:
        """Run `ids`, a prompt's first tokens, through layers 0..r into `cache`: the part of the selection
        pass that does not depend on the question, which later prompts with the same start continue."""
        filter_layer_qk(model, ids, self.filter_layer(model), 1, cache)

    def choose(self, queries: torch.Tensor, keys: torch.Tensor, k: int, tail_len: int) -> torch.Tensor:
        """The k kept positions, ascending, from the filter layer's last queries (h, w, d) and keys."""
        scores = gemfilter_scores(queries[:, -self.queries :], keys, self.pool_size, self.softmax)
        return top_k_with_tail(scores, k, tail_len, self.block)


def _recorded_layer(model: PreTrainedModel) -> int:
    layer = calibrated_layer(model)
    if layer is None:
        raise KvsieveError(
            "No calibrated filter layer is recorded for this model; run `kvsieve calibrate` first, "
            "or give a layer number (or none for the middle layer)."
        )
    return layer
