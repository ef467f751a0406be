"""RULER's leaderboard (`kvsieve.eval.leaderboard`) on made-up tables: the calibration, the common cases and the
paired bootstrap interval."""

from __future__ import annotations

import json

import pytest

from kvsieve.errors import KvsieveError
from kvsieve.eval import leaderboard
from kvsieve.prompt import STAND_IN


def rows_of(method, budget, mode, scores: dict[str, list[float]], kept: int = 100, length: int = 4096):
    return [
        {"task": task, "length": length, "index": i, "method": method, "budget": budget, "mode": mode,
         "score": score, "kv_length": kept, "prompt_tokens": 100}
        for task, values in scores.items()
        for i, score in enumerate(values)
    ]  # fmt: skip


def ruler_document(rows, methods: str, budgets: list[float], samples: int) -> dict:
    """A `kvsieve ruler` result file holding `rows` of the presets `methods`, as the sweep records it."""
    from kvsieve import registry
    from kvsieve.eval import records

    specs = {name: spec.to_dict() for name, spec in registry.methods(methods).items()}
    settings = {"methods": specs, "budgets": budgets, "samples": samples, "seed": 42, "model": None,
                "dtype": "bfloat16", "device": "cpu"}  # fmt: skip
    return {"kind": "ruler", "schema": 1, "command": "kvsieve ruler ...", "commands": ["kvsieve ruler ..."],
            "machine": records.machine(), "settings": settings, "rows": rows}  # fmt: skip


def test_the_calibration_keeps_the_tasks_full_attention_can_do():
    rows = rows_of("full", None, "question", {"niah": [100, 100, 0], "vt": [0, 0, 40], "qa": [20, 20, 20]})
    calibration = leaderboard.calibration(rows)
    assert {t: c["kept"] for t, c in calibration.items()} == {"niah": True, "vt": False, "qa": True}
    assert calibration["vt"]["score"] == pytest.approx(40 / 3) and "13.3 < 20" in calibration["vt"]["why"]
    # five shares of 100 whose float mean lands a hair below 20 (RULER's fwe on Gemma 3): the task is at the bar
    scores = [0.0, 0.0, 1 / 3 * 100, 1 / 3 * 100, 1 / 3 * 100]  # as RULER computes a share of 3 references
    fwe = rows_of("full", None, "question", {"fwe": scores})
    assert sum(scores) / 5 < 20 and leaderboard.calibration(fwe)["fwe"]["kept"]


def test_the_paired_interval_on_a_made_up_table():
    # one task, 10 cases: half lose every point. The average difference is -50; a resample's mean is -10 points
    # per lost case drawn, a binomial(10, 1/2) count, whose 5% and 95% quantiles are 2 and 8 cases.
    differences = {("t", 0, i): (-100.0 if i % 2 else 0.0) for i in range(10)}
    point, low, high = leaderboard.paired_difference(differences)
    assert point == -50.0
    assert -90.0 <= low <= -70.0 and -30.0 <= high <= -10.0
    assert leaderboard.paired_difference(differences) == (point, low, high)  # seeded: the same table every time
    # no difference on any case: the interval is the point
    assert leaderboard.paired_difference({("t", 0, i): 0.0 for i in range(10)}) == (0.0, 0.0, 0.0)
    # tasks weigh equally, however many cases each has (RULER's average)
    uneven = {("a", 0, 0): -10.0, ("b", 0, 0): 0.0, ("b", 0, 1): 0.0, ("b", 0, 2): 0.0}
    assert leaderboard.paired_difference(uneven)[0] == -5.0


