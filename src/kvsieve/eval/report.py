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
from datetime import date
from pathlib import Path
from typing import Any

from kvsieve import figures
from kvsieve.errors import KvsieveError
from kvsieve.eval import niah, records, ruler
from kvsieve.eval.bench import plot_scaling, summarize
from kvsieve.eval.methods import specs_from_settings
from kvsieve.registry import REGISTRY

GLANCE_BUDGET = 0.25  # the RULER budget the glance table and the pareto figure read: the presets' 1024 entries at 4K


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _spread(values: Sequence[float] | None, digits: int = 2) -> str:
    return "-" if values is None else " / ".join(f"{v:.{digits}f}" for v in values)


def _machine_line(machine: dict[str, Any]) -> str:
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ", no GPU"
    return (
        f"{machine['cpu']}, {machine['cores']} cores ({machine['torch_threads']} torch threads), "
        f"{machine['memory_gb']} GB RAM{gpu}; Python {machine['python']}, torch {machine['torch']}, "
        f"transformers {machine['transformers']}"
    )


def _order(methods: Sequence[str]) -> list[str]:
    """Methods in the library's order (full first), unknown names last."""
    known = [m for m in REGISTRY if m in methods]
    return known + sorted(set(methods) - set(known))


def merge(documents: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One document from several result files of one kind: each method's rows (and spec) come from the
    first file that has the method, so a later run can add methods next to an earlier one."""
    if not documents:
        return None
    first = documents[0]
    merged = {**first, "settings": {**first["settings"], "methods": {}}, "rows": []}
    for doc in documents:
        new = [m for m in dict.fromkeys(r["method"] for r in doc["rows"]) if m not in merged["settings"]["methods"]]
        merged["settings"]["methods"].update({m: doc["settings"]["methods"][m] for m in new})
        merged["rows"] += [r for r in doc["rows"] if r["method"] in new]
    return merged


def _bench_summary(documents: Sequence[dict[str, Any]], baseline: str) -> list[dict]:
    """Cost summaries with ratios taken within each bench run (each run has its own baseline rows);
    a method measured in several runs is reported from the first."""
    summary, seen = [], set()
    for doc in documents:
        mine = [s for s in summarize(doc["rows"], baseline) if s["method"] not in seen]
        seen |= {s["method"] for s in mine}
        summary += mine
    return summary


class Report:
    """Collects the result documents and renders the Markdown."""

    def __init__(
        self,
        niah_docs: Sequence[dict[str, Any]],
        ppl_docs: Sequence[dict[str, Any]] = (),
        bench_docs: Sequence[dict[str, Any]] = (),
        baseline: str = "full",
        ruler_docs: Sequence[dict[str, Any]] = (),
    ) -> None:
        if not niah_docs and not ppl_docs and not bench_docs and not ruler_docs:
            raise KvsieveError("Nothing to report: give at least one of --niah, --ppl, --bench, --ruler.")
        probes = dict.fromkeys(d["settings"]["probe"] for d in niah_docs)
        self.niah_docs = [merge([d for d in niah_docs if d["settings"]["probe"] == p]) for p in probes]
        self.ppl, self.bench, self.baseline = merge(ppl_docs), merge(bench_docs), baseline
        self.bench_docs = list(bench_docs)
        self.ruler = merge(ruler_docs)
        self.ruler_summary = ruler.summarize(self.ruler["rows"]) if self.ruler else {}
        self.documents = [*niah_docs, *ppl_docs, *bench_docs, *ruler_docs]
        rows = [r for d in self.documents for r in d["rows"]]
        if not rows:
            raise KvsieveError("The result files have no rows yet; run the evaluations first.")
        self.methods = _order({r["method"] for r in rows})
        self.bench_summary = _bench_summary(bench_docs, baseline)
        lengths = {r.get("requested_length", r.get("length")) for r in rows}
        self.lengths = sorted(lengths)

    # ------------------------------------------------------------------ lookups

    def _descriptions(self) -> tuple[dict[str, str], bool]:
        """Each method's configuration as recorded in the result files it is reported from (the first file of
        each kind that has it, `merge`), and whether those disagree."""
        seen: dict[str, set[str]] = {}
        for doc in [*self.niah_docs, *(d for d in (self.ppl, self.bench, self.ruler) if d is not None)]:
            for name, spec in specs_from_settings(doc["settings"]["methods"]).items():
                seen.setdefault(name, set()).add(spec.describe())
        return {name: " / ".join(sorted(d)) for name, d in seen.items()}, any(len(d) > 1 for d in seen.values())

    def _niah(self, doc: dict[str, Any], method: str, length: int) -> str:
        mine = [r for r in doc["rows"] if r["method"] == method and r["length"] == length]
        if not mine:
            return "-"
        mean = sum(r["rouge1"] for r in mine) / len(mine)
        return f"{mean:.2f} ({sum(r['hit'] for r in mine)}/{len(mine)})"

    def _ppl(self, method: str, length: int) -> tuple[float, float | None] | None:
        if self.ppl is None:
            return None
        rows = {(r["method"], r["length"]): r["ppl"] for r in self.ppl["rows"]}
        if (method, length) not in rows:
            return None
        base = rows.get((self.baseline, length))
        return rows[(method, length)], (rows[(method, length)] / base if base else None)

    def _cost(self, method: str, length: int) -> dict[str, Any] | None:
        return next((s for s in self.bench_summary if s["method"] == method and s["length"] == length), None)

    def _decode_ratio(self, method: str, length: int) -> float | None:
        """Median decode tokens/s against the baseline's, paired within one run's repeats."""
        mine = self._cost(method, length)
        return mine["decode_ratio"][1] if mine and mine.get("decode_ratio") else None

    # ------------------------------------------------------------------ sections

    def header(self, commands: list[str]) -> list[str]:
        machines = {_machine_line(d["machine"]) for d in self.documents}
        models = {
            f"{s.get('model') or 'embedded SmolLM2-135M-Instruct'} ({s.get('dtype') or 'float32'})"
            for s in (d["settings"] for d in self.documents)
        }
        lines = [
            "# kvsieve results",
            "",
            f"Generated by `kvsieve report` on {date.today().isoformat()} from the result files in `results/`; "
            "every number below is read from them. Regenerate rather than edit.",
            "",
            f"**Machine**: {'; '.join(sorted(machines))}.",
            f"**Model**: {', '.join(sorted(models))}.",
            "",
            "Time and memory are ratios against full attention measured side by side in one `kvsieve bench` run "
            "(each configuration in its own process, configurations interleaved within every repeat, ratios taken "
            "within a repeat), given as min / median / max over the repeats. `peak MB` is the worker's peak "
            "resident set (weights included); decode speed is the median tokens/s over the decoded tokens.",
            "",
            "## Commands",
            "",
            "```bash",
            *commands,
            "```",
            "",
            "## Configurations",
            "",
            "| method | configuration |",
            "|---|---|",
        ]
        descriptions, differ = self._descriptions()
        if differ:
            lines.insert(
                -4, "**Warning**: the result files were made with different method settings; compare with care.\n"
            )
        lines += [f"| {m} | {descriptions.get(m, '-')} |" for m in self.methods]
        return lines

    def speed_note(self) -> list[str]:
        """A warning when merged bench runs ran at different absolute speeds (compare ratios, not seconds)."""
        if len(self.bench_docs) < 2:
            return []
        notes = []
        for length in self.lengths:
            medians = []
            for i, doc in enumerate(self.bench_docs, 1):
                base = [
                    r["ttft_s"] for r in doc["rows"] if r["method"] == self.baseline and r["requested_length"] == length
                ]
                if base:
                    medians.append((i, statistics.median(base)))
            if len(medians) > 1 and max(m for _, m in medians) > 1.2 * min(m for _, m in medians):
                runs = ", ".join(f"{m:.2f} s in bench run {i}" for i, m in medians)
                notes.append(f"{self.baseline} at {length} tokens: {runs}")
        if not notes:
            return []
        return [
            "",
            "**Note**: the bench runs merged here ran at different absolute speeds (each result file names its "
            "machine, listed above) ("
            + "; ".join(notes)
            + "). Each method's seconds come from its own run; compare methods by their ratios to "
            f"{self.baseline}, which are always taken within one run.",
        ]

    def _ruler_average(self, method: str, mode: str = "question") -> float | None:
        """The method's RULER average (0-100) at the glance budget (`GLANCE_BUDGET` of the prompt; a method without a
        KV budget as registered), None where it was not run so."""
        for budget in (GLANCE_BUDGET, None):
            if (method, budget, mode) in self.ruler_summary:
                return self.ruler_summary[(method, budget, mode)]["average"]
        return None

    def points(self) -> list[dict[str, Any]]:
        """One point per method run on both a quality run and the bench: its quality (RULER's average at the glance
        budget where RULER ran, else its hits over every probe case), and its time to first token, peak memory and KV
        entries against the baseline's at the longest bench length."""
        if not self.bench_summary or not (self.niah_docs or self.ruler):
            return []
        length = max(s["length"] for s in self.bench_summary)
        kv = {r["method"]: r["prefill_kv_length"] for r in self.bench["rows"] if r["requested_length"] == length}
        points = []
        for method in self.methods:
            rows = [r for d in self.niah_docs for r in d["rows"] if r["method"] == method]
            average = self._ruler_average(method) if self.ruler else None
            cost = self._cost(method, length)
            if (not rows and average is None) or cost is None or not cost["speedup"] or method not in kv:
                continue
            if not kv.get(self.baseline):
                continue
            points.append(
                {
                    "method": method,
                    "length": length,
                    "quality": average / 100 if self.ruler else sum(r["hit"] for r in rows) / len(rows),
                    "hits": sum(r["hit"] for r in rows),
                    "cases": len(rows),
                    "speedup": cost["speedup"][1],
                    "memory_ratio": cost["memory_ratio"][1],
                    "kv_ratio": kv[method] / kv[self.baseline],
                }
            )
        return points

    def glance(self, figure: Path | None, root: Path) -> list[str]:
        """Each method in one row: probe hits per length, then its cost against the baseline at the longest length."""
        points = {p["method"]: p for p in self.points()}
        if not points:
            return []
        length = next(iter(points.values()))["length"]
        lengths = sorted({r["length"] for d in self.niah_docs for r in d["rows"]})
        probes = [d["settings"]["probe"] for d in self.niah_docs]
        head = ["method", "provenance", *(f"{p} hits @{n}" for p in probes for n in lengths)]
        if self.ruler:
            head += [f"RULER average, KV {GLANCE_BUDGET:g} of the prompt (question / agnostic)"]
        head += [f"TTFT speedup vs {self.baseline} @{length} (min/med/max)", f"peak memory vs {self.baseline}"]
        head += [f"KV entries vs {self.baseline}"]
        lines = [
            "",
            "## Every preset at a glance",
            "",
            "Hits are cases whose answer holds the reference as whole words, over the depths run; cost columns come "
            f"from the bench at {length} prompt tokens (medians of ratios taken within a repeat)."
            + (
                " The RULER column (and the figure's quality axis) is the method's RULER average with its KV budget "
                f"at {GLANCE_BUDGET:g} of the prompt (the presets' default 1024 entries at 4K); a method without a KV "
                "budget keeps every entry; `-`: no question-agnostic run (no scorer)."
                if self.ruler
                else ""
            ),
            "",
        ]
        if figure is not None:
            lines += [f"![quality against speed and memory]({figure.relative_to(root).as_posix()})", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for method, point in points.items():
            summary = REGISTRY[method].summary if method in REGISTRY else ""
            provenance = summary[summary.rfind("[") + 1 : -1] if summary.endswith("]") else "-"
            cells = [method, provenance]
            for doc in self.niah_docs:
                for n in lengths:
                    mine = [r for r in doc["rows"] if r["method"] == method and r["length"] == n]
                    cells.append(f"{sum(r['hit'] for r in mine)}/{len(mine)}" if mine else "-")
            if self.ruler:
                cells.append(" / ".join(_fmt(self._ruler_average(method, mode), 1) for mode in ruler.MODES))
            cost = self._cost(method, length)
            cells += [_spread(cost["speedup"]), f"{point['memory_ratio']:.3f}", f"{point['kv_ratio']:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
        return lines

    def side_by_side(self) -> list[str]:
        lines = ["", "## Quality and cost side by side", ""]
        probes = [d["settings"]["probe"] for d in self.niah_docs]
        for length in self.lengths:
            head = ["method", *(f"{p} ROUGE-1 (hits)" for p in probes)]
            head += ["perplexity (vs full)", "TTFT s (med)", "speedup vs full (min/med/max)"]
            head += ["decode tok/s (vs full)", "peak MB (vs full)", "KV entries"]
            lines += [f"### {length} prompt tokens", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for method in self.methods:
                cells = [method, *(self._niah(d, method, length) for d in self.niah_docs)]
                ppl = self._ppl(method, length)
                cells.append("-" if ppl is None else f"{ppl[0]:.2f} ({_fmt(ppl[1], 3)})")
                cost = self._cost(method, length)
                if cost is None:
                    cells += ["-"] * 5
                else:
                    decode = self._decode_ratio(method, length)
                    memory = cost["memory_ratio"][1] if cost["memory_ratio"] else None
                    kv = [
                        r["prefill_kv_length"]
                        for r in self.bench["rows"]
                        if r["method"] == method and r["requested_length"] == length
                    ]
                    cells += [
                        f"{cost['ttft_s'][1]:.2f}",
                        _spread(cost["speedup"]),
                        f"{cost['decode_tokens_per_s'][1]:.1f} ({_fmt(decode)})",
                        f"{cost['peak_mb'][1]:.0f} ({_fmt(memory, 3)})",
                        str(max(kv)) if kv else "-",
                    ]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
        return lines

    def choosing(self) -> list[str]:
        """Computed statements at the longest benchmarked length: who is fastest, smallest, most accurate."""
        if not self.bench_summary:
            return []
        length = max(s["length"] for s in self.bench_summary)
        others = [s for s in self.bench_summary if s["length"] == length and s["method"] != self.baseline]
        others = [s for s in others if s["speedup"]]
        if not others:
            return []
        lines = [f"## Choosing at {length} tokens (computed from the tables)", ""]
        fastest = max(others, key=lambda s: s["speedup"][1])
        lines.append(
            f"- Fastest to the first token: **{fastest['method']}**, {fastest['speedup'][1]:.2f}x full (median)."
        )
        smallest = min(others, key=lambda s: s["memory_ratio"][1])
        lines.append(f"- Lowest peak memory: **{smallest['method']}**, {smallest['memory_ratio'][1]:.3f}x full's peak.")
        decoders = [(m, r) for m in self.methods if m != self.baseline and (r := self._decode_ratio(m, length))]
        if decoders:
            best, ratio = max(decoders, key=lambda pair: pair[1])
            lines.append(f"- Fastest decoding: **{best}**, {ratio:.2f}x full's tokens/s.")
        for doc in self.niah_docs:
            summary = niah.summarize([r for r in doc["rows"] if r["length"] == length])
            if self.baseline not in summary:
                continue
            base = summary[self.baseline]["rouge1"]
            kept = [m for m, s in summary.items() if m != self.baseline and s["rouge1"] >= base - 0.05]
            lines.append(
                f"- {doc['settings']['probe']} at {length}: full attention scores {base:.2f}; within 0.05 of it: "
                + (", ".join(f"**{m}**" for m in kept) if kept else "none")
                + "."
            )
        if self.ppl:
            ratios = [(m, p[1]) for m in self.methods if m != self.baseline and (p := self._ppl(m, length)) and p[1]]
            if ratios:
                best, ratio = min(ratios, key=lambda pair: pair[1])
                lines.append(f"- Closest perplexity to full: **{best}** ({ratio:.3f}x).")
        return [*lines, ""]

    def niah_section(self, figures: dict[str, Path], root: Path) -> list[str]:
        lines = []
        for doc in self.niah_docs:
            s = doc["settings"]
            probe = s["probe"]
            depths = sorted({r["depth"] for r in doc["rows"]})
            lengths = sorted({r["length"] for r in doc["rows"]})
            summary = niah.summarize(doc["rows"])
            lines += [
                "",
                f"## {probe.capitalize()} retrieval",
                "",
                f"Lengths {', '.join(map(str, lengths))} prompt tokens x depths {', '.join(f'{d:g}' for d in depths)}; "
                f"greedy answers of up to {s['max_new_tokens']} tokens scored by ROUGE-1 recall against the "
                "reference answer; a hit is the reference appearing as whole words; `answer = full's` counts the "
                "cases whose answer is full attention's answer to the same case, word for word.",
                "",
                f"![{probe} heatmaps]({figures[probe].relative_to(root).as_posix()})",
                "",
                "| method | cases | hits | answer = full's | mean ROUGE-1 | " + " | ".join(map(str, lengths)) + " |",
                "|" + "---|" * (5 + len(lengths)),
            ]
            for method in _order(summary):
                m = summary[method]
                per = " | ".join(_fmt(m["by_length"].get(n)) for n in lengths)
                same = f"{m['same_as_full']}/{m['compared']}" if m["compared"] and method != "full" else "-"
                lines.append(f"| {method} | {m['cases']} | {m['hits']} | {same} | {m['rouge1']:.3f} | {per} |")
        return lines

    def ppl_section(self) -> list[str]:
        if not self.ppl:
            return []
        s = self.ppl["settings"]
        lengths = sorted({r["length"] for r in self.ppl["rows"]})
        lines = [
            "",
            "## Perplexity",
            "",
            f"The {s['tokens']} essay tokens after position {s['text_end']}, teacher-forced after each method "
            "processed the preceding `length` tokens as its context (evicting after every step where the method "
            "does). Lower is better; in brackets the ratio to full attention at the same length.",
            "",
            "| method | " + " | ".join(str(n) for n in lengths) + " |",
            "|" + "---|" * (1 + len(lengths)),
        ]
        for method in self.methods:
            cells = []
            for n in lengths:
                ppl = self._ppl(method, n)
                cells.append("-" if ppl is None else f"{ppl[0]:.2f} ({_fmt(ppl[1], 3)})")
            if any(c != "-" for c in cells):
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
        return lines

    def cost_section(self, figure: Path | None, root: Path) -> list[str]:
        if not self.bench:
            return []
        s = self.bench["settings"]
        repeats = len({r["repeat"] for r in self.bench["rows"]})
        lines = [
            "",
            "## Cost against prompt length",
            "",
            f"{repeats} repeats, {s['decode_tokens']} decoded tokens per run.",
            "",
            f"![cost scaling]({figure.relative_to(root).as_posix()})" if figure else "",
            "",
            "| length | method | TTFT s (min/med/max) | speedup vs full | decode tok/s (min/med/max) | "
            "peak MB (min/med/max) | peak vs full | added MB (med) | added vs full |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in sorted(self.bench_summary, key=lambda c: (c["length"], self.methods.index(c["method"]))):
            lines.append(
                f"| {c['length']} | {c['method']} | {_spread(c['ttft_s'])} | {_spread(c['speedup'])} | "
                f"{_spread(c['decode_tokens_per_s'], 1)} | {_spread(c['peak_mb'], 0)} | "
                f"{_spread(c['memory_ratio'], 3)} | {c['added_mb'][1]:.0f} | {_spread(c['added_ratio'], 2)} |"
            )
        return lines


def ruler_section(document: dict[str, Any], figure: Path, root: Path) -> list[str]:
    """RULER's curves and, beside them, each configuration's average and per-task scores."""
    summary = ruler.summarize(document["rows"])
    tasks = [t for t in ruler.TASKS if any(r["task"] == t for r in document["rows"])]
    lengths = sorted({r["length"] for r in document["rows"]})
    samples = document["settings"]["samples"]
    lines = [
        "",
        "## RULER: score against the KV cache kept",
        "",
        f"NVIDIA's RULER tasks at {', '.join(map(str, lengths))} tokens (prompt plus answer), {samples} cases per "
        "task, generated by NVIDIA's own scripts with the model's tokenizer and scored by RULER's metrics (0-100). "
        "Each preset runs with its KV budget at each share of the prompt: with the question in the prompt, and "
        "question-agnostic (the context compressed by the method's scorer before the question is seen, as "
        "`--reuse-budget` stores it). Full attention is the ceiling; in brackets, each average against it. `KV kept` "
        "is the measured entries after the prefill (agnostic: the context's, before the question) over the prompt's "
        "tokens.",
        "",
        f"![RULER against KV kept]({figure.relative_to(root).as_posix()})",
        "",
        "| method | budget | mode | KV kept | RULER average | " + " | ".join(tasks) + " |",
        "|---|---|---|---|---|" + "---|" * len(tasks),
    ]
    ceiling = summary.get(("full", None, "question"), {}).get("average")
    for (method, budget, mode), s in sorted(
        summary.items(), key=lambda item: (item[0][2] != "question", item[0][0] != "full", item[0][0], item[0][1] or 1)
    ):
        against = f" ({s['average'] - ceiling:+.1f})" if ceiling is not None and method != "full" else ""
        cells = [method, "-" if budget is None else f"{budget:g}", mode, f"{s['kept']:.2f}"]
        cells += [f"{s['average']:.1f}{against}", *(_fmt(s["tasks"].get(t), 1) for t in tasks)]
        lines.append("| " + " | ".join(cells) + " |")
    if document.get("seconds") is not None:
        lines += ["", f"The sweep's answers took {document['seconds']:.0f} s on this machine."]
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
        f"in a separate environment, on {_machine_line(document['machine'])}. Both libraries compress the "
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
        peak_ratio = _spread(r["peak_kvsieve_over_kvpress"], 3) if peaks else "-"
        lines.append(
            f"| {r['press']} | {r['length']} | {r['kept']} | {r['agreement']:.4f} | {yes[r['same_answer']]} "
            f"| {yes[needle['kvsieve']]} / {yes[needle['kvpress']]} "
            f"| {_spread(r['kvpress_over_kvsieve'])} | {peak_mb} | {peak_ratio} |"
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
) -> Path:
    """Write the Markdown report to `out`, with `results/` (copied inputs) and `figures/` beside it.

    Several files of one kind are merged: each method is reported from the first file that has it
    (bench ratios are always taken within one run).
    """
    niah_docs = [records.load(p, "niah") for p in niah_files]
    ppl_docs = [records.load(p, "ppl") for p in ppl_files]
    bench_docs = [records.load(p, "bench") for p in bench_files]
    ruler_docs = [records.load(p, "ruler") for p in ruler_files]
    kvpress = records.load(kvpress_file, "kvpress") if kvpress_file else None
    report = Report(niah_docs, ppl_docs, bench_docs, baseline, ruler_docs)
    records.check_writable(out)
    root = out.parent
    results, figures = root / "results", root / "figures"
    results.mkdir(exist_ok=True)
    copied = []
    for source in [*niah_files, *ppl_files, *bench_files, *ruler_files]:
        target = results / Path(source).name
        if Path(source).resolve() != target.resolve():
            shutil.copyfile(source, target)
        copied.append(target)
    heatmaps = {
        d["settings"]["probe"]: niah.plot_heatmaps(d, figures, prefix=d["settings"]["probe"])[-1]
        for d in report.niah_docs
    }
    scaling = plot_scaling(report.bench_summary, figures / "scaling.png") if bench_docs else None
    points = report.points()
    quality = f"RULER average / 100 (KV {GLANCE_BUDGET:g} of the prompt)" if ruler_docs else ""
    pareto = plot_pareto(points, figures / "pareto.png", baseline, quality) if points else None
    curves = ruler.plot_curves(report.ruler, figures / "ruler.png") if report.ruler else None
    commands = [command for d in report.documents for command in records.commands_of(d)]
    kinds = ["niah"] * len(niah_docs) + ["ppl"] * len(ppl_docs) + ["bench"] * len(bench_docs)
    kinds += ["ruler"] * len(ruler_docs)
    inputs = " ".join(f"--{kind} {p.relative_to(root).as_posix()}" for kind, p in zip(kinds, copied, strict=True))
    commands += [
        records.command_line(),
        f"# regenerate from the copies: cd {root.as_posix()} && kvsieve report {inputs}",
    ]
    lines = [
        *report.header(commands),
        *report.speed_note(),
        *report.glance(pareto, root),
        *report.side_by_side(),
        *report.choosing(),
        *(ruler_section(report.ruler, curves, root) if curves else []),
        *report.niah_section(heatmaps, root),
        *report.ppl_section(),
        *report.cost_section(scaling, root),
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
