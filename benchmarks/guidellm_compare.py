"""vLLM's serving benchmark, guidellm, unmodified against `kvsieve serve` and llama.cpp's `llama-server`.

Both serve SmolLM2-135M-Instruct on this machine (kvsieve: the GGUF's weights dequantized to
float32, full attention; llama-server: the same GGUF, Q4_1), one after the other. guidellm sends
its synthetic prompts to /v1/completions (streamed, with `stream_options` and `ignore_eos`, as it
does for vLLM) at 1 and then 4 concurrent streams, with other prompts in each run (a seed per run:
llama-server keeps a prompt's KV in its slot and would answer a repeated prompt from it), and its own
report is kept. The table printed gives, per engine and concurrency, the errored requests, requests/s
(completed requests over the run's duration) and the medians of its time to first token and inter-token
latency.

    make guidellm llama-server
    python benchmarks/guidellm_compare.py --requests 12 --prompt-tokens 1024 --output-tokens 64 \\
        --out docs/results/guidellm

guidellm lives in its own venv (`make guidellm`: it needs torch, which in the project's venv is
pinned to the CPU build); `--guidellm` points at its executable.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from kvsieve.loading import DEFAULT_MODEL, converted_default_dir
from kvsieve.serve.processes import kvsieve_server, llama_server


def engines(parallel: int):
    """(name, context manager yielding the base URL), one engine at a time."""
    yield "kvsieve", kvsieve_server("--method", "full", "--cache-memory", "0", "--max-batch", str(parallel))
    yield "llama-server", llama_server("--parallel", str(parallel), "--threads", str(os.cpu_count()))


def guidellm(args: argparse.Namespace, url: str, streams: int, out: Path) -> dict:
    """One guidellm run at `streams` concurrent streams; its JSON report's first benchmark."""
    command = [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={url},model={DEFAULT_MODEL},request_format=/v1/completions",
        "--tokenizer", f"kind=huggingface_auto,model={converted_default_dir()}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--profile", f"kind=concurrent,streams={streams}",
        "--seed", f"kind=static,value={streams}",  # other prompts per run: no engine answers from a cached prompt
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(out.read_text())["benchmarks"][0]


def summary(engine: str, streams: int, report: dict) -> dict:
    metrics = report["metrics"]
    totals = metrics["request_totals"]
    return {
        "engine": engine,
        "streams": streams,
        "completed": totals["successful"],
        "errored": totals["errored"],
        "requests_per_s": totals["successful"] / report["duration"],
        "ttft_ms_median": metrics["time_to_first_token_ms"]["successful"]["median"],
        "itl_ms_median": metrics["inter_token_latency_ms"]["successful"]["median"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12, help="requests per run")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,4", help="concurrent streams, one run each")
    parser.add_argument("--guidellm", default=".venv-guidellm/bin/guidellm", help="the guidellm executable")
    parser.add_argument("--out", type=Path, default=Path("runs/guidellm"), help="folder for the reports")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    streams = [int(s) for s in args.streams.split(",")]
    rows = []
    for engine, started in engines(max(streams)):
        with started as url:
            for n in streams:
                report = guidellm(args, url, n, args.out / f"{engine}_c{n}.json")
                rows.append(summary(engine, n, report))
    (args.out / "summary.json").write_text(json.dumps({"command": vars(args) | {"out": str(args.out)}, "rows": rows}))
    print(f"{'engine':14s} {'streams':>7s} {'done':>5s} {'errors':>6s} {'req/s':>7s} {'TTFT ms':>9s} {'ITL ms':>8s}")
    for r in rows:
        print(
            f"{r['engine']:14s} {r['streams']:7d} {r['completed']:5d} {r['errored']:6d} {r['requests_per_s']:7.3f}"
            f" {r['ttft_ms_median']:9.1f} {r['itl_ms_median']:8.2f}"
        )


if __name__ == "__main__":
    main()