def test_the_board_compares_every_configuration_on_full_attentions_cases():
    full = rows_of("full", None, "question", {"niah": [100] * 6, "qa": [100, 0, 100, 0, 100, 0], "vt": [0] * 6})
    same = rows_of("snapkv", 0.5, "question", {"niah": [100] * 6, "qa": [100, 0, 100, 0, 100, 0], "vt": [0] * 6})
    worse = rows_of("snapkv", 0.1, "question", {"niah": [0] * 6, "qa": [0] * 6, "vt": [0] * 6}, kept=12)
    running = rows_of("h2o", 0.1, "question", {"niah": [100] * 6, "qa": [100] * 2})  # a run still going
    board = leaderboard.leaderboard(full + same + worse + running)
    assert board.tasks == ["niah", "qa"]  # vt: full attention scores 0
    assert [e.key for e in board.entries] == [("full", None, "question"), ("snapkv", 0.1, "question"),
                                              ("snapkv", 0.5, "question")]  # fmt: skip
    assert board.incomplete == {("h2o", 0.1, "question"): 8}  # left out: its average would cover other cases
    # ... shown apart, on the 8 cases it answered, beside full attention on those (qa: 100 against 100, 0)
    (so_far,) = board.interim
    assert (so_far.key, so_far.cases, so_far.average, so_far.difference) == (("h2o", 0.1, "question"), 8, 100.0, 25.0)
    from kvsieve.eval.report_leaderboard import interim_table

    assert "| h2o | 0.1 | question | 8 | 100.0 | 75.0 | +25.0 |" in interim_table(board)
    entry = {e.key: e for e in board.entries}
    assert entry[("snapkv", 0.5, "question")].difference == 0.0 and entry[("snapkv", 0.5, "question")].matches_full
    loses = entry[("snapkv", 0.1, "question")]
    assert loses.average == 0.0 and loses.difference == -75.0 and loses.high < 0 and not loses.matches_full
    assert loses.kept == pytest.approx(0.12) and loses.cases == 12
    from kvsieve.eval.report_leaderboard import verdict

    assert [verdict(e) for e in board.entries[1:]] == ["loses to", "matches"]
    better = rows_of("snapkv", 0.25, "question", {"niah": [100] * 6, "qa": [100] * 6})
    assert verdict(leaderboard.leaderboard(full + better).entries[1]) == "beats"  # +25 on every resample


