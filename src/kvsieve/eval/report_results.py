"""The result documents `kvsieve report` is made from: merged by kind, and what its sections look up in them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvsieve.errors import KvsieveError
from kvsieve.eval import leaderboard
from kvsieve.eval.bench import summarize
from kvsieve.eval.methods import specs_from_settings
from kvsieve.eval.records import spec_today
from kvsieve.eval.ruler import BUDGET_FIELDS
from kvsieve.prompt import QUESTION_WINDOW
from kvsieve.registry import REGISTRY

GLANCE_BUDGET = 0.25  # the RULER budget the glance table and the pareto figure read: the presets' 1024 entries at 4K


def ordered(methods: Sequence[str]) -> list[str]:
    """Methods in the library's order (full first), unknown names last."""
    known = [m for m in REGISTRY if m in methods]
    return known + sorted(set(methods) - set(known))


def _length(row: dict[str, Any]) -> int | None:
    return row.get("requested_length", row.get("length"))


def _key(row: dict[str, Any]) -> tuple[str, int | None, str | None]:
    """What a row answers: its method at its length, in its RULER mode (a mode a method has not run in yet is a new
    row, not a repeat)."""
    return row["method"], _length(row), row.get("mode")


# The stand-in rule of an unmarked sweep made before files recorded it: the window alone.
WINDOW_ALONE = {"window": QUESTION_WINDOW, "longest": QUESTION_WINDOW}


def _stand_in(doc: dict[str, Any]) -> dict[str, int]:
    """The rule a RULER file's unmarked rows took their stand-in question by (`prompt.STAND_IN`, as recorded)."""
    return doc["settings"].get("stand_in", WINDOW_ALONE)


