"""`kvsieve.fast_paths`: the decoding steps' switches, from the environment, changed in process without it."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import build_model

from kvsieve import fast_paths
from kvsieve.engine.batch import DecodeBatch
from kvsieve.errors import KvsieveError
from kvsieve.kernels.attention import supports
from kvsieve.kernels.products import fused_rows


def test_the_environment_gives_the_defaults_and_a_bad_value_says_what_to_write(monkeypatch):
    assert fast_paths.FastPaths.from_environment({}) == fast_paths.FastPaths()
    read = fast_paths.FastPaths.from_environment({"KVSIEVE_COMPILED_STEPS": "on", "KVSIEVE_FUSED_PRODUCTS": "0"})
    assert read.compiled_steps and not read.fused_products and read.attention_kernel and read.cuda_graphs
    assert fast_paths.FastPaths.from_environment(read.environment()) == read  # what a worker process reads back
    with pytest.raises(KvsieveError, match="KVSIEVE_CUDA_GRAPHS='maybe': use 1 or 0"):
        fast_paths.FastPaths.from_environment({"KVSIEVE_CUDA_GRAPHS": "maybe"})
    # read at first use, not at import: a command reports the bad value as its error, not as a traceback
    monkeypatch.setattr(fast_paths, "_current", None)
    monkeypatch.setenv("KVSIEVE_COMPILED_STEPS", "maybe")
    with pytest.raises(KvsieveError, match="KVSIEVE_COMPILED_STEPS"):
        fast_paths.current()


def test_switches_change_the_paths_taken_in_process_without_writing_the_environment():
    """`using` turns each path off for a block and restores it; `configure(compiled_steps=True)` (the CLI's
    --compile-steps) makes new batches compile their steps; the environment is never written."""
    environ = dict(os.environ)
    query, key = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 9, 64)
    x = torch.randn(1, 64)
    assert supports(query, key, key) and fused_rows(x, 8)
    with fast_paths.using(attention_kernel=False, fused_products=False) as switches:
        assert not switches.attention_kernel and not supports(query, key, key) and not fused_rows(x, 8)
    assert supports(query, key, key) and fused_rows(x, 8)
    model = build_model("llama")
    assert not DecodeBatch(model).compiled
    before = fast_paths.configure(compiled_steps=True)
    try:
        assert DecodeBatch(model).compiled and DecodeBatch(model).static
        assert fast_paths.environment()["KVSIEVE_COMPILED_STEPS"] == "1"  # what `kvsieve bench` gives its workers
    finally:
        fast_paths.configure(compiled_steps=before.compiled_steps)
    assert dict(os.environ) == environ
    with pytest.raises(KvsieveError, match="Unknown fast path"):
        fast_paths.configure(flash=True)