def test_the_report_opens_with_the_leaderboard(tmp_path):
    """`kvsieve report --ruler FILE --ruler-calibration FILE`: the leaderboard (with its figure, the paired
    intervals and which method when) comes before the commands; the calibration lists the dropped task and why."""
    from kvsieve.eval import records
    from kvsieve.eval.report import write_report

    def document(rows, methods):
        return ruler_document(rows, methods, [0.1, 0.5], 6)

    scores = {"niah_single_1": [100] * 18, "qa_1": [100, 0] * 9}  # 18 cases a task: enough for verdicts
    rows = rows_of("full", None, "question", scores)
    rows += rows_of("snapkv", 0.5, "question", scores, kept=50)
    rows += rows_of("snapkv", 0.1, "question", {"niah_single_1": [0] * 18, "qa_1": [0] * 18}, kept=10)
    rows += rows_of("snapkv", 0.1, "agnostic", {"niah_single_1": [100] * 18, "qa_1": [0] * 18}, kept=15)
    calibration = rows_of("full", None, "question", {**scores, "vt": [0] * 18})
    longer = rows_of("full", None, "question", {"qa_1": [100, 0]}, length=16384)  # a second run, at 16K
    longer += rows_of("snapkv", 0.5, "question", {"qa_1": [0, 0]}, kept=50, length=16384)
    records.save(tmp_path / "ruler.json", document(rows, "full,snapkv"))
    # 2 cases a task at 16K beside 6 at 4K: each length is a board of its own, so the counts may differ.
    records.save(tmp_path / "ruler_16k.json", ruler_document(longer, "full,snapkv", [0.1, 0.5], 2))
    records.save(tmp_path / "calibration.json", document(calibration, "full"))
    path = write_report(
        tmp_path / "docs" / "RESULTS.md",
        ruler_files=[tmp_path / "ruler.json", tmp_path / "ruler_16k.json"],
        calibration_files=[tmp_path / "calibration.json"],
    )
    text = path.read_text()
    assert text.index("## RULER leaderboard: SmolLM2-135M-Instruct, 4096 tokens") < text.index("## Commands")
    assert "## RULER leaderboard: SmolLM2-135M-Instruct, 16384 tokens" in text  # its own board, its own cases
    assert "| snapkv | 0.5 | question | 75.0 | +0.0 [+0.0, +0.0] | - | 0.50 |" in text
    assert "| snapkv | 0.1 | agnostic | 50.0 | -25.0 [" in text
    assert (  # the verdict on the average, then each task family whose own interval lies below zero
        "**snapkv**: With the question, loses to full attention at 0.1; matches full attention at 0.5; loses on "
        "single and multi-key retrieval at 0.1 (-100.0 [-100.0, -100.0]), question answering at 0.1 (-50.0 [" in text
    )
    assert "Question-agnostic, loses to full attention at 0.1; loses on question answering at 0.1 (-50.0 [" in text
    assert "| vt | 0.0 | 18 | no: full attention scores 0.0 < 20" in text
    assert "| niah_single_1 | 100.0 | 18 | yes |" in text
    # The 16K board has 2 cases a task: points, no intervals, no verdicts.
    at_16k = text[text.index("## RULER leaderboard: SmolLM2-135M-Instruct, 16384 tokens") :]
    assert "| snapkv | 0.5 | question | 0.0 | -50.0 (no interval) |" in at_16k
    assert "**No verdicts on this board**: 2 cases a task, fewer than 15." in at_16k
    assert (path.parent / "figures" / "ruler_4096.png").stat().st_size > 5000
    assert "### Per task at 4096 tokens" in text and "| snapkv | 0.1 | agnostic | 100.0 | 0.0 |" in text

    # Files of other cases are never put on one board: another seed, model or case count (at one length) is
    # refused, by name.
    for field, value in [("seed", 7), ("model", "gemma3-270m"), ("samples", 5)]:
        other = document(rows_of("tova", 0.5, "question", scores, kept=50), "full,tova")
        other["settings"][field] = value
        records.save(tmp_path / "other.json", other)
        with pytest.raises(KvsieveError, match=f"answered different cases \\({field} differs: ruler.json: "):
            write_report(tmp_path / "docs" / "R.md", ruler_files=[tmp_path / "ruler.json", tmp_path / "other.json"])


def test_a_later_sweeps_full_attention_is_the_boards_control_row(tmp_path):
    """Full attention answered again by a second sweep on the same cases is kept as `full-again` (not dropped as a
    repeat): its difference from full attention is the board's noise floor, and it gets no verdict sentence."""
    from kvsieve.eval import records
    from kvsieve.eval.report import write_report

    def document(rows, methods):
        return ruler_document(rows, methods, [0.25], 16)

    scores = {"niah_single_1": [100] * 16, "qa_1": [100, 0] * 8}
    first = rows_of("full", None, "question", scores) + rows_of("snapkv", 0.25, "question", scores, kept=25)
    again = {"niah_single_1": [100] * 16, "qa_1": [0, 0] + [100, 0] * 7}  # one answer moved
    second = rows_of("full", None, "question", again) + rows_of("tova", 0.25, "question", scores, kept=25)
    records.save(tmp_path / "sweep.json", document(first, "full,snapkv"))
    records.save(tmp_path / "new.json", document(second, "full,tova"))
    text = write_report(tmp_path / "docs" / "R.md", ruler_files=[tmp_path / "sweep.json", tmp_path / "new.json"])
    text = text.read_text()
    assert "| full | - | question | 75.0 |" in text  # the first sweep's full attention stays the reference
    assert "| full-again | - | question | 71.9 | -3.1 [" in text  # (100 + 43.75) / 2
    assert "`full-again` is a control" in text and "(-3.1 points)" in text
    assert "| tova | 0.25 | question | 75.0 |" in text
    assert "**full-again**" not in text


