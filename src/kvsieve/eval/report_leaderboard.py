"""The RULER sections of `kvsieve report`: the leaderboard and its figure, full attention's calibration, the
per-task table and a "which method when" paragraph computed from the board (`kvsieve.eval.leaderboard`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvsieve import figures
from kvsieve.eval.leaderboard import CONTROL, FULL, Beside, Board, Entry, Key, repeat_of

SEEDS = ("gemfilter", "critiprefill", "imdc", "a2sf")  # the four papers' presets
# Fewer cases a task than this and the bootstrap intervals do not hold (5 cases whose answers all agree give a
# zero-width interval): the board gives points, and no verdicts.
VERDICT_CASES = 15
MODE_TITLES = {
    "question": "question in the prompt",
    "agnostic": "question-agnostic (context compressed first)",
    "unmarked": "no question marked (the prompt as token ids)",
}
MODE_SENTENCES = {"question": "With the question", "agnostic": "Question-agnostic", "unmarked": "Unmarked"}


def _budget(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def fewest_cases(board: Board) -> int:
    """The fewest cases any task of the board has."""
    return min((sum(1 for case in board.cases if case[0] == task) for task in board.tasks), default=0)


def _interval(entry: Entry | Beside, judged: bool) -> str:
    """A paired difference with its interval where the board has enough cases to judge (the point alone else)."""
    if isinstance(entry, Entry) and entry.key == FULL:
        return "-"
    if not judged:
        return f"{entry.difference:+.1f} (no interval)"
    return f"{entry.difference:+.1f} [{entry.low:+.1f}, {entry.high:+.1f}]"


def leaderboard_section(
    board: Board,
    figure: Path,
    root: Path,
    speedup: Callable[[str, float | None], float | None],
    title: str,
    speedup_label: str,
    where: str,
) -> list[str]:
    """The leaderboard table (with `speedup(method, budget)`, the time-to-first-token speedup from a bench run of that
    budget) and its
    figure, under its title and `where` (the line naming the machine and dtype)."""
    tasks = ", ".join(f"`{t}`" for t in board.tasks)
    counts = [sum(1 for case in board.cases if case[0] == task) for task in board.tasks]
    samples = f"{min(counts)}" if min(counts, default=0) == max(counts, default=0) else f"{min(counts)}-{max(counts)}"
    lines = [
        "",
        f"## {title}",
        "",
        where,
        "",
        f"RULER's average (0-100) over the tasks full attention can do ({tasks}), {len(board.cases)} cases "
        f"({samples} per task), every row on the same cases. `vs full` is the paired difference from full "
        "attention on those cases, in points, with its bootstrap 90% interval (2,000 resamples of the cases within "
        "each task): an interval that holds 0 cannot be told from full attention on these cases. `KV kept` is the "
        "cache's entries after the prefill over the prompt's tokens, measured per answer and averaged (a budget "
        "is a share of the prompt; the agnostic mode keeps the question's entries on top of the compressed "
        f"context). {speedup_label}",
        *few_cases_note(board),
        *control_note(board),
        "",
        f"![RULER average against the KV share kept]({figure.relative_to(root).as_posix()})",
        "",
        "| method | budget | mode | RULER average | vs full, 90% interval | TTFT speedup | KV kept |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in board.entries:
        ratio = speedup(e.method, e.budget)
        cells = [
            e.method,
            _budget(e.budget),
            e.mode,
            f"{e.average:.1f}",
            _interval(e, fewest_cases(board) >= VERDICT_CASES),
        ]
        cells += ["-" if ratio is None else f"{ratio:.2f}x", f"{e.kept:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if board.incomplete:
        waiting = ", ".join(
            f"{m} {_budget(b)} {mode} ({n} of {len(board.cases)})" for (m, b, mode), n in board.incomplete.items()
        )
        lines += ["", f"Left out until they have answered every case (a run still going): {waiting}."]
        lines += interim_table(board)
    return lines


def interim_table(board: Board) -> list[str]:
    """The left-out configurations on the cases each has answered so far, beside full attention on the same cases:
    a look at a run still going, a point each (fewer cases, and not every row's), never a verdict."""
    if not board.interim:
        return []
    lines = [
        "",
        "So far, each on the cases it has answered (full attention on the same cases beside it; points only, no "
        "verdict: the cases are fewer than the board's and differ between rows):",
        "",
        "| method | budget | mode | cases | RULER average | full on those cases | vs full |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in board.interim:
        cells = [e.method, _budget(e.budget), e.mode, str(e.cases), f"{e.average:.1f}"]
        cells += [f"{e.average - e.difference:.1f}", f"{e.difference:+.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def few_cases_note(board: Board) -> list[str]:
    """Why a board of too few cases a task gives no intervals or verdicts (empty for one that has enough)."""
    fewest = fewest_cases(board)
    if fewest >= VERDICT_CASES:
        return []
    return [
        "",
        f"**No verdicts on this board**: {fewest} cases a task, fewer than {VERDICT_CASES}. With so few, the bootstrap "
        "intervals do not hold (cases whose answers all agree give a zero-width interval): `vs full` is the point "
        "difference only. Run more cases a task for verdicts.",
    ]


def control_note(board: Board) -> list[str]:
    """What the repeat rows say, where the board has them (empty otherwise): the control row (`CONTROL`, full
    attention answered again) and each other repeat with the comparisons made against it (`Board.beside`)."""
    lines = []
    control = next((e for e in board.entries if e.method == CONTROL), None)
    if control is not None:
        lines += [
            "",
            f"`{CONTROL}` is a control: full attention answered again, by a later sweep, on the same cases. Its "
            f"difference from `full` ({control.difference:+.1f} points) is how far full attention moves from itself: "
            "greedy bfloat16 answers change with what a decoding batch holds. A row's difference no larger than that "
            "is not the method's.",
        ]
    if board.beside:
        judged = fewest_cases(board) >= VERDICT_CASES
        said = [f"- `{_name(b.key)}` against `{_name(b.against)}`: {_interval(b, judged)}" for b in board.beside]
        lines += [
            "",
            "A row named `...-again` is a method a later sweep answered again on the same cases, so that the methods "
            "that sweep added are compared with answers from the same batches: paired differences in points, 90% "
            "interval as in the table (the repeat against the method's first answers is how far the method moves "
            "from itself):",
            "",
            *said,
        ]
    return lines


def _name(key: Key) -> str:
    method, budget, mode = key
    return f"{method} {_budget(budget)} {mode}"


def verdict(entry: Entry) -> str:
    """How an entry compares with full attention on the board's cases: its 90% interval lies above zero (beats),
    holds it (matches) or lies below it (loses)."""
    return "beats" if entry.low > 0 else "matches" if entry.matches_full else "loses to"


def which_method_when(board: Board, methods: Sequence[str]) -> list[str]:
    """Per method and mode, how it compares with full attention at each budget, as sentences read off the board, and
    each task family where it loses though its average may not (`leaderboard.FAMILIES`); none on a board of too few
    cases a task (`VERDICT_CASES`)."""
    if fewest_cases(board) < VERDICT_CASES:
        return ["", "### Which method when", "", f"Not on this board: fewer than {VERDICT_CASES} cases a task."]
    sentences = []
    for method in (m for m in methods if repeat_of(m) is None):
        parts = []
        for mode in MODE_TITLES:
            mine = sorted(
                (e for e in board.entries if e.method == method and e.mode == mode), key=lambda e: e.budget or 1.0
            )
            if not mine:
                continue
            by_verdict: dict[str, list[str]] = {}
            for e in mine:  # a method without a KV budget has one entry, which keeps every KV entry
                by_verdict.setdefault(verdict(e), []).append("" if e.budget is None else f"{e.budget:g}")
            where = MODE_SENTENCES[mode]
            said = "; ".join(
                f"{v} full attention" + (f" at {', '.join(budgets)}" if any(budgets) else "")
                for v, budgets in by_verdict.items()
            )
            losses = [
                f"{family}{'' if e.budget is None else f' at {e.budget:g}'} ({d:+.1f} [{low:+.1f}, {high:+.1f}])"
                for e in mine
                for family, (d, low, high) in e.families.items()
                if high < 0
            ]
            if losses:
                said += f"; loses on {', '.join(losses)}"
            parts.append(f"{where}, {said}")
        if parts:
            sentences.append(f"**{method}**: {'. '.join(parts)}.")
    return [
        "",
        "### Which method when",
        "",
        'Read off the table above, budgets as shares of the prompt ("matches": the 90% interval holds zero '
        'difference from full attention on these cases, which a wider case set may still separate; "beats" and '
        '"loses to": the interval lies above or below zero; "loses on": a task family whose own interval lies '
        "below zero, whatever the average says):",
        "",
        *(f"- {s}" for s in sentences),
    ]


def calibration_section(
    calibration: Mapping[str, Mapping[str, Any]], keep_at: float, tasks: Sequence[str]
) -> list[str]:
    """Full attention's score on every task run, kept or dropped, and why."""
    lines = [
        "",
        "### Full attention's calibration",
        "",
        f"Every RULER task that runs offline, full attention only; the leaderboard keeps the tasks where it scores "
        f"{keep_at:g} or more.",
        "",
        "| task | full attention | cases | on the board |",
        "|---|---|---|---|",
    ]
    for task in tasks:
        if task in calibration:
            c = calibration[task]
            kept = "yes" if c["kept"] else f"no: {c['why']}"
            lines.append(f"| {task} | {c['score']:.1f} | {c['cases']} | {kept} |")
    return lines


def per_task_section(board: Board) -> list[str]:
    """Each configuration's mean score per task, on the board's cases."""
    lengths = ", ".join(str(n) for n in sorted({case[1] for case in board.cases}))
    lines = [
        "",
        f"### Per task at {lengths} tokens",
        "",
        "| method | budget | mode | " + " | ".join(board.tasks) + " |",
        "|---|---|---|" + "---|" * len(board.tasks),
    ]
    for e in board.entries:
        scores = [f"{e.tasks[t]:.1f}" if t in e.tasks else "-" for t in board.tasks]
        lines.append("| " + " | ".join([e.method, _budget(e.budget), e.mode, *scores]) + " |")
    return lines


MARKERS = "o^Dv"  # with the 10 colours of matplotlib's cycle: 40 methods, no two drawn alike


def line_styles(methods: Sequence[str]) -> dict[str, tuple[str, str, str]]:
    """Each method's (colour, marker, line) on the board's figure: the colour cycle's 10 colours, then the same
    colours with another marker and a dashed line, so a board of more than 10 methods draws no two alike."""
    return {
        method: (f"C{i % 10}", MARKERS[(i // 10) % len(MARKERS)], "-" if (i // 10) % 2 == 0 else "--")
        for i, method in enumerate(methods)
    }


def plot_board(board: Board, path: Path, title: str) -> Path:
    """RULER average against the KV share kept (measured), one line per method over its budgets, one panel per
    mode, full attention as the dashed ceiling; each point's bar is its 90% interval against full attention,
    drawn around the point."""
    plt = figures.pyplot()

    modes = [m for m in MODE_TITLES if any(e.mode == m and e.budget is not None for e in board.entries)]
    modes = modes or ["question"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.2 * len(modes), 4.6), sharey=True, squeeze=False)
    full = next((e for e in board.entries if e.key == FULL), None)
    methods = list(dict.fromkeys(e.method for e in board.entries if e.key != FULL))
    looks = line_styles(methods)
    for ax, mode in zip(axes[0], modes, strict=True):
        for method in methods:
            points = sorted(
                (e for e in board.entries if e.method == method and (e.mode == mode or e.budget is None)),
                key=lambda e: e.kept,
            )
            if not points:
                continue
            xs, ys = [e.kept for e in points], [e.average for e in points]
            below = [e.difference - e.low for e in points]
            above = [e.high - e.difference for e in points]
            colour, marker, line = looks[method]
            style = marker + line if len(points) > 1 else "s"
            ax.errorbar(xs, ys, yerr=[below, above], fmt=style, color=colour, label=method, capsize=2,
                        linewidth=1.2, markersize=4, alpha=0.85)  # fmt: skip
        if full is not None:
            ax.axhline(full.average, color="black", linestyle="--", linewidth=1, label=f"full ({full.average:.1f})")
        ax.set_title(MODE_TITLES[mode], fontsize=10)
        ax.set_xlabel("KV share kept after the prefill (measured)")
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("RULER average (0-100); bars: 90% interval vs full")
    fig.suptitle(title)
    return figures.save(fig, path, dpi=110)
