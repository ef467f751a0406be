"""The C++ kernels' library (`kvsieve.kernels.native`): built once per machine and reused, and where it cannot be built
(no compiler, a compiler that fails) one warning, then PyTorch's attention and products answer instead."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvsieve.attention import dense_attention, grouped_attention
from kvsieve.kernels import native
from kvsieve.kernels.attention import kernel_attention
from kvsieve.kernels.products import fuse_linears
from kvsieve.quantize import Int8Linear


def test_a_built_library_is_reused(monkeypatch):
    assert native.load()
    path = native.library_path()
    assert path.exists()

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(native.subprocess, "run", no_compiler)
    assert native.build() == path


@pytest.mark.parametrize(
    ("compiler", "said"),
    [
        ("false", "compiling attention.cpp, products.cpp, eviction.cpp failed"),
        ("/no/such/c++", "no C++ compiler '/no/such/c++'"),
    ],
)
def test_without_a_compiler_pytorch_answers_after_one_warning(compiler, said, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", compiler)  # a compiler that fails, one that is not there
    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", None)
    generator = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 1, 2, 40, 16, generator=generator)
    query = torch.randn(1, 4, 1, 16, generator=generator)
    layer = fuse_linears(torch.nn.Linear(16, 8))
    int8 = Int8Linear(torch.nn.Linear(16, 8))
    x = torch.randn(1, 16, generator=generator)
    with caplog.at_level(logging.WARNING, logger="kvsieve.kernels"), torch.no_grad():
        assert kernel_attention(query, key, value, None) is None
        out = dense_attention(query, key, value, None)
        product = layer(x)
        int8_product = int8(x)
    assert len(caplog.records) == 1 and "unavailable" in caplog.records[0].message
    assert said in caplog.records[0].message
    torch.testing.assert_close(out, grouped_attention(query, key, value, None), rtol=1e-5, atol=1e-5)
    assert torch.equal(product, F.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(int8_product, F.linear(x, int8.dequantized(), int8.bias))
    assert not list(tmp_path.rglob("*.so"))


def test_every_source_and_header_is_shipped_in_the_package():
    """A wheel holds what pyproject's package data names: a kernel file it missed would leave an installed
    kvsieve without its kernels (one warning, then PyTorch's slower operators)."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11's TOML reader (the project's CI runs 3.11)")
    root = Path(native.__file__).parents[1]  # the package's folder, which package data is relative to
    patterns = tomllib.loads((root.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {path for pattern in patterns["kvsieve"] for path in root.glob(pattern)}
    assert {*native.SOURCES, *native.HEADERS} <= shipped
    assert f'#include "{native.SOURCES[0].resolve()}"' in native.unity_source()
