"""Choosing GemFilter's filter layer by measurement (the paper's Figure 5 analysis).

For needle probes (passkey by default: on SmolLM2 it gives a clear per-layer signal, the
essay needle a noisy one) of a few lengths and depths, one full forward pass scores every layer the way
GemFilter would and records the fraction of needle tokens inside that layer's top-k. The
recommended layer is the earliest one within `tolerance` of the best recall (earlier = cheaper
first pass). The choice is remembered per model in the kvsieve cache dir (`select/layers.py`)
and used by `GemFilter(layer="calibrated")` or `GemFilter.calibrated(model)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve import figures
from kvsieve.attention import attention_hooks
from kvsieve.data import PROBES, Case
from kvsieve.errors import KvsieveError
from kvsieve.models import architecture
from kvsieve.prompt import build_prompt
from kvsieve.select import layers
from kvsieve.select.gemfilter import GemFilter


@dataclass
class Calibration:
    recall: list[float]  # per layer: mean fraction of needle tokens in GemFilter's top-k
    layer: int  # recommended filter layer
    k: int
    probe: str
    lengths: list[int]
    depths: list[float]


def needle_token_indices(
    tokenizer: PreTrainedTokenizerBase, case: Case, context_start: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Prompt positions of the tokens that overlap the needle's characters."""
    offsets = tokenizer(case.context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    lo, hi = case.needle_start, case.needle_start + len(case.needle)
    inside = [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]
    return torch.tensor(inside, dtype=torch.long, device=device) + context_start


def layer_recall(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    case: Case,
    k: int,
    selectors: Sequence[GemFilter] = (GemFilter(),),
) -> torch.Tensor:
    """(selectors, layers): per selector and layer, the fraction of the needle's tokens in its top-k there.

    Each selector gives scoring options (queries, softmax, pooling kernel, blocks; default the
    paper's); its layer and k are ignored, every layer is scored at `k`. One forward pass serves
    all selectors.
    """
    prompt = build_prompt(tokenizer, case.context, case.question)
    needle = needle_token_indices(tokenizer, case, prompt.context_start, model.device)
    recall = torch.zeros(len(selectors), architecture(model).num_layers, device="cpu")  # filled with Python floats

    def score(layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        for i, selector in enumerate(selectors):
            tail_len = prompt.tail_len if selector.keep_tail else 0
            selected = selector.choose(query[0, :, -selector.queries :], key[0], k, tail_len)
            recall[i, layer] = float(torch.isin(needle, selected).float().mean())

    with torch.no_grad(), attention_hooks(observers=[score]):
        model.model(input_ids=prompt.ids.to(model.device), use_cache=False)
    return recall


def recommend_layer(recall: Sequence[float], tolerance: float = 0.05) -> int:
    """Earliest layer whose recall is within `tolerance` of the best layer's (NaN: a sliding layer, never a
    candidate)."""
    best = max(r for r in recall if r == r)
    return next(i for i, r in enumerate(recall) if r >= best - tolerance)


def calibrate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    lengths: Sequence[int] = (2048, 4096),
    depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    k: int = 256,
    probe: str = "passkey",
    save: bool = True,
    selector: GemFilter | None = None,
) -> Calibration:
    """Measure needle recall per layer over lengths x depths and recommend (and remember) a layer.

    A hybrid model's sliding layers are not candidates (their recall is NaN): their last queries see only
    their window.

    `selector`'s scoring options (default: the paper's) decide what each layer would keep.
    """
    if probe not in PROBES:
        raise KvsieveError(f"Unknown probe '{probe}'; choose one of: {', '.join(PROBES)}.")
    if not lengths or not depths:
        raise KvsieveError("Calibration needs at least one length and one depth.")
    if k < 1 or k >= min(lengths):
        raise KvsieveError(f"Calibration k={k} must be at least 1 and below the shortest length {min(lengths)}.")
    if not architecture(model).global_layers:
        raise KvsieveError(
            "Every layer of this model attends within a sliding window: there is no filter layer to calibrate."
        )
    limit = architecture(model).max_positions - 64
    if max(lengths) > limit:
        raise KvsieveError(f"Calibration length {max(lengths)} exceeds what this model can read (<= {limit}).")
    grid = [(n, d) for n in lengths for d in depths]
    total = torch.zeros(architecture(model).num_layers, device="cpu")
    for n, d in tqdm(grid, desc="calibrating", unit="probe"):
        total += layer_recall(model, tokenizer, PROBES[probe](tokenizer, n, d), k, [selector or GemFilter()])[0]
    total[[j for j, window in enumerate(architecture(model).windows) if window is not None]] = float("nan")
    recall = (total / len(grid)).tolist()  # a sliding layer's NaN: GemFilter filters at global layers only
    result = Calibration(recall, recommend_layer(recall), k, probe, list(lengths), list(depths))
    if save:
        layers.record(model, asdict(result))
    return result


def plot_recall(result: Calibration, path: Path, title: str) -> None:
    """Write the per-layer recall curve as a PNG, the recommended layer marked."""
    plt = figures.pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(len(result.recall)), result.recall, marker="o")
    ax.axvline(result.layer, color="tab:red", linestyle="--", label=f"recommended layer {result.layer}")
    ax.set_xlabel("filter layer (0-based)")
    ax.set_ylabel(f"needle tokens in top-{result.k}")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend()
    figures.save(fig, path, dpi=120)
