"""The CPU product of a decoding step's few rows (`kvsieve.kernels.products`, given to every model by `prepare`).

It must compute what `F.linear` computes (up to the order of a float32 sum) for every row count, shape and
dtype it takes, leave larger products, grad-enabled ones and other dtypes to PyTorch, keep the model's
parameters, tied weights and state dict, and turn off with the switch `fused_products` (`kvsieve.fast_paths`).
Where the library cannot be built PyTorch's product runs (test_native.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import build_model, tiny_config

import kvsieve.kernels.products as products
from kvsieve import fast_paths, prepare
from kvsieve.kernels import native
from kvsieve.kernels.products import FusedLinear, fuse_linears, kernel_product
from kvsieve.quantize import Int8Linear


def counted(monkeypatch) -> list[int]:
    """Count the kernel's calls (the rows of each)."""
    calls: list[int] = []

    def counting(x, weight, scale=None):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return kernel_product(x, weight, scale)

    monkeypatch.setattr(products, "kernel_product", counting)
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
    assert calls == [1, 3, 8, 2]  # up to 8 rows (9: PyTorch's)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(("inputs", "outputs"), [(576, 192), (37, 70), (100, 5), (16, 1), (33, 130)])
def test_the_kernel_multiplies_every_shape_row_count_and_weight_dtype(weight_dtype, inputs, outputs):
    """Widths that are not a multiple of the kernel's vectors (a scalar tail), an odd number of output rows (the
    kernel takes two at a time from 5 input rows), more output rows than one thread's share, 1 to 8 rows."""
    generator = torch.Generator().manual_seed(inputs * outputs)
    if weight_dtype == torch.int8:
        weight = torch.randint(-127, 128, (outputs, inputs), dtype=torch.int8, generator=generator)
        scale = torch.rand(outputs, generator=generator)
    else:
        weight, scale = torch.randn(outputs, inputs, generator=generator).to(weight_dtype), None
    exact = weight.double() if scale is None else weight.double() * scale.double()[:, None]
    for rows in range(1, 9):
        x = torch.randn(rows, inputs, generator=generator)
        out = kernel_product(x, weight, scale)
        assert out.dtype == torch.float32 and out.shape == (rows, outputs)
        # a decoding step's (batch, 1, in) as it comes: the same rows, (batch, 1, out)
        assert torch.equal(kernel_product(x.view(rows, 1, inputs), weight, scale), out.view(rows, 1, outputs))
        # a float32 sum's rounding is relative to the sum of the terms' sizes, not to the (cancelling) result
        error = (out.double() - x.double() @ exact.T).abs()
        assert (error <= 1e-5 * (x.double().abs() @ exact.abs().T)).all()


def test_the_kernel_refuses_what_it_does_not_take():
    assert native.load()
    with pytest.raises(RuntimeError, match="1 to 8 rows, got 9"):
        torch.ops.kvsieve.decode_product(torch.randn(9, 4), torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match="1 to 8 rows, got 9"):  # rows are every leading dimension's
        torch.ops.kvsieve.decode_product(torch.randn(3, 3, 4), torch.randn(3, 4), None)
    with pytest.raises(RuntimeError, match=r"x must be \(\.\.\., in\) float32, contiguous"):
        torch.ops.kvsieve.decode_product(torch.randn(4, 2).t(), torch.randn(3, 2), None)
    with pytest.raises(RuntimeError, match="a scale goes with int8 weights"):
        torch.ops.kvsieve.decode_product(torch.randn(1, 4), torch.zeros(3, 4, dtype=torch.int8), None)
    with pytest.raises(RuntimeError, match="with x's in"):
        torch.ops.kvsieve.decode_product(torch.randn(1, 4), torch.randn(3, 5), None)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or int8 weights"):
        torch.ops.kvsieve.decode_product(torch.randn(1, 4), torch.randn(3, 4).half(), None)


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
    with torch.no_grad(), fast_paths.using(fused_products=False):
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == []


