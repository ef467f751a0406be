"""A results document from one run on one machine: presets on RULER (every task that runs offline, at KV budgets of
0.1, 0.25, 0.5 and 0.75 of the prompt, with the question and question-agnostic), on the needle and passkey probes,
and their cost (time to first token, peak memory) against full attention.

    make results                              # docs/RESULTS.md: SmolLM2, every preset; RULER at 4K, probes at 4K, 8K
    make results-gemma                        # docs/gemma3/RESULTS.md: Gemma 3 270M at 4K and 16K (the gemma extra)
    python benchmarks/results.py --report-only     # redraw docs/RESULTS.md from runs/results/

Each step is a `kvsieve` command (printed, and listed in the report); rerunning resumes where a step
stopped, since every command saves its rows as they finish.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from kvsieve.registry import REGISTRY


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
    ruler = [
        [*kvsieve, "ruler", *model, "--methods", args.methods, "--lengths", args.ruler_lengths]
        + ["--samples", str(args.ruler_samples), "--out", str(args.run / "ruler.json")]
    ]
    return [*(ruler if args.ruler_lengths else []), *niah, bench]


def report(args: argparse.Namespace) -> list[str]:
    run = args.run
    return [
        sys.executable, "-m", "kvsieve.cli", "report",
        "--niah", str(run / "needle.json"), "--niah", str(run / "passkey.json"), "--bench", str(run / "bench.json"),
        *(["--ruler", str(run / "ruler.json")] if args.ruler_lengths or (run / "ruler.json").is_file() else []),
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
    parser.add_argument("--ruler-samples", type=int, default=10, help="RULER cases per task and length (default 10)")
    parser.add_argument("--run", type=Path, default=Path("runs/results"), help="folder of the result files")
    parser.add_argument(
        "--out", type=Path, default=Path("docs/RESULTS.md"), help="the report (default docs/RESULTS.md)"
    )
    parser.add_argument("--report-only", action="store_true", help="only redraw the report from --run's files")
    args = parser.parse_args()
    steps = ([] if args.report_only else commands(args)) + [report(args)]
    for step in steps:
        print("+", " ".join(step[2:] if step[0] == sys.executable else step), flush=True)
        subprocess.run(step, check=True)


if __name__ == "__main__":
    main()
