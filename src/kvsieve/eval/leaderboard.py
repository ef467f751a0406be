"""RULER's leaderboard: each configuration against full attention on the same cases, with a paired interval.

A point score of 10-50 cases cannot tell "matches full attention" from "loses 3 points", and an average over
whatever tasks a configuration happens to have cannot be compared with another's. So:

- the tasks are those on which full attention scores at least `KEEP_AT` (a task it cannot do measures no method:
  `calibration`);
- every configuration is compared on the cases (task, length, sample) that full attention and it both answered,
  and the averages of a table cover one case set for all its rows (`common_cases`);
- each is reported as the paired difference from full attention, RULER's average (the mean over tasks of each
  task's mean score) of the per-case differences, with a bootstrap interval over cases, resampled within each task
  (`paired_difference`);
- the x axis is the KV share actually kept after the prefill, measured per answer (`kept_share`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KEEP_AT = 20.0  # full attention's task score (0-100) below which a task is left out of the leaderboard
FULL = ("full", None, "question")  # the reference configuration: full attention, the question in the prompt
# A method answered again by a later sweep on the same cases is kept under its name plus AGAIN (`report_results.merge`):
# full attention's (CONTROL) difference from FULL is how far full attention moves from itself (bfloat16 answers change
# with what a batch holds); another method's repeat is the row that sweep's new methods are compared with, pairwise.
AGAIN = "-again"
CONTROL = "full" + AGAIN
RESAMPLES = 2000
LEVEL = 0.90

# RULER's tasks by what they ask of a cache: a method can match full attention on the average and still lose a family.
FAMILIES = {
    "single and multi-key retrieval": ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                                       "niah_multikey_2", "niah_multikey_3"),
    "multi-value and multi-query retrieval": ("niah_multivalue", "niah_multiquery"),
    "multi-hop tracing": ("vt",),
    "aggregation": ("cwe", "fwe"),
    "question answering": ("qa_1", "qa_2"),
}  # fmt: skip
Case = tuple[str, int, int]  # (task, length, sample index)
Key = tuple[str, float | None, str]  # (method, budget, mode)


def repeat_of(method: str) -> str | None:
    """The method a repeat row (`AGAIN`) answered again, or None for a method's own row."""
    return method.removesuffix(AGAIN) if method.endswith(AGAIN) else None


def case_of(row: Mapping[str, Any]) -> Case:
    return row["task"], row["length"], row["index"]


def key_of(row: Mapping[str, Any]) -> Key:
    return row["method"], row["budget"], row["mode"]


def by_config(rows: Iterable[Mapping[str, Any]]) -> dict[Key, dict[Case, Mapping[str, Any]]]:
    """The rows of each configuration, by case."""
    table: dict[Key, dict[Case, Mapping[str, Any]]] = {}
    for row in rows:
        table.setdefault(key_of(row), {})[case_of(row)] = row
    return table


def calibration(rows: Iterable[Mapping[str, Any]], keep_at: float = KEEP_AT) -> dict[str, dict[str, Any]]:
    """Full attention's mean score per task (over its answered cases), whether the task is kept (`keep_at` or
    more) and, for a dropped one, why."""
    full = by_config(rows).get(FULL, {})
    scores: dict[str, list[float]] = {}
    for (task, _, _), row in full.items():
        scores.setdefault(task, []).append(row["score"])
    result = {}
    for task, values in scores.items():
        mean = sum(values) / len(values)
        kept = round(mean, 9) >= keep_at  # RULER's scores are shares x 100: 20.0 must not arrive as 19.999...
        why = "" if kept else f"full attention scores {mean:.1f} < {keep_at:g}: the task measures no method here"
        result[task] = {"score": mean, "cases": len(values), "kept": kept, "why": why}
    return result


def common_cases(table: Mapping[Key, Mapping[Case, Any]], keys: Sequence[Key], tasks: Iterable[str]) -> list[Case]:
    """The cases of `tasks` that every configuration of `keys` answered, sorted."""
    wanted = set(tasks)
    sets = [{case for case in table.get(key, {}) if case[0] in wanted} for key in keys]
    return sorted(set.intersection(*sets)) if sets else []


def ruler_average(scores: Mapping[Case, float]) -> float:
    """RULER's average: the mean over tasks of each task's mean score."""
    tasks: dict[str, list[float]] = {}
    for (task, _, _), value in scores.items():
        tasks.setdefault(task, []).append(value)
    return sum(sum(v) / len(v) for v in tasks.values()) / len(tasks)


def paired_difference(
    differences: Mapping[Case, float], resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0
) -> tuple[float, float, float]:
    """(RULER average of the per-case differences, low, high): the interval is the bootstrap's central `level`
    share over `resamples` resamplings of the cases, each task's cases resampled with replacement within the task
    (so every resample keeps the task mix of the average). Seeded: a table is the same every time it is made."""
    tasks: dict[str, list[float]] = {}
    for (task, _, _), value in differences.items():
        tasks.setdefault(task, []).append(value)
    groups = list(tasks.values())
    point = sum(sum(g) / len(g) for g in groups) / len(groups)
    draw = random.Random(seed)
    means = sorted(sum(sum(draw.choices(g, k=len(g))) / len(g) for g in groups) / len(groups) for _ in range(resamples))
    tail = (1 - level) / 2
    return point, means[int(tail * (resamples - 1))], means[int(round((1 - tail) * (resamples - 1)))]


def kept_share(row: Mapping[str, Any]) -> float:
    """The share of the prompt's tokens the cache held after the prefill (global layers: a hybrid model's
    sliding ones are bounded by their window), measured for this answer."""
    return row["kv_length"] / row["prompt_tokens"]


