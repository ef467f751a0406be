"""Needle-in-a-haystack (and passkey) grids: lengths x depths x methods, greedy answers, heatmaps.

Every case is scored offline: ROUGE-1 recall of the answer against the reference answer and
whether the reference appears as whole words ("hit"). Rows are saved as they come and a rerun
with the same settings skips finished cases (see records.py). The heatmaps are the papers'
figures: context length on x, needle depth on y, colour = ROUGE-1 recall.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvsieve import figures
from kvsieve.data import PROBES, prompt_case
from kvsieve.errors import KvsieveError
from kvsieve.eval import records
from kvsieve.eval.grading import contains, rouge1_recall
from kvsieve.eval.methods import check_lengths, specs_from_settings
from kvsieve.models import architecture
from kvsieve.spec import MethodSpec


def settings(specs: Mapping[str, MethodSpec], probe: str, max_new_tokens: int, model: dict[str, Any]) -> dict[str, Any]:
    """What makes a grid's rows comparable (every method's exact spec, the model, its dtype and device);
    a resumed run must match it."""
    return {
        "methods": {name: spec.to_dict() for name, spec in specs.items()},
        "probe": probe,
        "max_new_tokens": max_new_tokens,
        **model,
    }


def run_grid(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    specs: Mapping[str, MethodSpec],
    lengths: Sequence[int],
    depths: Sequence[float],
    out: Path,
    *,
    probe: str = "needle",
    max_new_tokens: int = 48,
    model_name: str | None = None,
    fresh: bool = False,
) -> dict[str, Any]:
    """Run every (length, depth, method) case not yet in `out`, saving after each; return the document.

    Lengths are prompt tokens (context + template + question); depths are in [0, 1].
    """
    from kvsieve.decode import Sampling
    from kvsieve.engine import run

    if probe not in PROBES:
        raise KvsieveError(f"Unknown probe '{probe}'; choose from {', '.join(PROBES)}.")
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise KvsieveError(f"Depths must be a non-empty list of fractions in [0, 1], got {list(depths)}.")
    check_lengths(specs, list(lengths), max_new_tokens, architecture(model).max_positions)
    methods = list(specs)
    document = records.open_results(
        out, "niah", settings(specs, probe, max_new_tokens, records.model_settings(model, model_name)), fresh=fresh
    )
    done = {(r["method"], r["length"], r["depth"]) for r in document["rows"]}
    todo = [(n, d, m) for n in lengths for d in depths for m in methods if (m, n, d) not in done]
    sampling = Sampling(max_new_tokens)
    cases = {(n, d): prompt_case(tokenizer, probe, n, d) for n, d in dict.fromkeys((n, d) for n, d, _ in todo)}
    for length, depth, method in tqdm(todo, desc=f"{probe} grid", unit="case"):
        case, prompt = cases[(length, depth)]
        result = run(model, tokenizer, prompt, method=specs[method], sampling=sampling)
        select = next((s for s in result.stages if s.stage == "select"), None)
        document["rows"].append(
            {
                "method": method,
                "length": length,
                "depth": depth,
                "prompt_tokens": result.prompt_tokens,
                "answer": result.text,
                "reference": case.answer,
                "rouge1": rouge1_recall(result.text, case.answer),
                "hit": contains(result.text, case.answer),
                "ttft_s": result.prefill_seconds,
                "kv_length": result.prefill_kv_length,
                "layer": select.details.get("layer") if select else None,
            }
        )
        records.save(out, document)
    if not todo:
        records.save(out, document)  # refresh command and machine even when nothing was left to run
    return document


def summarize(rows: list[dict]) -> dict[str, dict[str, Any]]:
    """Per method: cases, hits, mean ROUGE-1 recall overall and per length, and how many of its answers are full
    attention's answer to the same case, word for word (`same_as_full` of `compared`, the cases full attention ran
    too). A weak model misses cases with full attention as well; agreement with full says what the method changed."""
    full = {(r["length"], r["depth"]): r["answer"] for r in rows if r["method"] == "full"}
    summary = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        lengths = sorted({r["length"] for r in mine})
        shared = [r for r in mine if (r["length"], r["depth"]) in full]
        summary[method] = {
            "cases": len(mine),
            "hits": sum(r["hit"] for r in mine),
            "rouge1": sum(r["rouge1"] for r in mine) / len(mine),
            "by_length": {
                n: sum(r["rouge1"] for r in mine if r["length"] == n) / sum(r["length"] == n for r in mine)
                for n in lengths
            },
            "compared": len(shared),
            "same_as_full": sum(r["answer"] == full[(r["length"], r["depth"])] for r in shared),
        }
    return summary


def _grid(rows: list[dict], method: str) -> tuple[list[int], list[float], list[list[float]]]:
    """(lengths, depths, scores[depth][length]) of one method; missing cases are NaN."""
    mine = [r for r in rows if r["method"] == method]
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    score = {(r["length"], r["depth"]): r["rouge1"] for r in mine}
    return lengths, depths, [[score.get((n, d), float("nan")) for n in lengths] for d in depths]


def plot_heatmaps(document: dict[str, Any], folder: Path, prefix: str = "niah", each: bool = True) -> list[Path]:
    """`{prefix}_all.png`, every method's heatmap side by side (the last path returned), after one PNG per method
    where `each` (`kvsieve niah --plots`; a report shows the combined one only)."""
    plt = figures.pyplot()

    rows = document["rows"]
    if not rows:
        raise KvsieveError("The grid has no finished cases to plot yet.")
    folder.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    summary = summarize(rows)
    specs = specs_from_settings(document["settings"]["methods"])
    probe = document["settings"]["probe"]

    def draw(ax, method: str) -> object:
        lengths, depths, scores = _grid(rows, method)
        image = ax.imshow(scores, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("needle depth")
        for y, line in enumerate(scores):
            for x, value in enumerate(line):
                if value == value:  # not NaN
                    ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=8)
        ax.set_title(f"{method}: mean ROUGE-1 {summary[method]['rouge1']:.2f}", fontsize=10)
        return image

    paths = []
    for method in methods if each else ():
        fig, ax = plt.subplots(figsize=(5, 3.6))
        image = draw(ax, method)
        fig.colorbar(image, ax=ax, label="ROUGE-1 recall")
        fig.suptitle(f"{probe}: {specs[method].describe()}", fontsize=8)
        path = figures.save(fig, folder / f"{prefix}_{method}.png", dpi=110)
        paths.append(path)
    columns = min(len(methods), 5)
    grid_rows = -(-len(methods) // columns)
    fig, axes = plt.subplots(grid_rows, columns, figsize=(3.4 * columns, 3 * grid_rows), squeeze=False)
    for ax, method in zip(axes.flat, methods, strict=False):
        draw(ax, method)
    for ax in list(axes.flat)[len(methods) :]:
        ax.axis("off")
    fig.suptitle(f"{probe} retrieval (ROUGE-1 recall of greedy answers)")
    path = figures.save(fig, folder / f"{prefix}_all.png", dpi=100)
    return [*paths, path]
