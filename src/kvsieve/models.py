"""The architecture adapter: the one place that knows how to reach a model's decoder layers, attention modules,
rotary embedding and head counts (`architecture()`), which families kvsieve runs, and `prepare()`, which routes a
model's attention through kvsieve. Everything else in kvsieve asks it. Loading a model is `kvsieve.loading`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache, PreTrainedModel

from kvsieve.errors import KvsieveError

# Decoder layouts whose attention follows Llama's: q/k/v projections (or Phi-3's fused qkv), RoPE from
# `model.model.rotary_emb` (Gemma 3: one per layer kind), and attention through transformers' AttentionInterface.
# Gemma 2/3, Mistral and Qwen2/3 may mix sliding-window layers with global ones (`layer_types`).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# Families transformers has that kvsieve refuses, with what it lacks for them (the refusal's message).
UNSUPPORTED_FEATURES = {
    "gemma3": "the multimodal Gemma 3 (Gemma3ForConditionalGeneration) wraps its decoder in a vision model; load the "
    "text-only checkpoint (gemma3_text, Gemma3ForCausalLM) such as Gemma 3 270M / 1B",
    "gpt_oss": "learned attention sinks (s_aux) in every layer's softmax, which kvsieve's attention does not add",
    "cohere2": "global layers without RoPE (NoPE), which kvsieve's position rules (re-encoding, re-rotation) assume",
    "deepseek_v2": "multi-head latent attention (MLA): its compressed KV has no per-head keys to score or prune",
    "deepseek_v3": "multi-head latent attention (MLA): its compressed KV has no per-head keys to score or prune",
    "qwen3_next": "linear-attention (Gated DeltaNet) layers, whose state is not a KV cache",
    "falcon_h1": "Mamba layers, whose state is not a KV cache",
    "jamba": "Mamba layers, whose state is not a KV cache",
}


@dataclass(frozen=True)
class Rotary:
    """One layer kind's rotary embedding, called as `rotary(x, position_ids) -> (cos, sin)` whatever the model's
    module wants: Gemma 3 has one module for two kinds with different bases (local 10K, global 1M), chosen by a
    `layer_type` argument, and a scaling per kind."""

    module: torch.nn.Module
    layer_type: str | None = None  # the argument Gemma 3's module takes; None: the module has one embedding

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_type is None:
            return self.module(x, position_ids)
        return self.module(x, position_ids, self.layer_type)

    @property
    def attention_scaling(self) -> float:
        """The factor the module multiplies cos/sin by (YaRN-style scaling; 1 for plain RoPE)."""
        name = "attention_scaling" if self.layer_type is None else f"{self.layer_type}_attention_scaling"
        return float(getattr(self.module, name, 1.0) or 1.0)


@dataclass(frozen=True)
class Architecture:
    """What kvsieve needs to know about a decoder-only RoPE model, per layer where layers differ.

    `windows[j]` is layer j's sliding window W (its query at position p sees the keys at p - W + 1 .. p) or None
    for a global layer. A sliding layer's cache is bounded by its window already: kvsieve never compresses it,
    and the methods' budgets, selection layers and sparse kernels belong to the global layers.
    """

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    layers: torch.nn.ModuleList
    rotary_emb: torch.nn.Module
    windows: tuple[int | None, ...]
    rotaries: tuple[Rotary, ...]

    @property
    def n_rep(self) -> int:
        """Query heads per KV head: query head h reads KV head h // n_rep."""
        return self.num_heads // self.num_kv_heads

    @property
    def global_layers(self) -> tuple[int, ...]:
        """The layers without a sliding window, where budgets, selection and sparse attention apply."""
        return tuple(j for j, window in enumerate(self.windows) if window is None)

    @property
    def hybrid(self) -> bool:
        """Whether any layer attends within a sliding window."""
        return any(window is not None for window in self.windows)

    def rotary(self, layer: int) -> Rotary:
        """Layer `layer`'s rotary embedding (moving its cached keys to other positions uses it)."""
        return self.rotaries[layer]


def logit_scale(dim: int, scaling: float | None = None) -> float:
    """The attention logits' scale for heads of `dim`: the model's `scaling` where given, else dim ** -0.5, every
    supported family's own but Gemma 2/3 checkpoints whose query_pre_attn_scalar differs from head_dim (scores taken
    at dim ** -0.5 there run at a slightly other temperature than the model's attention)."""
    return dim**-0.5 if scaling is None else scaling


