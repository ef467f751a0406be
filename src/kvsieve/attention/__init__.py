"""The attention function kvsieve registers with transformers, and the hooks that steer it.

Models prepared by kvsieve use `attn_implementation="kvsieve"` (transformers' public
AttentionInterface, no model-class patching). Outside `attention_hooks(...)` the function is
plain causal SDPA. Inside, two things can change:

- observers see every layer's post-RoPE query and key (GemFilter's scoring, calibration,
  attention-based KV scorers; a `PassReader` its values too); an observer may raise `StopForward` to end the forward
  pass early.
  An `AccumulatedScores` observer (H2O, A2SF, Collie) gets its scores out of the dense attention itself
  (a prefill, or a decoding step's row) instead of computing them in a second pass, an `AttentionMaxima` observer
  (KVzip) each key's largest attention likewise, and an `AttentionRows`
  observer gets a decoding step's probabilities (a padded batch's too) from the attention's own pass;
- last-pass observers and finishers serve stages that only use a feed's last forward pass: a
  chunked feed marks its earlier passes `intermediate`, and they are skipped there. A finisher
  runs with the layer index once that layer's attention is done (compression layer by layer);
- a prefill attention replaces dense attention for multi-token queries (e.g. CritiPrefill's block-sparse one);

Key lengths mark right padding in a batch of ragged caches (the engine's batched decoding): row b of
layer j holds `key_lengths[j][b]` keys, its query i (of q) attends to the first
`key_lengths[j][b] - q + i + 1` of them, and the columns after them are padding. They are not a hook
but an argument of the model's forward (`model(..., key_lengths=...)`), which transformers hands on
to the attention function: so a compiled decoding step (`engine.static_step`) takes them as inputs.
The hooks themselves live in a context variable, which dynamo cannot trace (a graph break in every
layer); a forward given `kvsieve_hooks=NO_HOOKS` reads none, which is what the compiled step passes.
Anything else compiled by its caller still reads the context's hooks (through the graph break).

Key segments mark a cache whose KV heads hold their own counts (per-head budgets, `kvsieve.kv.heads`): layer j's
`key_segments[j]`, where not None, is the cache layer, whose `segments()` say where each head's entries lie in the
flat keys and values the cache hands the attention (`kvsieve.kernels.attention.segment_attention`). Like the key
lengths, an argument of the forward, which `kvsieve.models.with_cache` adds for such a cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from transformers import AttentionInterface

from kvsieve.attention.accumulate import (
    AccumulatedScores,
    AttentionMaxima,
    AttentionRows,
    PassReader,
    accumulating_attention,
)
from kvsieve.attention.dense import bottom_right_causal_mask, dense_attention, local_attention, repeat_kv
from kvsieve.errors import KvsieveError
from kvsieve.kernels.attention import decode_attention, decode_attention_probs, grouped_attention, segment_attention
from kvsieve.spec import warn_renamed

ATTENTION_NAME = "kvsieve"

# observer(layer_idx, query (b, h, q, d), key (b, kv_heads, k, d)); both post-RoPE.
Observer = Callable[[int, torch.Tensor, torch.Tensor], None]
# prefill(layer_idx, query, key, value, scaling) -> (b, h, q, d): attention for multi-token queries (CritiPrefill's)
PrefillAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]
# finisher(layer_idx), called once the layer's attention output is computed
Finisher = Callable[[int], None]


class Segmented(Protocol):
    """A cache layer whose KV heads hold their own counts (`kvsieve.kv.heads.SegmentedLayer`)."""

    @property
    def longest(self) -> int:
        """The longest head's entries."""
        ...

    def segments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts, lengths), each (1, kv_heads): where each head's entries lie in the layer's flat buffers."""
        ...


class StopForward(Exception):
    """Raised by an observer to stop a forward pass once it has what it needs."""


@dataclass(frozen=True)
class Hooks:
    """What a forward pass's attention is steered by (`attention_hooks` sets them for a block)."""

    observers: tuple[Observer, ...] = ()
    prefill: PrefillAttention | None = None
    last_pass: tuple[Observer, ...] = ()
    finishers: tuple[Finisher, ...] = ()
    intermediate: bool = False

    def active_observers(self) -> tuple[Observer, ...]:
        return self.observers if self.intermediate else self.observers + self.last_pass


_active: ContextVar[Hooks | None] = ContextVar("kvsieve_attention_hooks", default=None)
NO_HOOKS = Hooks()  # `model(..., kvsieve_hooks=NO_HOOKS)`: a forward that reads no hooks (a compiled step)