def test_a_later_sweeps_repeat_of_a_method_is_what_its_new_methods_are_compared_with(tmp_path):
    """A later sweep that answers snapkv again beside a new method (adakv) keeps its snapkv as `snapkv-again` (not
    dropped as a repeat): adakv is compared with the answers of its own sweep, and snapkv-again with snapkv's first
    answers; the repeat gets no verdict sentence of its own. A method in a new mode is a row of its own."""
    from kvsieve.eval import records
    from kvsieve.eval.report import write_report

    def document(rows, methods):
        return ruler_document(rows, methods, [0.25], 16)

    scores = {"niah_single_1": [100] * 16, "qa_1": [100, 0] * 8}
    moved = {"niah_single_1": [100] * 16, "qa_1": [0, 0] + [100, 0] * 7}  # one answer moved
    first = rows_of("full", None, "question", scores) + rows_of("snapkv", 0.25, "question", scores, kept=25)
    second = rows_of("snapkv", 0.25, "question", moved, kept=25) + rows_of("adakv", 0.25, "question", scores, kept=25)
    records.save(tmp_path / "sweep.json", document(first, "full,snapkv"))
    records.save(tmp_path / "new.json", document(second, "snapkv,adakv"))
    text = write_report(tmp_path / "docs" / "R.md", ruler_files=[tmp_path / "sweep.json", tmp_path / "new.json"])
    text = text.read_text()
    assert "| snapkv | 0.25 | question | 75.0 | +0.0 [" in text  # the first sweep's snapkv
    assert "| snapkv-again | 0.25 | question | 71.9 | -3.1 [" in text  # (100 + 43.75) / 2
    assert "- `snapkv-again 0.25 question` against `snapkv 0.25 question`: -3.1 [" in text
    assert "- `adakv 0.25 question` against `snapkv-again 0.25 question`: +3.1 [" in text  # qa_1: +100 / 16, halved
    assert "`snapkv 0.25 question` against" not in text  # the first sweep's rows are not compared with the repeat
    assert "**snapkv-again**" not in text and "**adakv**" in text

    # A method in a mode no earlier file ran it in is its own row, not a repeat (the unmarked re-measure of a preset).
    records.save(tmp_path / "unmarked.json", document(rows_of("snapkv", 0.25, "unmarked", moved, kept=25), "snapkv"))
    text = write_report(tmp_path / "docs" / "R.md", ruler_files=[tmp_path / "sweep.json", tmp_path / "unmarked.json"])
    text = text.read_text()
    assert "| snapkv | 0.25 | unmarked | 71.9 | -3.1 [" in text and "snapkv-again" not in text
    # Unmarked rows answered again by the same stand-in rule are a repeat; by another rule (a file from before the
    # rule was recorded read the window alone) they are refused, not shown as the same method answered again.
    sentence = document(rows_of("snapkv", 0.25, "unmarked", scores, kept=25), "snapkv")
    records.save(tmp_path / "sentence.json", {**sentence, "settings": {**sentence["settings"], "stand_in": STAND_IN}})
    again = [tmp_path / "sweep.json", tmp_path / "sentence.json", tmp_path / "sentence.json"]
    assert "| snapkv-again | 0.25 | unmarked | 75.0 |" in write_report(tmp_path / "R.md", ruler_files=again).read_text()
    with pytest.raises(KvsieveError, match=r"sentence.json took the unmarked mode's stand-in question by another rule"):
        write_report(tmp_path / "R.md", ruler_files=[tmp_path / "unmarked.json", tmp_path / "sentence.json"])

    # A repeat is the same method: a later file's snapkv with other settings is refused, by name and field.
    other = document(second, "snapkv,adakv")
    other["settings"]["methods"]["snapkv"]["compress"]["policy"]["pool_size"] = 5
    records.save(tmp_path / "other.json", other)
    with pytest.raises(KvsieveError, match=r"'snapkv' in .*other.json has other settings.*compress.policy.pool_size"):
        write_report(tmp_path / "docs" / "R.md", ruler_files=[tmp_path / "sweep.json", tmp_path / "other.json"])
    # ... and so is one that sets a field the first file's record predates: that file ran it at the field's default.
    per_head = document(second, "snapkv,adakv")
    per_head["settings"]["methods"]["snapkv"]["compress"]["head_budgets"] = True
    records.save(tmp_path / "per_head.json", per_head)
    older = json.loads((tmp_path / "sweep.json").read_text())
    del older["settings"]["methods"]["snapkv"]["compress"]["head_budgets"]
    records.save(tmp_path / "older.json", older)
    with pytest.raises(KvsieveError, match=r"'snapkv' in .*per_head.json has other settings.*compress.head_budgets"):
        write_report(tmp_path / "docs" / "R.md", ruler_files=[tmp_path / "older.json", tmp_path / "per_head.json"])


