"""One Markdown report that puts quality and cost side by side for every method that was run.

Inputs are the result files of `kvsieve niah`, `kvsieve ppl` and `kvsieve bench` (any of them);
the report copies them next to itself (`results/`), redraws the figures from them (`figures/`)
and writes tables whose every number comes from those files. Nothing is typed in by hand, so
`docs/RESULTS.md` is regenerated, never edited.
"""

from __future__ import annotations

import os
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsieve import figures
from kvsieve.eval import niah, records
from kvsieve.eval import report_leaderboard as board_sections
from kvsieve.eval import report_sections as sections
from kvsieve.eval.bench import plot_scaling
from kvsieve.eval.leaderboard import KEEP_AT, repeat_of
from kvsieve.eval.report_results import GLANCE_BUDGET, Results
from kvsieve.eval.report_sections import machine_line, measured_on, spread
from kvsieve.eval.ruler import TASKS


def ruler_sections(report: Results, root: Path) -> list[str]:
    """Per RULER length: the leaderboard, its figure, which method when and full attention's calibration."""
    lines = []
    for length, board in report.ruler_boards.items():
        calibration = report.calibrations[length]
        tasks = [t for t in TASKS if t in calibration]
        calibrated = board_sections.calibration_section(calibration, KEEP_AT, tasks)
        model = report.ruler["settings"].get("model") or "SmolLM2-135M-Instruct"
        title = f"RULER leaderboard: {model}, {length} tokens ({report.ruler['settings'].get('dtype', 'float32')})"
        where = measured_on(report.sources["ruler"])
        if not board.tasks:
            none = f"Full attention scores below {KEEP_AT:g} on every task run."
            lines += ["", f"## {title}", "", where, "", none, *calibrated]
            continue
        figure = board_sections.plot_board(board, root / "figures" / f"ruler_{length}.png", title)

        def speedup(method: str, budget: float | None, length: int = length) -> float | None:
            cost = report.cost(method, length) if report.bench_summary else None
            if not cost or not cost["speedup"]:
                return None
            share = report.bench_share(method, length)
            if budget is not None and (share is None or abs(share - budget) > 0.005):
                return None  # the bench ran another budget: its speed is not this row's
            return cost["speedup"][1]

        label = (
            f"TTFT speedup: the median of ratios to full attention from the bench at {length} tokens, on rows whose "
            "budget the bench ran (`-` on the others: a budget's own speed, not another's)."
        )
        methods = list(dict.fromkeys(e.method for e in board.entries if e.method != "full" and not repeat_of(e.method)))
        seeds_first = [m for m in board_sections.SEEDS if m in methods]
        seeds_first += [m for m in methods if m not in board_sections.SEEDS]
        lines += [
            *board_sections.leaderboard_section(board, figure, root, speedup, title, label, where),
            *board_sections.which_method_when(board, seeds_first),
            *calibrated,
        ]
    return lines


def plot_pareto(points: list[dict[str, Any]], path: Path, baseline: str = "full", quality: str = "") -> Path:
    """Quality (`quality` names it: RULER's average, else the probes' hits) against time-to-first-token speedup
    (left) and against peak memory (right), one point per method, both against `baseline` at the bench's longest
    length; marker area is the KV cache kept."""
    plt = figures.pyplot()

    length = points[0]["length"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2), sharey=True)
    panels = [
        ("speedup", f"time-to-first-token speedup vs {baseline} at {length} tokens (log; right is faster)"),
        ("memory_ratio", f"peak memory vs {baseline} at {length} tokens (weights included; left is smaller)"),
    ]
    for ax, (key, label) in zip(axes, panels, strict=True):
        for i, point in enumerate(points):
            accuracy = point["quality"]
            ax.scatter(point[key], accuracy, s=30 + 400 * point["kv_ratio"], alpha=0.55, color=f"C{i % 10}")
            ax.annotate(
                point["method"],
                (point[key], accuracy),
                fontsize=7,
                xytext=(5, 2 + 7 * (i % 3)),
                textcoords="offset points",
            )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    axes[0].set_ylabel(quality or "needle + passkey hits (share of cases)")
    fig.suptitle(f"What each preset trades (marker area: KV entries kept after prefill, vs {baseline}'s)")
    return figures.save(fig, path, dpi=110)


