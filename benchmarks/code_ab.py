"""The same `kvsieve bench` configurations under two source trees, interleaved: whether a change made a method slower.

Each (repeat, method, tree) runs in its own process (`kvsieve.eval.bench`'s worker, as `kvsieve bench` runs it) with
PYTHONPATH set to that tree's src/, the two trees back to back and which goes first alternating, so a noisy machine
(or whatever the second of two runs pays) hits both alike;
the ratio after/before is taken within a repeat. Make the "before" tree with `git worktree add ../before REV`.

    python benchmarks/code_ab.py --before ../before/src --methods critiprefill,gemfilter --length 8000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from kvsieve import method
from kvsieve.eval.bench import BenchConfig

HERE = Path(__file__).resolve().parents[1] / "src"


def worker(source: Path, config: BenchConfig) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvsieve.eval.bench", config.to_json()], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker failed under {source}:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other tree's src/ folder")
    parser.add_argument("--after", type=Path, default=HERE, help="this tree's src/ (default)")
    parser.add_argument("--methods", default="critiprefill,gemfilter")
    parser.add_argument("--length", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("runs/code_ab.json"))
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    rows = []
    for repeat in range(args.repeats):
        for name in args.methods.split(","):
            config = BenchConfig(method(name).to_dict(), args.length, args.decode_tokens)
            order = list(trees.items()) if (repeat + len(rows)) % 2 == 0 else list(trees.items())[::-1]
            for tree, source in order:  # which tree goes first alternates, so neither always runs second
                row = {**worker(source, config), "tree": tree, "repeat": repeat}
                rows.append(row)
                print(f"r{repeat} {name} {tree}: TTFT {row['ttft_s']:.2f} s, peak {row['peak_mb']:.0f} MB", flush=True)
    summary = {}
    for name in args.methods.split(","):
        mine = {(r["repeat"], r["tree"]): r for r in rows if r["method"] == name}
        summary[name] = {}
        for field in ("ttft_s", "peak_mb", "decode_tokens_per_s"):  # what `kvsieve bench` reports
            ratios = [mine[(i, "after")][field] / mine[(i, "before")][field] for i in range(args.repeats)]
            summary[name][f"{field}_after_over_before"] = [min(ratios), statistics.median(ratios), max(ratios)]
            print(
                f"{name}: {field} after / before, min / median / max: "
                + " / ".join(f"{r:.3f}" for r in summary[name][f"{field}_after_over_before"])
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", *sys.argv])
    args.out.write_text(json.dumps({"command": command, "summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