@dataclass(frozen=True)
class Entry:
    """One configuration's row of the leaderboard, on the board's common cases."""

    method: str
    budget: float | None
    mode: str
    average: float  # RULER average, 0-100
    difference: float  # the paired difference from full attention, points
    low: float
    high: float
    kept: float  # mean KV share kept after the prefill
    cases: int
    tasks: dict[str, float]  # each task's mean score
    families: dict[str, tuple[float, float, float]]  # each task family's paired difference and interval (FAMILIES)

    @property
    def key(self) -> Key:
        return self.method, self.budget, self.mode

    @property
    def matches_full(self) -> bool:
        """Whether the interval holds zero difference from full attention."""
        return self.low <= 0 <= self.high


@dataclass(frozen=True)
class Beside:
    """A configuration against a repeat row (`AGAIN`) rather than against full attention: a method a later sweep
    added against that sweep's own answers of a method the board already had (the same batches, the same bfloat16
    noise), or the repeat against the method's first answers (how far the method moves from itself)."""

    key: Key
    against: Key
    difference: float  # paired, points, on the board's cases
    low: float
    high: float


@dataclass(frozen=True)
class Board:
    """The leaderboard: its entries (full attention first), the common cases, the configurations left out
    because they have not answered every one of them (a run still going), with the cases they have, the
    comparisons with repeat rows (`Beside`), and the left-out configurations on the cases each has answered so far
    (`interim`: a look at a run still going, not a row of the board)."""

    entries: list[Entry]
    cases: list[Case]
    tasks: list[str]
    incomplete: dict[Key, int]
    beside: list[Beside]
    interim: list[Entry]


def leaderboard(rows: Sequence[Mapping[str, Any]], tasks: Sequence[str] | None = None) -> Board:
    """Every configuration that answered all of full attention's cases of the kept `tasks` (default: those
    `calibration` keeps), on those cases, as paired differences from full attention."""
    table = by_config(rows)
    if FULL not in table:
        raise ValueError("The leaderboard compares with full attention: the rows hold no full attention run.")
    chosen = list(tasks) if tasks is not None else [t for t, c in calibration(rows).items() if c["kept"]]
    reference = common_cases(table, [FULL], chosen)
    complete = [key for key in table if set(reference) <= set(table[key])]
    incomplete = {key: sum(1 for case in table[key] if case[0] in chosen) for key in table if key not in complete}
    entries = [_entry(key, table[key], table[FULL], reference) for key in complete]
    interim = [
        _entry(key, table[key], table[FULL], answered)
        for key in incomplete
        if (answered := [case for case in reference if case in table[key]])
    ]
    entries.sort(key=_order)
    tasks = [t for t in chosen if any(c[0] == t for c in reference)]
    return Board(entries, reference, tasks, incomplete, beside_repeats(table, complete, reference), interim)


def _entry(
    key: Key, mine: Mapping[Case, Mapping[str, Any]], full: Mapping[Case, Mapping[str, Any]], cases: Sequence[Case]
) -> Entry:
    """`key`'s row on `cases` (every one answered by it and by full attention): its average, the paired difference
    from full attention with its interval, overall and per task family."""
    scores = {case: mine[case]["score"] for case in cases}
    differences = {case: mine[case]["score"] - full[case]["score"] for case in cases}
    difference, low, high = paired_difference(differences) if cases else (0.0, 0.0, 0.0)
    per_task: dict[str, list[float]] = {}
    for case, value in scores.items():
        per_task.setdefault(case[0], []).append(value)
    families = {}
    for family, members in FAMILIES.items():
        own = {case: value for case, value in differences.items() if case[0] in members}
        if own:
            families[family] = paired_difference(own)
    return Entry(
        *key,
        average=ruler_average(scores) if scores else 0.0,
        difference=difference,
        low=low,
        high=high,
        kept=sum(kept_share(mine[case]) for case in cases) / max(len(cases), 1),
        cases=len(cases),
        tasks={task: sum(v) / len(v) for task, v in per_task.items()},
        families=families,
    )


def _order(e: Entry) -> tuple:
    """Full attention, its control, the question mode's rows, then the other modes', by method and budget."""
    return e.key != FULL, e.method != CONTROL, e.mode != "question", e.mode, e.method, e.budget or 1.0


def _sweep(rows: Mapping[Case, Mapping[str, Any]]) -> Any:
    return next(iter(rows.values())).get("sweep")


def beside_repeats(
    table: Mapping[Key, Mapping[Case, Mapping[str, Any]]], complete: Sequence[Key], reference: Sequence[Case]
) -> list[Beside]:
    """Each repeat row of a method other than full attention (full's is the board's control row), against the
    method's first answers, and each method of the repeat's own sweep (the rows' `sweep`, set by
    `report_results.merge`) at the same budget and mode against the repeat: paired differences on `reference` (none
    without cases: a board whose tasks full attention cannot do)."""
    found = []
    for again in complete if reference else ():
        method = repeat_of(again[0])
        if method is None or again[0] == CONTROL:
            continue
        first = (method, *again[1:])
        pairs = [(again, first)] if first in complete else []
        sweep = _sweep(table[again])
        pairs += [
            (key, again)
            for key in complete
            if key[1:] == again[1:] and repeat_of(key[0]) is None and key != first
            and sweep is not None and _sweep(table[key]) == sweep
        ]  # fmt: skip
        for key, against in pairs:
            differences = {case: table[key][case]["score"] - table[against][case]["score"] for case in reference}
            found.append(Beside(key, against, *paired_difference(differences)))
    return found