def kvpress_section(document: dict[str, Any], link: str) -> list[str]:
    """The optional comparison with NVIDIA's kvpress (benchmarks/kvpress_compare.py)."""
    versions = document["versions"]
    lines = [
        "",
        "## Against NVIDIA's kvpress (optional)",
        "",
        f"`benchmarks/kvpress_compare.py`, kvpress {versions['kvpress']} with transformers {versions['transformers']} "
        f"in a separate environment, on {machine_line(document['machine'])}. Both libraries compress the "
        "prefilled cache of the same needle prompt (depth 0.5) to the same number of entries per layer and KV head. "
        "Agreement: share of kvpress's kept positions that kvsieve keeps too, over layers and KV heads. Time: "
        "prefill + compression, kvpress / kvsieve within a repeat (above 1: kvsieve is faster). Peak: each "
        "library's prefill + compression in its own process, peak resident set (weights included) kvsieve / "
        "kvpress, pairs of repeats (below 1: kvsieve's peak is lower; files from before this column show -).",
        "",
        "| press | prompt tokens | kept | selection agreement | same greedy answer | needle in answer "
        "(kvsieve / kvpress) | time kvpress / kvsieve (min/med/max) | peak MB kvsieve / kvpress (median) "
        "| peak kvsieve / kvpress (min/med/max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in document["rows"]:
        yes = {True: "yes", False: "no"}
        needle = r["needle_in_answer"]
        peaks = r.get("peak_mb")
        peak_mb = "-"
        if peaks:
            peak_mb = f"{statistics.median(peaks['kvsieve']):.0f} / {statistics.median(peaks['kvpress']):.0f}"
        peak_ratio = spread(r["peak_kvsieve_over_kvpress"], 3) if peaks else "-"
        lines.append(
            f"| {r['press']} | {r['length']} | {r['kept']} | {r['agreement']:.4f} | {yes[r['same_answer']]} "
            f"| {yes[needle['kvsieve']]} / {yes[needle['kvpress']]} "
            f"| {spread(r['kvpress_over_kvsieve'])} | {peak_mb} | {peak_ratio} |"
        )
    return [*lines, "", f"Rows: [{Path(link).name}]({link})."]


def write_report(
    out: Path,
    niah_files: Sequence[Path] = (),
    ppl_files: Sequence[Path] = (),
    bench_files: Sequence[Path] = (),
    notes: Path | None = None,
    baseline: str = "full",
    kvpress_file: Path | None = None,
    ruler_files: Sequence[Path] = (),
    calibration_files: Sequence[Path] = (),
) -> Path:
    """Write the Markdown report to `out`, with `results/` (copied inputs) and `figures/` beside it.

    Several files of one kind are merged: each method is reported from the first file that has it
    (bench ratios are always taken within one run).
    """
    niah_docs = [records.load(p, "niah") for p in niah_files]
    ppl_docs = [records.load(p, "ppl") for p in ppl_files]
    bench_docs = [records.load(p, "bench") for p in bench_files]
    ruler_docs = [records.load(p, "ruler") for p in ruler_files]
    calibration_docs = [records.load(p, "ruler") for p in calibration_files]
    given = [*niah_files, *ppl_files, *bench_files, *ruler_files, *calibration_files]
    for document, path in zip([*niah_docs, *ppl_docs, *bench_docs, *ruler_docs, *calibration_docs], given, strict=True):
        document["file"] = Path(path).name  # a section merged from several machines names each one's files
    kvpress = records.load(kvpress_file, "kvpress") if kvpress_file else None
    report = Results(niah_docs, ppl_docs, bench_docs, baseline, ruler_docs, calibration_docs)
    records.check_writable(out)
    root = out.parent
    results, figures = root / "results", root / "figures"
    results.mkdir(exist_ok=True)
    copied = []
    for source in map(Path, [*niah_files, *ppl_files, *bench_files, *ruler_files, *calibration_files]):
        if results.resolve() in source.resolve().parents:  # already under results/ (in a folder of its own too)
            target = results / source.resolve().relative_to(results.resolve())
        else:
            target = results / source.name
            shutil.copyfile(source, target)
        copied.append(target)
    heatmaps = {
        d["settings"]["probe"]: niah.plot_heatmaps(d, figures, prefix=d["settings"]["probe"], each=False)[-1]
        for d in report.niah_docs
    }
    scaling = plot_scaling(report.bench_summary, figures / "scaling.png") if bench_docs else None
    points = report.points()
    quality = f"RULER average / 100 (KV {GLANCE_BUDGET:g} of the prompt)" if ruler_docs else ""
    rated = [point for point in points if point["quality"] is not None]
    pareto = plot_pareto(rated, figures / "pareto.png", baseline, quality) if rated else None
    commands = [  # as a reader runs them again: each writes the copy the report reads (records.runnable_command)
        records.runnable_command(command, Path(os.path.relpath(target)).as_posix())
        for d, target in zip(report.documents, copied, strict=True)
        for command in records.commands_of(d)
    ]
    kinds = ["niah"] * len(niah_docs) + ["ppl"] * len(ppl_docs) + ["bench"] * len(bench_docs)
    kinds += ["ruler"] * len(ruler_docs) + ["ruler-calibration"] * len(calibration_docs)
    inputs = " ".join(f"--{kind} {p.relative_to(root).as_posix()}" for kind, p in zip(kinds, copied, strict=True))
    commands += [
        records.command_line(),
        f"# regenerate from the copies: cd {root.as_posix()} && kvsieve report {inputs} --out {out.name}",
    ]
    lines = [
        *sections.header(report, commands, ruler_sections(report, root)),
        *sections.speed_note(report),
        *sections.glance(report, pareto, root),
        *sections.side_by_side(report),
        *sections.choosing(report),
        *(line for board in report.ruler_boards.values() for line in board_sections.per_task_section(board)),
        *sections.niah_section(report, heatmaps, root),
        *sections.ppl_section(report),
        *sections.cost_section(report, scaling, root),
        "",
        "Raw rows: " + ", ".join(f"[{p.name}]({p.relative_to(root).as_posix()})" for p in copied) + ".",
    ]
    if kvpress:
        target = results / Path(kvpress_file).name
        if Path(kvpress_file).resolve() != target.resolve():
            shutil.copyfile(kvpress_file, target)
        lines += kvpress_section(kvpress, target.relative_to(root).as_posix())
    if notes:
        link = Path(os.path.relpath(notes, root)).as_posix()
        lines += ["", f"More measurements (per-method studies, longer prompts, ablations): [{notes.name}]({link})."]
    out.write_text("\n".join(lines) + "\n")
    return out
