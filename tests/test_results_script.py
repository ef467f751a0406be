"""benchmarks/results.py (`make results`, `make results-gemma`): the RULER steps it runs, read from the commands it
would run (nothing is run: its `run` and the calibration it reads are replaced)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def results_script(monkeypatch):
    """The script as a module whose `run` records each command instead of running it, and whose calibration keeps
    three tasks. Returns (module, the recorded commands)."""
    spec = importlib.util.spec_from_file_location("results_script", ROOT / "benchmarks" / "results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ran: list[list[str]] = []
    monkeypatch.setattr(module, "run", ran.append)
    monkeypatch.setattr(module, "kept_tasks", lambda path: ["niah_single_1", "qa_1", "fwe"])
    return module, ran


def ruler_samples(ran: list[list[str]]) -> dict[str, str]:
    """Each RULER leaderboard command's length and case count (`--samples`), the calibrations left out."""
    boards = [c for c in ran if "ruler" in c and "--modes" in c and c[c.index("--methods") + 1] != "full"]
    return {c[c.index("--lengths") + 1]: c[c.index("--samples") + 1] for c in boards}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--long-samples", "5"], {"4096": "15", "16384": "5"}),  # as `make results-gemma` runs it
        ([], {"4096": "15", "16384": "15"}),  # without it, every length takes --ruler-samples
    ],
)
def test_a_longer_lengths_board_takes_its_own_case_count(results_script, monkeypatch, tmp_path, options, expected):
    module, ran = results_script
    argv = ["results.py", "--ruler-lengths", "4096,16384", "--ruler-samples", "15", *options, "--run", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    module.main()
    assert ruler_samples(ran) == expected
    longer = next(c for c in ran if "16384" in c and c[c.index("--methods") + 1] != "full")
    assert longer[longer.index("--tasks") + 1] == "niah_single_1,qa_1,fwe"  # the best --long-max-tasks (3) kept