@contextmanager
def attention_hooks(
    observers: Sequence[Observer] = (),
    prefill: PrefillAttention | None = None,
    *,
    last_pass: Sequence[Observer] = (),
    finishers: Sequence[Finisher] = (),
    intermediate: bool | None = None,
    kernel: PrefillAttention | None = None,
) -> Iterator[None]:
    """Activate observers and/or a prefill attention for forward passes inside the block.

    Nested blocks add their observers (and last-pass observers, finishers) to the outer ones and
    keep the outer prefill attention unless they name their own, so e.g. GemFilter's scoring pass runs
    under CritiPrefill's. `intermediate=True` marks passes that are not a feed's last:
    last-pass observers and finishers skip them. `kernel` is `prefill`'s old name (CHANGELOG.md).
    """
    if kernel is not None:
        warn_renamed("attention_hooks", "kernel", "prefill")
        prefill = prefill or kernel
    outer = _active.get() or Hooks()
    token = _active.set(
        Hooks(
            observers=outer.observers + tuple(observers),
            prefill=prefill or outer.prefill,
            last_pass=outer.last_pass + tuple(last_pass),
            finishers=outer.finishers + tuple(finishers),
            intermediate=outer.intermediate if intermediate is None else intermediate,
        )
    )
    try:
        yield
    finally:
        _active.reset(token)


