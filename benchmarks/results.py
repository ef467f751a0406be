"""docs/RESULTS.md from one run on one machine: every shipped preset on the needle and passkey probes
at 4K and 8K prompt tokens, and its cost (time to first token, peak memory) against full attention at 8K.

    make results                                   # the whole run, then the report (about 50 min on 2 CPU cores)
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

RUN = Path("runs/results")
LENGTHS = "4096,8000"
DEPTHS = "0.5"


def commands(methods: str) -> list[list[str]]:
    kvsieve = [sys.executable, "-m", "kvsieve.cli"]
    niah = [
        [*kvsieve, "niah", "--probe", probe, "--methods", methods, "--lengths", LENGTHS, "--depths", DEPTHS]
        + ["--out", str(RUN / f"{probe}.json"), "--plots", str(RUN / "plots")]
        for probe in ("needle", "passkey")
    ]
    bench = [*kvsieve, "bench", "--methods", methods, "--lengths", "8000", "--repeats", "3"]
    bench += ["--out", str(RUN / "bench.json"), "--plot", str(RUN / "plots" / "scaling.png")]
    return [*niah, bench]


def report() -> list[str]:
    return [
        sys.executable, "-m", "kvsieve.cli", "report",
        "--niah", str(RUN / "needle.json"), "--niah", str(RUN / "passkey.json"), "--bench", str(RUN / "bench.json"),
        "--notes", "docs/STUDIES.md", "--out", "docs/RESULTS.md",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(REGISTRY), help="presets to run (default: every shipped one)")
    parser.add_argument("--report-only", action="store_true", help="only redraw the report from runs/results/")
    args = parser.parse_args()
    steps = ([] if args.report_only else commands(args.methods)) + [report()]
    for step in steps:
        print("+", " ".join(step[2:] if step[0] == sys.executable else step), flush=True)
        subprocess.run(step, check=True)


if __name__ == "__main__":
    main()
