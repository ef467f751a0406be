"""The fused CPU product of a decoding step's few rows (`kvsieve.linear`, given to every model by `prepare`).

It must compute what `F.linear` computes (up to the order of a float32 sum) for every row count and
dtype it takes, leave larger products, small weights, grad-enabled ones and other dtypes to PyTorch, keep the model's
parameters, tied weights and state dict, fall back with a warning where it cannot compile, and turn off
with `set_enabled(False)`.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import build_model, tiny_config

import kvsieve.compiled as compiled_module
import kvsieve.linear as linear_module
from kvsieve import prepare
from kvsieve.compiled import Compiled
from kvsieve.linear import FusedLinear, fuse_linears

SMALLEST_FUSED = linear_module.FUSED_MIN_WEIGHT


@pytest.fixture(autouse=True)
def every_weight_fused(monkeypatch):
    """The tests' small weights take the kernel too (by default only weights of `FUSED_MIN_WEIGHT` elements do)."""
    monkeypatch.setattr(linear_module, "FUSED_MIN_WEIGHT", 0)


def counted(monkeypatch) -> list[int]:
    """Count the fused kernel's calls (the rows of each)."""
    calls: list[int] = []
    products = linear_module.float_products

    def counting(x, weight):
        calls.append(x.shape[0])
        return products(x, weight)

    monkeypatch.setattr(linear_module, "float_products", counting)
    return calls


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_fused_product_equals_pytorchs(monkeypatch, single_thread, dtype, tolerance):
    torch.manual_seed(0)
    layer = fuse_linears(torch.nn.Linear(48, 40, bias=True, dtype=dtype))
    calls = counted(monkeypatch)
    with torch.no_grad():
        for rows in (1, 3, 8, 9):
            x = torch.randn(rows, 48, dtype=dtype)
            out = layer(x)
            assert out.dtype == dtype and out.shape == (rows, 40)
            torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=tolerance, atol=tolerance)
        x = torch.randn(2, 1, 48, dtype=dtype)  # (batch, 1, in): a decoding step's shape
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=tolerance, atol=tolerance)
    # float32 takes it up to 4 rows, bfloat16 for one row only (where each measured faster than PyTorch's)
    assert calls == ([1, 3, 2] if dtype == torch.float32 else [1])


def test_other_dtypes_gradients_and_a_switch_keep_pytorchs_product(monkeypatch):
    calls = counted(monkeypatch)
    x = torch.randn(1, 16, dtype=torch.float64)
    layer = fuse_linears(torch.nn.Linear(16, 8, dtype=torch.float64))
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer = fuse_linears(torch.nn.Linear(16, 8))
    x = torch.randn(1, 16)
    out = layer(x)  # gradients on: PyTorch's product, which autograd differentiates
    out.sum().backward()
    assert layer.weight.grad is not None
    monkeypatch.setattr(linear_module, "_enabled", False)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == []


def test_weights_below_the_threshold_keep_pytorchs_product(monkeypatch):
    """Only weights of at least `FUSED_MIN_WEIGHT` elements take the kernel: a smaller one is as fast in MKL's
    product and would only pay for a compiled call (a tiny test model compiles nothing)."""
    monkeypatch.setattr(linear_module, "FUSED_MIN_WEIGHT", SMALLEST_FUSED)
    calls = counted(monkeypatch)
    small, smallest_fused = (fuse_linears(torch.nn.Linear(n, 256, bias=False)) for n in (64, SMALLEST_FUSED // 256))
    with torch.no_grad():
        x = torch.randn(1, 64)
        assert torch.equal(small(x), F.linear(x, small.weight))
        assert calls == []
        x = torch.randn(1, SMALLEST_FUSED // 256)
        torch.testing.assert_close(smallest_fused(x), F.linear(x, smallest_fused.weight))
    assert calls == [1]


def test_prepare_fuses_every_linear_and_keeps_weights_tied():
    config = tiny_config("llama")
    config.tie_word_embeddings = True
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    keys = set(model.state_dict())
    prepare(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is FusedLinear for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert set(model.state_dict()) == keys
    assert type(build_model("phi3").model.layers[0].self_attn.qkv_proj) is FusedLinear


def test_a_decoding_model_calls_the_fused_product_and_decodes_as_pytorchs(monkeypatch, single_thread):
    from conftest import FakeTokenizer, make_prompt

    from kvsieve import Sampling, method, run

    model = build_model("llama")
    prompt = make_prompt(40)
    sampling = Sampling(max_new_tokens=8)
    calls = counted(monkeypatch)
    fused = run(model, FakeTokenizer(), prompt, method=method("full"), sampling=sampling)
    assert calls and max(calls) == 1  # the prefill's 40 rows went to PyTorch, every step's one row here
    monkeypatch.setattr(linear_module, "_enabled", False)
    assert run(model, FakeTokenizer(), prompt, method=method("full"), sampling=sampling).tokens == fused.tokens


def test_inside_a_compiled_graph_the_product_is_traced_not_called():
    """A user's `torch.compile` of a model with fused linears traces the product into its own graph (fullgraph:
    no break at the kernel's compile-once machinery)."""
    layer = fuse_linears(torch.nn.Linear(24, 16))
    x = torch.randn(1, 24)
    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias))


def test_every_thread_that_multiplies_may_recompile(single_thread):
    """Dynamo's recompile limit is a per-thread setting (torch >= 2.12): a thread that calls the kernel (the
    server's engine thread) raises its own, or its ninth variant would run the product eagerly (slower, and
    rounded differently from the same product in another thread)."""
    import threading

    layer = fuse_linears(torch.nn.Linear(16, 8))
    x = torch.randn(1, 16)
    with torch.no_grad():
        expected = layer(x)
    seen = {}

    def work() -> None:
        with torch.no_grad():
            seen["out"] = layer(x)
        seen["limit"] = torch._dynamo.config.recompile_limit

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["limit"] >= compiled_module.RECOMPILES
    assert torch.equal(seen["out"], expected)


def test_a_failed_compile_falls_back_to_pytorchs_product(monkeypatch, caplog):
    monkeypatch.setattr(
        linear_module, "float_products", Compiled("fused product, float weights", linear_module.float_product)
    )

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    layer = fuse_linears(torch.nn.Linear(16, 8))
    x = torch.randn(1, 16)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="kvsieve.compiled"):
        out = layer(x)
        assert torch.equal(layer(x), out)  # tried once: the second call goes straight to PyTorch's product
    assert caplog.text.count("no compiler here") == 1 and linear_module.float_products.failed
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


def test_warm_up_compiles_the_kernels_a_decoding_step_calls(monkeypatch):
    """`warm_up` (what `kvsieve serve` runs before answering) leaves the kernel compiled; with the kernels off it
    runs nothing."""
    fresh = Compiled("fused product, float weights", linear_module.float_product)
    monkeypatch.setattr(linear_module, "float_products", fresh)
    model = build_model("llama")
    monkeypatch.setattr(linear_module, "_enabled", False)
    assert linear_module.warm_up(model) == 0.0 and fresh.compiled is None
    monkeypatch.setattr(linear_module, "_enabled", True)
    assert linear_module.warm_up(model) > 0 and fresh.compiled is not None and not fresh.failed