def architecture(model: PreTrainedModel) -> Architecture:
    """Return the adapter view of `model`, or refuse it with a message naming what is missing."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        missing = UNSUPPORTED_FEATURES.get(model_type)
        raise KvsieveError(
            f"Unsupported architecture '{model_type}' ({type(model).__name__})"
            + (f": it has {missing}" if missing else "")
            + f". kvsieve supports RoPE decoders with the Llama attention layout, sliding-window layers "
            f"included: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    body = getattr(model, "model", None)
    missing = [name for name in ("layers", "rotary_emb", "embed_tokens") if not hasattr(body, name)]
    if missing:
        raise KvsieveError(
            f"Model '{model_type}' has no {', '.join('model.' + m for m in missing)}; kvsieve cannot reach "
            "its decoder layers / rotary embedding."
        )
    for index, layer in enumerate(body.layers):
        attn = getattr(layer, "self_attn", None)
        has_proj = attn is not None and (
            (hasattr(attn, "q_proj") and hasattr(attn, "k_proj")) or hasattr(attn, "qkv_proj")
        )
        if not has_proj:
            raise KvsieveError(
                f"Layer {index} of '{model_type}' has no self_attn with q_proj/k_proj or qkv_proj projections."
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise KvsieveError(
            f"'{model_type}' is configured with bidirectional attention (an embedding model); kvsieve runs causal "
            "decoders only."
        )
    windows = layer_windows(model)
    num_heads = config.num_attention_heads
    return Architecture(
        model_type=model_type,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        max_positions=config.max_position_embeddings,
        layers=body.layers,
        rotary_emb=body.rotary_emb,
        windows=windows,
        rotaries=tuple(_layer_rotary(body, config, j) for j in range(config.num_hidden_layers)),
    )


def layer_windows(model: PreTrainedModel) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global), from the config as transformers reads it: `layer_types`
    ("sliding_attention" layers take `sliding_window`), or, where a config has no `layer_types` (Mistral), every
    layer slides when `sliding_window` is set (and `use_sliding_window` is not off)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):
        window = None
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * (
        config.num_hidden_layers
    )
    unknown = sorted({kind for kind in types if kind not in ("full_attention", "sliding_attention")})
    if unknown:
        raise KvsieveError(
            f"Model '{config.model_type}' has layers of kind {', '.join(unknown)}; kvsieve supports full_attention "
            "and sliding_attention layers."
        )
    return tuple(window if kind == "sliding_attention" and window else None for kind in types)


def _layer_rotary(body: torch.nn.Module, config, layer: int) -> Rotary:
    """Layer `layer`'s `Rotary`: the model's module, told the layer's kind where it keeps one per kind (Gemma 3 in
    transformers 5.24), or the separate local module of a sliding layer where there is one (`rotary_emb_local`,
    Gemma 3 in earlier releases)."""
    module = body.rotary_emb
    sliding = (getattr(config, "layer_types", None) or ["full_attention"] * (layer + 1))[layer] == "sliding_attention"
    if sliding and hasattr(body, "rotary_emb_local"):
        return Rotary(body.rotary_emb_local)
    if "layer_type" in inspect.signature(module.forward).parameters:
        return Rotary(module, config.layer_types[layer])
    return Rotary(module)


def with_cache(module: torch.nn.Module, cache: Cache | None) -> dict[str, Any]:
    """The keywords that hand `cache` to `module`'s forward: the cache, as its transformers version names it, and
    for a cache with per-head budgets its layers' segments (`key_segments`, `kvsieve.attention`).

    transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns and
    goes in 5.40); earlier 5.x releases know only `past_key_values`. Every call of a model with a
    cache goes through here, so kvsieve never passes a deprecated argument, and no forward over a segmented
    cache misses its segments.
    """
    keywords: dict[str, Any] = {_cache_keyword(type(module).forward): cache}
    layers = cache.layers if cache is not None else []
    if any(hasattr(layer, "segments") for layer in layers):  # `kvsieve.kv.heads.SegmentedLayer`
        keywords["key_segments"] = [layer if hasattr(layer, "segments") else None for layer in layers]
    return keywords


@functools.cache
def _cache_keyword(forward: Callable) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"