def test_a_rows_ttft_speedup_is_its_own_budgets_or_none(tmp_path):
    """The TTFT column reads the bench only where the bench ran the row's budget: the committed bench ran snapkv at
    1024 of 4096 tokens, so the 0.25 row gets its speedup and the 0.5 row a dash."""
    from pathlib import Path

    from kvsieve.eval import records
    from kvsieve.eval.report import write_report

    scores = {"niah_single_1": [100] * 16}
    rows = rows_of("full", None, "question", scores) + rows_of("snapkv", 0.25, "question", scores, kept=25)
    rows += rows_of("snapkv", 0.5, "question", scores, kept=50)
    records.save(tmp_path / "ruler.json", ruler_document(rows, "full,snapkv", [0.25, 0.5], 16))
    bench = Path(__file__).parent.parent / "docs" / "results" / "ruler" / "bench_4k_bf16.json"
    text = write_report(tmp_path / "docs" / "R.md", bench_files=[bench], ruler_files=[tmp_path / "ruler.json"])
    board = text.read_text().split("| method | budget | mode | RULER average |")[1].split("\n\n")[0]
    cells = {row.split("|")[2].strip(): row.split("|")[6].strip() for row in board.splitlines() if "| snapkv |" in row}
    assert cells["0.25"].endswith("x") and cells["0.5"] == "-"


def test_the_side_by_side_table_has_no_row_for_a_method_it_measured_nothing_of(tmp_path):
    """A method only RULER ran (kvzip here) is in the board, but the per-length table of probes and cost gives it no
    row of dashes; a method the bench ran at that length keeps its row."""
    from pathlib import Path

    from kvsieve.eval import records
    from kvsieve.eval.report import write_report

    scores = {"niah_single_1": [100] * 16}
    rows = rows_of("full", None, "question", scores) + rows_of("snapkv", 0.25, "question", scores, kept=25)
    rows += rows_of("kvzip", 0.25, "agnostic", scores, kept=25)
    records.save(tmp_path / "ruler.json", ruler_document(rows, "full,snapkv,kvzip", [0.25], 16))
    bench = Path(__file__).parent.parent / "docs" / "results" / "ruler" / "bench_4k_bf16.json"
    text = write_report(tmp_path / "docs" / "R.md", bench_files=[bench], ruler_files=[tmp_path / "ruler.json"])
    text = text.read_text()
    assert "| kvzip | 0.25 | agnostic | 100.0 |" in text
    table = text.split("### 4096 prompt tokens")[1].split("\n\n")[1]
    methods = [row.split("|")[1].strip() for row in table.splitlines()[2:]]
    assert "snapkv" in methods and "full" in methods and "kvzip" not in methods


def test_a_board_of_many_methods_draws_no_two_alike():
    """The figure's colour cycle has 10 colours; the agnostic panel alone holds more methods than that."""
    from kvsieve.eval.report_leaderboard import line_styles

    looks = line_styles([f"m{i}" for i in range(25)])
    assert len(set(looks.values())) == 25
    assert looks["m0"] == ("C0", "o", "-") and looks["m10"] == ("C0", "^", "--")