def merge(documents: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """One document from several result files of one kind: each method's rows at each length (and mode) and its spec
    come from the first file that has them, so a later run can add methods, lengths or modes next to an earlier
    one. A later RULER file's method at a length and mode already given becomes that method's repeat row
    (`leaderboard.AGAIN`, the first such file's; full attention's is the control, `leaderboard.CONTROL`), and every
    RULER row says which file (`sweep`, its index) answered it, so a sweep's methods are compared with its own
    repeats."""
    if not documents:
        return None
    first = documents[0]
    merged = {**first, "settings": {**first["settings"], "methods": {}}, "rows": []}
    seen: dict[tuple[str, int | None, str | None], dict[str, int] | None] = {}  # each row's stand-in rule, unmarked
    for sweep, doc in enumerate(documents):
        if doc.get("kind") == "ruler":
            doc = _as_repeats({**doc, "rows": [{**r, "sweep": sweep} for r in doc["rows"]]}, seen, merged)
        new = {_key(r) for r in doc["rows"]} - seen.keys()
        seen |= {key: _stand_in(doc) if key[2] == "unmarked" else None for key in new}
        for method in dict.fromkeys(m for m, _, _ in new):
            merged["settings"]["methods"].setdefault(method, doc["settings"]["methods"][method])
        merged["rows"] += [r for r in doc["rows"] if _key(r) in new]
    return merged


def _as_repeats(
    doc: dict[str, Any], seen: dict[tuple[str, int | None, str | None], dict[str, int] | None], merged: dict[str, Any]
) -> dict[str, Any]:
    """`doc` with its rows of a method at a length `seen` already holds renamed to the method's repeat
    (`leaderboard.AGAIN`). A repeat must be the same method: one whose settings differ from the first file's, each
    read as this library reads it (`records.spec_today`: a field added since takes its default), is refused, and so
    is an unmarked row whose stand-in question was taken by another rule."""
    again = {_key(r) for r in doc["rows"]} & seen.keys()
    if not again:
        return doc
    rule = _stand_in(doc)
    if other := sorted({json.dumps(seen[key]) for key in again if key[2] == "unmarked" and seen[key] != rule}):
        raise KvsieveError(
            f"{doc.get('file', 'A later file')} took the unmarked mode's stand-in question by another rule "
            f"({json.dumps(rule)}) than an earlier file ({', '.join(other)}): its rows are not a repeat. "
            "Report the files apart."
        )
    for method in dict.fromkeys(m for m, _, _ in again):
        before, now = merged["settings"]["methods"].get(method), doc["settings"]["methods"].get(method)
        if before is not None and now is not None and (differ := _differences(spec_today(before), spec_today(now))):
            raise KvsieveError(
                f"'{method}' in {doc.get('file', 'a later file')} has other settings than in an earlier file "
                f"({json.dumps(differ)}): a later sweep's row of a method is its repeat, on the "
                "same settings. Report the files apart, or give the method its settings' own name in one of them."
            )
    rows = [{**r, "method": r["method"] + leaderboard.AGAIN} if _key(r) in again else r for r in doc["rows"]]
    methods = dict(doc["settings"]["methods"])
    methods.update({m + leaderboard.AGAIN: methods[m] for m in dict.fromkeys(m for m, _, _ in again)})
    return {**doc, "rows": rows, "settings": {**doc["settings"], "methods": methods}}


def _differences(first: Any, later: Any, path: str = "") -> dict[str, list[Any]]:
    """The fields two recorded method specs both hold with different values (the preset's summary text apart), by
    dotted path: [first's, later's]."""
    if isinstance(first, dict) and isinstance(later, dict):
        found: dict[str, list[Any]] = {}
        for key in first.keys() & later.keys() - {"summary"}:
            found |= _differences(first[key], later[key], f"{path}.{key}" if path else key)
        return found
    return {} if first == later else {path: [first, later]}


def _bench_summary(documents: Sequence[dict[str, Any]], baseline: str) -> list[dict]:
    """Cost summaries with ratios taken within each bench run (each run has its own baseline rows);
    a method measured at one length in several runs is reported from the first."""
    summary, seen = [], set()
    for doc in documents:
        mine = [s for s in summarize(doc["rows"], baseline) if (s["method"], s["length"]) not in seen]
        seen |= {(s["method"], s["length"]) for s in mine}
        summary += mine
    return summary


def same_cases(documents: Sequence[dict[str, Any]], fields: Sequence[str]) -> None:
    """Refuse to put RULER files on one board unless they answered the same cases: the same model and seed (and,
    among the sweep's files at one length, as many cases per task: `same_counts`); rows of other cases would be
    compared as if paired."""
    for name in fields:
        values = {json.dumps(d["settings"].get(name)) for d in documents}
        if len(values) > 1:
            files = ", ".join(f"{d.get('file', '?')}: {d['settings'].get(name)!r}" for d in documents)
            raise KvsieveError(
                f"These RULER files answered different cases ({name} differs: {files}); one board compares rows on "
                "the same cases. Report them apart, or run the missing rows with the same settings."
            )


def same_counts(documents: Sequence[dict[str, Any]]) -> None:
    """`same_cases` on the case count, length by length: each length is a board of its own, so a 16K sweep of 5
    cases a task sits beside a 4K board of 15, while two files at 4K must hold as many."""
    held = [{r["length"] for r in d["rows"]} for d in documents]
    for length in sorted(set().union(*held)):
        same_cases([d for d, lengths in zip(documents, held, strict=True) if length in lengths], ("samples",))


class Results:
    """The result documents a report is made from, merged, and what the sections look up in them (`report_sections`
    renders them)."""

    def __init__(
        self,
        niah_docs: Sequence[dict[str, Any]],
        ppl_docs: Sequence[dict[str, Any]] = (),
        bench_docs: Sequence[dict[str, Any]] = (),
        baseline: str = "full",
        ruler_docs: Sequence[dict[str, Any]] = (),
        calibration_docs: Sequence[dict[str, Any]] = (),
    ) -> None:
        if not niah_docs and not ppl_docs and not bench_docs and not ruler_docs:
            raise KvsieveError("Nothing to report: give at least one of --niah, --ppl, --bench, --ruler.")
        same_cases(ruler_docs, ("model", "seed"))
        same_counts(ruler_docs)
        same_cases([*ruler_docs, *calibration_docs], ("model", "seed"))
        probes = dict.fromkeys(d["settings"]["probe"] for d in niah_docs)
        self.niah_docs = [merge([d for d in niah_docs if d["settings"]["probe"] == p]) for p in probes]
        self.ppl, self.bench, self.baseline = merge(ppl_docs), merge(bench_docs), baseline
        self.bench_docs = list(bench_docs)
        self.ruler = merge(ruler_docs)
        # One leaderboard per RULER length, on the tasks full attention can do at that length: its calibration is
        # its own run of every task where one is given, else its rows in the sweep.
        self.calibrations: dict[int, dict[str, dict[str, Any]]] = {}
        self.ruler_boards: dict[int, leaderboard.Board] = {}
        calibrated = [r for d in calibration_docs for r in d["rows"]]
        for length in sorted({r["length"] for r in self.ruler["rows"]}) if self.ruler else []:
            rows = [r for r in self.ruler["rows"] if r["length"] == length]
            own = [r for r in calibrated if r["length"] == length] or rows
            self.calibrations[length] = leaderboard.calibration(own)
            kept = [task for task, c in self.calibrations[length].items() if c["kept"]]
            self.ruler_boards[length] = leaderboard.leaderboard(rows, kept)
        self.documents = [*niah_docs, *ppl_docs, *bench_docs, *ruler_docs, *calibration_docs]
        # Each kind's files as given (before merging), for the machine and dtype each section names.
        self.sources = {
            "niah": list(niah_docs), "ppl": list(ppl_docs), "bench": list(bench_docs),
            "ruler": [*ruler_docs, *calibration_docs],
        }  # fmt: skip
        rows = [r for d in self.documents for r in d["rows"]]
        if not rows:
            raise KvsieveError("The result files have no rows yet; run the evaluations first.")
        self.methods = ordered({r["method"] for r in rows})
        self.bench_summary = _bench_summary(bench_docs, baseline)
        lengths = {r.get("requested_length", r.get("length")) for r in rows}
        self.lengths = sorted(lengths)

    def descriptions(self) -> tuple[dict[str, str], bool]:
        """Each method's configuration as recorded in the result files it is reported from (the first file of
        each kind that has it, `merge`), and whether those disagree."""
        seen: dict[str, set[str]] = {}
        for doc in [*self.niah_docs, *(d for d in (self.ppl, self.bench, self.ruler) if d is not None)]:
            for name, spec in specs_from_settings(doc["settings"]["methods"]).items():
                seen.setdefault(name, set()).add(spec.describe())
        return {name: " / ".join(sorted(d)) for name, d in seen.items()}, any(len(d) > 1 for d in seen.values())

    def niah_cell(self, doc: dict[str, Any], method: str, length: int) -> str:
        mine = [r for r in doc["rows"] if r["method"] == method and r["length"] == length]
        if not mine:
            return "-"
        mean = sum(r["rouge1"] for r in mine) / len(mine)
        return f"{mean:.2f} ({sum(r['hit'] for r in mine)}/{len(mine)})"

    def perplexity(self, method: str, length: int) -> tuple[float, float | None] | None:
        if self.ppl is None:
            return None
        rows = {(r["method"], r["length"]): r["ppl"] for r in self.ppl["rows"]}
        if (method, length) not in rows:
            return None
        base = rows.get((self.baseline, length))
        return rows[(method, length)], (rows[(method, length)] / base if base else None)

    def cost(self, method: str, length: int) -> dict[str, Any] | None:
        return next((s for s in self.bench_summary if s["method"] == method and s["length"] == length), None)

    def bench_share(self, method: str, length: int) -> float | None:
        """The KV budget the bench ran `method` at, as a share of `length` tokens, from the first bench file that ran
        it there (as `cost`); None where the method keeps every entry or was not benched."""
        for doc in self.bench_docs:
            if not any(r["method"] == method and _length(r) == length for r in doc["rows"]):
                continue
            spec = doc["settings"]["methods"].get(method, {})
            for path in BUDGET_FIELDS:
                stage, field = path.split(".")
                value = (spec.get(stage) or {}).get(field)
                if value is not None:
                    return value / length if isinstance(value, int) else float(value)
            return None
        return None

    def decode_ratio(self, method: str, length: int) -> float | None:
        """Median decode tokens/s against the baseline's, paired within one run's repeats."""
        mine = self.cost(method, length)
        return mine["decode_ratio"][1] if mine and mine.get("decode_ratio") else None

    def ruler_average(self, method: str, mode: str = "question") -> float | None:
        """The method's RULER average (0-100) on the leaderboard's cases at the glance budget (`GLANCE_BUDGET` of the
        prompt; a method without a KV budget as registered), on the shortest length's board; None where it is not
        on it."""
        boards = list(self.ruler_boards.values())
        entries = {e.key: e for e in boards[0].entries} if boards else {}
        for budget in (GLANCE_BUDGET, None):
            if (method, budget, mode) in entries:
                return entries[(method, budget, mode)].average
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
            average = self.ruler_average(method) if self.ruler else None
            cost = self.cost(method, length)
            if (not rows and average is None) or cost is None or not cost["speedup"] or method not in kv:
                continue
            if not kv.get(self.baseline):
                continue
            points.append(
                {
                    "method": method,
                    "length": length,
                    # RULER's where it ran (None for a method not on its board), else the probes' hits
                    "quality": (average / 100 if average is not None else None)
                    if self.ruler
                    else sum(r["hit"] for r in rows) / len(rows),
                    "hits": sum(r["hit"] for r in rows),
                    "cases": len(rows),
                    "speedup": cost["speedup"][1],
                    "memory_ratio": cost["memory_ratio"][1],
                    "kv_ratio": kv[method] / kv[self.baseline],
                }
            )
        return points
