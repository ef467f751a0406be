"""Choosing GemFilter's filter layer by measurement (the paper's Figure 5 analysis).

For needle probes (passkey by default: on SmolLM2 it gives a clear per-layer signal, the
essay needle a noisy one) of a few lengths and depths, one full forward pass scores every layer the way
GemFilter would and records the fraction of needle tokens inside that layer's top-k. The
recommended layer is the earliest one within `tolerance` of the best recall (earlier = cheaper
first pass). The choice is remembered per model in the kvsieve cache dir and becomes
GemFilter's default layer for that model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve.attention import attention_hooks
from kvsieve.errors import KvsieveError
from kvsieve.eval.data import PROBES, Case
from kvsieve.models import architecture, cache_dir
from kvsieve.prompt import build_prompt
from kvsieve.select.gemfilter import gemfilter_scores, top_k_with_tail


def calibration_file() -> Path:
    return cache_dir() / "calibration.json"


def model_key(model: PreTrainedModel) -> str:
    """Identity under which a model's calibration is stored (its load path or name)."""
    return str(getattr(model.config, "name_or_path", "") or model.config.model_type)


def _load_all() -> dict:
    path = calibration_file()
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def calibrated_layer(model: PreTrainedModel) -> int | None:
    """The filter layer `kvsieve calibrate` recorded for this model, if any."""
    entry = _load_all().get(model_key(model))
    return None if entry is None else int(entry["layer"])


@dataclass
class Calibration:
    recall: list[float]  # per layer: mean fraction of needle tokens in GemFilter's top-k
    layer: int  # recommended filter layer
    k: int
    probe: str
    lengths: list[int]
    depths: list[float]


def needle_token_indices(tokenizer: PreTrainedTokenizerBase, case: Case, context_start: int) -> torch.Tensor:
    """Prompt positions of the tokens that overlap the needle's characters."""
    offsets = tokenizer(case.context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    lo, hi = case.needle_start, case.needle_start + len(case.needle)
    inside = [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]
    return torch.tensor(inside) + context_start


def layer_recall(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, case: Case, k: int, kernel: int = 5
) -> torch.Tensor:
    """Per layer, the fraction of the needle's tokens inside GemFilter's top-k at that layer."""
    prompt = build_prompt(tokenizer, case.context, case.question)
    needle = needle_token_indices(tokenizer, case, prompt.context_start)
    recall = torch.zeros(architecture(model).num_layers)

    def score(layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        selected = top_k_with_tail(gemfilter_scores(query[0, :, -1], key[0], kernel), k, prompt.tail_len)
        recall[layer] = torch.isin(needle, selected).float().mean()

    with torch.no_grad(), attention_hooks(observers=[score]):
        model.model(input_ids=prompt.ids, use_cache=False)
    return recall


def recommend_layer(recall: Sequence[float], tolerance: float = 0.05) -> int:
    """Earliest layer whose recall is within `tolerance` of the best layer's."""
    best = max(recall)
    return next(i for i, r in enumerate(recall) if r >= best - tolerance)


def calibrate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    lengths: Sequence[int] = (2048, 4096),
    depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    k: int = 256,
    probe: str = "passkey",
    save: bool = True,
) -> Calibration:
    """Measure needle recall per layer over lengths x depths and recommend (and remember) a layer."""
    if probe not in PROBES:
        raise KvsieveError(f"Unknown probe '{probe}'; choose one of: {', '.join(PROBES)}.")
    if not lengths or not depths:
        raise KvsieveError("Calibration needs at least one length and one depth.")
    if k < 1 or k >= min(lengths):
        raise KvsieveError(f"Calibration k={k} must be at least 1 and below the shortest length {min(lengths)}.")
    limit = architecture(model).max_positions - 64
    if max(lengths) > limit:
        raise KvsieveError(f"Calibration length {max(lengths)} exceeds what this model can read (<= {limit}).")
    grid = [(n, d) for n in lengths for d in depths]
    total = torch.zeros(architecture(model).num_layers)
    for n, d in tqdm(grid, desc="calibrating", unit="probe"):
        total += layer_recall(model, tokenizer, PROBES[probe](tokenizer, n, d), k)
    recall = (total / len(grid)).tolist()
    result = Calibration(recall, recommend_layer(recall), k, probe, list(lengths), list(depths))
    if save:
        entries = _load_all()
        entries[model_key(model)] = asdict(result)
        path = calibration_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(entries, indent=1))
    return result


def plot_recall(result: Calibration, path: Path, title: str) -> None:
    """Write the per-layer recall curve as a PNG, the recommended layer marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(len(result.recall)), result.recall, marker="o")
    ax.axvline(result.layer, color="tab:red", linestyle="--", label=f"recommended layer {result.layer}")
    ax.set_xlabel("filter layer (0-based)")
    ax.set_ylabel(f"needle tokens in top-{result.k}")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
