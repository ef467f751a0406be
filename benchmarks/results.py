"""A results document from one run on one machine: the RULER leaderboard (full attention calibrated on every task
that runs offline, then the leaderboard's presets on the tasks it can do, at KV budgets of 0.1, 0.25 and 0.5 of the
prompt, with the question and question-agnostic), the needle and passkey probes, and their cost (time to first
token, peak memory) against full attention.

    make results                              # docs/RESULTS.md: SmolLM2, every preset; RULER at 4K, probes at 4K, 8K
    make results-gemma                        # docs/gemma3/RESULTS.md: Gemma 3 270M at 4K and 16K (the gemma extra)
    python benchmarks/results.py --report-only     # redraw docs/RESULTS.md from runs/results/

Each step is a `kvsieve` command (printed, and listed in the report); rerunning resumes where a step
stopped, since every command saves its rows as they finish.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from kvsieve.eval.leaderboard import calibration as calibrate
from kvsieve.registry import REGISTRY

LEADERBOARD = "full,gemfilter,critiprefill,imdc,a2sf,snapkv,h2o,streaming,tova"  # the four papers' and the baselines


def commands(args: argparse.Namespace) -> list[list[str]]:
    kvsieve = [sys.executable, "-m", "kvsieve.cli"]
    model = ["--model", args.model] if args.model else []
    niah = [
        [*kvsieve, "niah", *model, "--probe", probe, "--methods", args.methods, "--lengths", args.lengths]
        + ["--depths", args.depths, "--out", str(args.run / f"{probe}.json"), "--plots", str(args.run / "plots")]
        for probe in ("needle", "passkey")
    ]
    bench = [
        *kvsieve,
        "bench",
        *model,
        "--methods",
        args.bench_methods or args.methods,
        "--lengths",
        args.bench_lengths,
    ]
    bench += [
        "--repeats",
        "3",
        "--out",
        str(args.run / "bench.json"),
        "--plot",
        str(args.run / "plots" / "scaling.png"),
    ]
    return [*niah, bench]


def calibration(args: argparse.Namespace, length: str, tasks: list[str] | None) -> list[str]:
    """Full attention on `tasks` (None: every RULER task that runs offline) at `length`: the leaderboard keeps the
    tasks it can do."""
    return [
        sys.executable, "-m", "kvsieve.cli", "ruler", *_model(args), "--methods", "full", "--modes", "question",
        *(["--tasks", ",".join(tasks)] if tasks else []), "--lengths", length,
        "--samples", str(args.calibration_samples), "--out", str(args.run / f"ruler_calibration_{length}.json"),
    ]  # fmt: skip


def leaderboard(args: argparse.Namespace, length: str, tasks: list[str], modes: str, samples: int) -> list[str]:
    """The leaderboard's presets on the tasks the calibration kept, `samples` cases a task."""
    return [
        sys.executable, "-m", "kvsieve.cli", "ruler", *_model(args), "--methods", args.ruler_methods,
        "--tasks", ",".join(tasks), "--budgets", args.ruler_budgets, "--modes", modes, "--lengths", length,
        "--samples", str(samples), "--out", str(args.run / f"ruler_{length}.json"),
    ]  # fmt: skip


def kept_tasks(path: Path) -> list[str]:
    """The tasks full attention can do, best first."""
    calibrated = calibrate(json.loads(path.read_text())["rows"])
    return sorted((t for t, c in calibrated.items() if c["kept"]), key=lambda t: -calibrated[t]["score"])


def ruler_steps(args: argparse.Namespace) -> None:
    """Per RULER length: full attention's calibration (at a longer length, on the tasks the shorter one kept), then
    the leaderboard on the tasks it keeps (at a longer length, its best `--long-max-tasks` in `--long-modes`, with
    `--long-samples` cases a task)."""
    tasks = None
    for position, length in enumerate(args.ruler_lengths.split(",")):
        run(calibration(args, length, tasks))
        tasks = kept_tasks(args.run / f"ruler_calibration_{length}.json")
        longer = position > 0
        chosen = tasks[: args.long_max_tasks] if longer and args.long_max_tasks else tasks
        modes = args.long_modes if longer else args.ruler_modes
        samples = (args.long_samples or args.ruler_samples) if longer else args.ruler_samples
        run(leaderboard(args, length, chosen, modes, samples))


def _model(args: argparse.Namespace) -> list[str]:
    return (["--model", args.model] if args.model else []) + ["--dtype", args.ruler_dtype]


def report(args: argparse.Namespace) -> list[str]:
    run = args.run
    return [
        sys.executable, "-m", "kvsieve.cli", "report",
        "--niah", str(run / "needle.json"), "--niah", str(run / "passkey.json"), "--bench", str(run / "bench.json"),
        *(arg for path in sorted(run.glob("ruler_[0-9]*.json")) for arg in ("--ruler", str(path))),
        *(arg for path in sorted(run.glob("ruler_calibration_*.json")) for arg in ("--ruler-calibration", str(path))),
        *(["--notes", "docs/STUDIES.md"] if not args.model else []), "--out", str(args.out),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(REGISTRY), help="presets to run (default: every shipped one)")
    parser.add_argument("--bench-methods", help="presets to time (default: --methods)")
    parser.add_argument("--model", help="model to run (default: the embedded SmolLM2), e.g. gemma3-270m")
    parser.add_argument("--lengths", default="4096,8000", help="probe prompt lengths (default 4096,8000)")
    parser.add_argument("--depths", default="0.5", help="probe depths (default 0.5)")
    parser.add_argument("--bench-lengths", default="8000", help="timed prompt lengths (default 8000)")
    parser.add_argument("--ruler-lengths", default="4096", help="RULER lengths (default 4096; empty: no RULER run)")
    parser.add_argument("--calibration-samples", type=int, default=10, help="full attention's cases per task")
    parser.add_argument("--ruler-samples", type=int, default=20, help="leaderboard cases per task (default 20)")
    parser.add_argument("--ruler-methods", default=LEADERBOARD, help=f"leaderboard presets (default {LEADERBOARD})")
    parser.add_argument("--ruler-budgets", default="0.1,0.25,0.5", help="KV budgets, shares of the prompt")
    parser.add_argument("--ruler-modes", default="question,agnostic", help="question, agnostic or both")
    parser.add_argument(
        "--ruler-dtype", default="bfloat16", help="RULER's dtype (default bfloat16: docs/EVALUATION.md)"
    )
    parser.add_argument("--long-modes", default="question", help="modes after the first RULER length")
    parser.add_argument("--long-samples", type=int, help="cases per task after the first length (default: the first's)")
    parser.add_argument("--long-max-tasks", type=int, default=3, help="tasks after the first length (0: all kept)")
    parser.add_argument("--run", type=Path, default=Path("runs/results"), help="folder of the result files")
    parser.add_argument(
        "--out", type=Path, default=Path("docs/RESULTS.md"), help="the report (default docs/RESULTS.md)"
    )
    parser.add_argument("--report-only", action="store_true", help="only redraw the report from --run's files")
    args = parser.parse_args()
    if not args.report_only and args.ruler_lengths:
        ruler_steps(args)
    for step in ([] if args.report_only else commands(args)) + [report(args)]:
        run(step)


def run(step: list[str]) -> None:
    print("+", " ".join(step[2:] if step[0] == sys.executable else step), flush=True)
    subprocess.run(step, check=True)


if __name__ == "__main__":
    main()
