"""Where a RULER sweep's time goes: the shared context prefills, each request's prefill, the decode batch's joins,
its steps and its leavers, on the same cases for any version of the code.

    python benchmarks/ruler_profile.py --dtype bfloat16 --tasks niah_single_1,qa_1 --out runs/ruler_profile.json

Each part is timed by wrapping the one function that does it (wall time, the calls counted); the rest of the
wall time is scoring, bookkeeping and the progress bar. The cases are generated into `--cases` once, so two
checkouts profiled with the same `--cases` answer the same prompts (run one with PYTHONPATH=<other checkout>/src).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import kvsieve
from kvsieve import engine, registry
from kvsieve.engine import batch, request, scheduler  # a profiler times the engine's private steps
from kvsieve.eval import ruler

METHODS = "full,gemfilter,critiprefill,imdc,a2sf,snapkv,h2o,streaming,tova"


def timed(owner: object, name: str, label: str, seconds: dict[str, float], calls: dict[str, int]) -> None:
    """Replace `owner.name` by a wrapper that adds its wall time to `seconds[label]`."""
    inner: Callable = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
            calls[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tasks", default="niah_single_1,qa_1")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--methods", default=METHODS)
    parser.add_argument("--budgets", default="0.1,0.25,0.5")
    parser.add_argument("--modes", default="question,agnostic")
    parser.add_argument("--cases", type=Path, default=Path("runs/ruler_profile.cases"))
    parser.add_argument("--out", type=Path, default=Path("runs/ruler_profile.json"))
    args = parser.parse_args()

    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    timed(engine, "fill_prefix_caches", "context prefills shared by the sweep", seconds, calls)
    timed(request.Request, "_prefill", "request prefills (select, feed, compress)", seconds, calls)
    timed(scheduler.Scheduler, "_start_decoding", "joining the decode batch", seconds, calls)
    timed(batch.DecodeBatch, "step", "decode steps (the batch's forward passes)", seconds, calls)
    timed(scheduler.Scheduler, "_finish", "leaving the decode batch", seconds, calls)
    model, tokenizer = kvsieve.load_model(args.model, dtype=args.dtype)
    specs = registry.methods(args.methods)
    with tempfile.TemporaryDirectory() as work:
        start = time.perf_counter()
        document = ruler.run_ruler(
            model, tokenizer, specs, [args.length], Path(work) / "ruler.json",
            tasks=args.tasks.split(","), samples=args.samples, budgets=[float(b) for b in args.budgets.split(",")],
            modes=args.modes.split(","), cases=args.cases, model_name=args.model, say=print,
        )  # fmt: skip
        wall = time.perf_counter() - start
    parts = {label: {"seconds": round(s, 2), "calls": calls[label]} for label, s in seconds.items()}
    parts["the rest (scoring, bookkeeping)"] = {"seconds": round(wall - sum(seconds.values()), 2), "calls": 0}
    answers = {(r["task"], r["index"], r["method"], r["budget"], r["mode"]): r["answer"] for r in document["rows"]}
    prefills: dict[str, float] = defaultdict(float)  # each method's request prefills, over its budgets and modes
    for r in document["rows"]:
        prefills[f"{r['method']} ({r['mode']})"] += r["ttft_s"]
    result = {
        "command": "python " + " ".join(sys.argv),
        "wall_seconds": round(wall, 2),
        "cases": len({(r["task"], r["index"]) for r in document["rows"]}),
        "answers": len(document["rows"]),
        "parts": parts,
        "request_prefills": {name: round(value, 2) for name, value in prefills.items()},
        "rows": [{"key": list(k), "answer": a} for k, a in sorted(answers.items(), key=str)],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wall {wall:.1f} s for {result['answers']} answers of {result['cases']} cases")
    for label, part in parts.items():
        print(f"  {part['seconds']:8.1f} s  {part['calls']:5d} calls  {label}")
    print("request prefills by method:", ", ".join(f"{k} {v:.1f} s" for k, v in prefills.items()))


if __name__ == "__main__":
    main()
