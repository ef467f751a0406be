"""The device check (benchmarks/gpu_check.py) dry-run on the CPU at a tiny scale, so it works the first time a GPU
machine is lent: both models built from the configs in the repository, every method and transformers' own prefill
measured, the page and its result files written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_end_to_end_at_a_tiny_scale(tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--repeats", "1"]
    proc = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ["transformers", "full", "gemfilter", "critiprefill", "gemfilter-critiprefill", "imdc", "fm", "snapkv"]
    for model in ("llama-3.1-8b", "gemma-3-270m"):
        rows = json.loads((tmp_path / f"{model}.json").read_text())["rows"]
        assert sorted(row["method"] for row in rows) == sorted(names)
        assert all(row["ttft_s"] > 0 and row["length"] == 1024 for row in rows)
        kept = {row["method"]: row["prefill_kv_length"] for row in rows}
        assert kept["full"] == kept["transformers"] == 1024 and kept["snapkv"] == kept["gemfilter"] == 128
    page = (tmp_path / "RESULTS.md").read_text()
    assert "## Goals" in page and "## llama-3.1-8b, 1024 tokens" in page and "## gemma-3-270m, 1024 tokens" in page
    assert page.count("| transformers |") == 2 and (tmp_path / "scaling.png").stat().st_size > 0