def product_dtypes(monkeypatch) -> list[torch.dtype]:
    """Record the dtype each call of PyTorch's product multiplies in."""
    dtypes: list[torch.dtype] = []
    pytorchs = F.linear

    def recording(x, weight, bias=None):
        dtypes.append(x.dtype)
        return pytorchs(x, weight, bias)

    monkeypatch.setattr(products.F, "linear", recording)
    return dtypes


@pytest.mark.parametrize("native", [False, True])
def test_a_bfloat16_product_is_widened_only_where_the_cpu_lacks_bfloat16(monkeypatch, native):
    """A prefill's bfloat16 product (more rows than the kernel takes) on a CPU without native bfloat16 runs in float32
    and comes back in bfloat16, within one bfloat16 step of the exact product (as PyTorch's own is); with native
    bfloat16, or the switch off, PyTorch's bfloat16 product runs as it is."""
    monkeypatch.setattr(products, "native_bfloat16", lambda: native)
    torch.manual_seed(0)
    layer = fuse_linears(torch.nn.Linear(64, 48, bias=True, dtype=torch.bfloat16))
    x = torch.randn(2, 20, 64, dtype=torch.bfloat16)
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    dtypes = product_dtypes(monkeypatch)
    with torch.no_grad():
        out = layer(x)
        assert out.dtype == torch.bfloat16 and out.shape == (2, 20, 48)
        torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-6)
        with fast_paths.using(widened_products=False):
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        quantized = Int8Linear(torch.nn.Linear(64, 48, bias=False))
        assert quantized(x).dtype == torch.bfloat16
    widened = torch.bfloat16 if native else torch.float32
    assert dtypes[0] == widened and dtypes[1] == torch.bfloat16 and dtypes[-1] == widened


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
    with fast_paths.using(fused_products=False):
        assert run(model, FakeTokenizer(), prompt, method=method("full"), sampling=sampling).tokens == fused.tokens


def compiled_calls_the_kernel(layer: torch.nn.Module, x: torch.Tensor) -> bool:
    """Run `layer` on `x` through `torch.compile` (fullgraph: no break at the kernel's load-once machinery), check
    the result against the eager layer's, and say whether the graph dynamo traced calls the C++ product."""
    graphs = []

    def record(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    tolerance = 1e-5 if x.dtype == torch.float32 else 2e-2  # bfloat16: the traced product rounds once, at its end
    with torch.no_grad():
        out = torch.compile(layer, fullgraph=True, backend=record)(x)
        torch.testing.assert_close(out, layer(x), rtol=tolerance, atol=tolerance)
    return any("decode_product" in str(node.target) for graph in graphs for node in graph.graph.nodes)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_inside_a_compiled_graph_one_row_is_traced_and_several_call_the_kernel(kind):
    """Inside a compiled graph (the CPU's compiled step) a one-row product is traced into the graph, where inductor
    fuses it with what surrounds it; two to eight rows call the kernel from the graph (int8 with its scales)."""
    layer = fuse_linears(torch.nn.Linear(24, 16))
    layer = Int8Linear(layer) if kind == "int8" else layer.to(torch.bfloat16) if kind == "bfloat16" else layer
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    generator = torch.Generator().manual_seed(0)
    assert not compiled_calls_the_kernel(layer, torch.randn(1, 24, generator=generator).to(dtype))
    assert compiled_calls_the_kernel(layer, torch.randn(2, 24, generator=generator).to(dtype))
    assert compiled_calls_the_kernel(layer, torch.randn(1, 8, 24, generator=generator).to(dtype))
    assert not compiled_calls_the_kernel(layer, torch.randn(9, 24, generator=generator).to(dtype))  # past 8 rows


def test_warm_up_builds_the_kernels_a_decoding_step_calls(monkeypatch):
    """`warm_up` (what `kvsieve serve` runs before answering) loads the library; with the kernels off it does
    nothing."""
    model = build_model("llama")
    loads: list[bool] = []
    monkeypatch.setattr(native, "load", lambda: loads.append(True) or True)
    with fast_paths.using(fused_products=False, attention_kernel=False):
        assert native.build_kernels(model) == 0.0 and loads == []
    with fast_paths.using(fused_products=False):  # either kernel on: the library is loaded
        native.build_kernels(model)
    assert loads == [True]