def kvsieve_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    key_lengths: Sequence[torch.Tensor] | None = None,
    kvsieve_hooks: Hooks | None = None,
    key_segments: Sequence[Segmented | None] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry point: returns (b, q, h, d) like transformers' SDPA function.

    transformers builds no mask for a custom implementation name; causality is bottom-right
    and computed by the kernel. Batches are unpadded unless the model's forward got `key_lengths`
    (per layer, each row's key count: right padding). The hooks are the context's unless the forward got
    `kvsieve_hooks` (`NO_HOOKS`).

    A hybrid model's sliding layer (transformers passes its `sliding_window`) attends within its window and is
    neither observed nor given the prefill kernel: its cache is bounded by the window, so no stage scores or
    sparsifies it. Gemma 2's `softcap` layers take the float32 grouped path, which caps the logits.
    """
    hooks = kvsieve_hooks or _active.get() or NO_HOOKS
    layer = cast(int, module.layer_idx)  # transformers' attention modules carry their index as an int
    lengths = key_lengths[layer] if key_lengths is not None else None
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    segmented = key_segments[layer] if key_segments is not None else None
    if segmented is not None:
        out = _segmented(layer, hooks, query, key, value, scaling, segmented, softcap)
    elif window is not None or softcap is not None:
        out = _windowed_or_capped(layer, hooks, query, key, value, scaling, lengths, window, softcap)
    else:
        out = _hooked(layer, hooks, query, key, value, scaling, lengths)
    if not hooks.intermediate:
        for finish in hooks.finishers:
            finish(layer)
    return out.transpose(1, 2).contiguous(), None


def _hooked(
    layer: int,
    hooks: Hooks,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None,
) -> torch.Tensor:
    """`kvsieve_attention` on a global layer without a soft-cap: a decoding step (`kvsieve.kernels.attention`, which
    chooses the CPU's kernel or PyTorch's), a dense prefill or the prefill attention, with the hooks' observers served
    from the attention's own pass where they can be: (b, h, q, d)."""
    prefill = hooks.prefill if query.shape[2] > 1 else None
    observers = hooks.active_observers()
    rows = [o for o in observers if isinstance(o, AttentionRows)]
    if rows and query.shape[2] != 1:
        raise ValueError(f"AttentionRows observe decoding steps (one query per row), got {query.shape[2]} queries")
    fused = [o for o in observers if isinstance(o, AccumulatedScores | AttentionMaxima)]
    maxima = [o for o in fused if isinstance(o, AttentionMaxima)]
    fused = [o for o in fused if not isinstance(o, AttentionMaxima) or o.within is maxima[0].within]  # one softmax
    if not fused or rows or prefill is not None or lengths is not None or query.shape[0] != 1:
        fused = []  # no dense prefill pass to take the scores from: they compute their own
    for observer in observers:
        if not any(observer is f for f in fused) and not isinstance(observer, AttentionRows):
            _observe(observer, layer, query, key, value)
    if rows:  # a decoding step and its probabilities
        out, probs = decode_attention_probs(query, key, value, scaling, lengths)
        for observer in rows:
            observer.receive(layer, probs, key.shape[1])
    elif lengths is not None:  # a padded batch's decoding step
        out = decode_attention(query, key, value, scaling, lengths)
    elif fused:
        summed = [f for f in fused if isinstance(f, AccumulatedScores)]
        highest = [f for f in fused if isinstance(f, AttentionMaxima)]
        within = highest[0].columns(key.shape[2], query.shape[2]) if highest else None
        out, scores, best = accumulating_attention(
            query, key, value, scaling, [f.alpha for f in summed], maxima=bool(highest), within=within
        )
        for observer, layer_scores in zip(summed, scores, strict=True):
            observer.receive(layer, layer_scores, query.shape[2])
        for observer in highest:
            observer.receive(layer, cast(torch.Tensor, best))
    elif prefill is None:
        out = dense_attention(query, key, value, scaling)
    else:
        out = prefill(layer, query, key, value, scaling)
    return out


def _segmented(
    layer: int,
    hooks: Hooks,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    segmented: Segmented,
    softcap: float | None,
) -> torch.Tensor:
    """`kvsieve_attention` over a layer whose KV heads hold their own counts: key/value the layer's flat buffers (1, 1,
    capacity, d), its `segments()` where each head's entries lie; Gemma 2's `softcap` on the logits. Nothing
    observes such a layer: it is compressed already, and no stage scores it again."""
    if hooks.active_observers() or (hooks.prefill is not None and query.shape[2] > 1):
        raise KvsieveError(
            f"Layer {layer} holds per-head budgets (compress.head_budgets): it is compressed for good, so no stage "
            "observes it again and no prefill attention runs over it; use head budgets without an evict stage or a "
            "prefill attention stage."
        )
    starts, lengths = segmented.segments()
    return segment_attention(query, key[0, 0], value[0, 0], starts, lengths, scaling, segmented.longest, softcap)


def _observe(
    observer: Observer | PassReader, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Hand one observer the layer's pass: a `PassReader` its values too."""
    if isinstance(observer, PassReader):
        observer.receive(layer, query, key, value)
    else:
        observer(layer, query, key)


def _windowed_or_capped(
    layer: int,
    hooks: Hooks,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    lengths: torch.Tensor | None,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """`kvsieve_attention` on a sliding layer (`window`) or a soft-capped one: (b, h, q, d).

    A sliding layer is never observed. A soft-capped global layer (Gemma 2) is: its observers compute their scores
    from its query and keys (no fused pass), a decoding step's `AttentionRows` get the capped probabilities."""
    observers = () if window is not None else hooks.active_observers()
    if window is None and hooks.prefill is not None and query.shape[2] > 1:
        raise KvsieveError(
            "This model soft-caps its attention logits (Gemma 2), which the prefill attention (CritiPrefill) does not; "
            "use a method without a prefill attention stage on it."
        )
    rows = [o for o in observers if isinstance(o, AttentionRows)]
    for observer in observers:
        if not isinstance(observer, AttentionRows):
            _observe(observer, layer, query, key, value)
    if rows:  # a soft-capped global layer's decoding step (a sliding layer has no observers)
        out, probs = decode_attention_probs(query, key, value, scaling, lengths, softcap)
        for observer in rows:
            observer.receive(layer, probs, key.shape[1])
        return out
    if lengths is None and query.shape[2] > 1:
        return local_attention(query, key, value, scaling, window, softcap)
    # A decoding step: one row's last W columns, or a padded batch's sliding layers, rings of at most W entries
    # (`WindowBuffer`), all in the window.
    if lengths is None and window is not None:
        key, value = key[:, :, -window:], value[:, :, -window:]
    return decode_attention(query, key, value, scaling, lengths, softcap)


AttentionInterface.register(ATTENTION_NAME, kvsieve_attention)

__all__ = [
    "ATTENTION_NAME",
    "AccumulatedScores",
    "AttentionMaxima",
    "AttentionRows",
    "Finisher",
    "Hooks",
    "NO_HOOKS",
    "Observer",
    "PassReader",
    "PrefillAttention",
    "StopForward",
    "attention_hooks",
    "bottom_right_causal_mask",
    "dense_attention",
    "grouped_attention",
    "kvsieve_attention",
    "repeat_kv",
]


def __getattr__(name: str) -> object:
    """`PrefillKernel`, `PrefillAttention`'s old name, for one release (CHANGELOG.md)."""
    if name == "PrefillKernel":
        warn_renamed("kvsieve.attention", "PrefillKernel", "PrefillAttention")
        return PrefillAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
