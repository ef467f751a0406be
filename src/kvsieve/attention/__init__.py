"""The attention function kvsieve registers with transformers, and the hooks that steer it.

Models prepared by kvsieve use `attn_implementation="kvsieve"` (transformers' public
AttentionInterface, no model-class patching). Outside `attention_hooks(...)` the function is
plain causal SDPA. Inside, two things can change:

- observers see every layer's post-RoPE query and key (GemFilter's scoring, calibration,
  attention-based KV scorers); an observer may raise `StopForward` to end the forward pass early;
- a prefill kernel replaces dense attention for multi-token queries (e.g. CritiPrefill).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kvsieve.attention.dense import bottom_right_causal_mask, dense_attention, repeat_kv

ATTENTION_NAME = "kvsieve"

# observer(layer_idx, query (b, h, q, d), key (b, kv_heads, k, d)); both post-RoPE.
Observer = Callable[[int, torch.Tensor, torch.Tensor], None]
# kernel(layer_idx, query, key, value, scaling) -> (b, h, q, d)
PrefillKernel = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]


class StopForward(Exception):
    """Raised by an observer to stop a forward pass once it has what it needs."""


@dataclass(frozen=True)
class _Hooks:
    observers: tuple[Observer, ...]
    kernel: PrefillKernel | None


_active: ContextVar[_Hooks | None] = ContextVar("kvsieve_attention_hooks", default=None)


@contextmanager
def attention_hooks(observers: Sequence[Observer] = (), kernel: PrefillKernel | None = None) -> Iterator[None]:
    """Activate observers and/or a prefill kernel for forward passes inside the block.

    Nested blocks add their observers to the outer ones and keep the outer kernel unless they
    name their own, so e.g. GemFilter's scoring pass runs under a CritiPrefill kernel.
    """
    outer = _active.get() or _Hooks((), None)
    token = _active.set(_Hooks(outer.observers + tuple(observers), kernel or outer.kernel))
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
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry point: returns (b, q, h, d) like transformers' SDPA function.

    transformers builds no mask for a custom implementation name; causality is bottom-right
    and computed by the kernel (batch size 1, no padding).
    """
    hooks = _active.get()
    kernel = None
    if hooks is not None:
        for observer in hooks.observers:
            observer(module.layer_idx, query, key)
        if query.shape[2] > 1:
            kernel = hooks.kernel
    if kernel is None:
        out = dense_attention(query, key, value, scaling)
    else:
        out = kernel(module.layer_idx, query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, kvsieve_attention)

__all__ = [
    "ATTENTION_NAME",
    "Observer",
    "PrefillKernel",
    "StopForward",
    "attention_hooks",
    "bottom_right_causal_mask",
    "dense_attention",
    "kvsieve_attention",
    "repeat_kv",
]
