"""Weight-only int8 (`kvsieve.quantize`, `--quantize int8`).

The exact invariant: an int8 model computes what the float model whose weights are the dequantized
int8 ones (scale x q) computes, through the prefill's dequantized product and through the decoding
step's fused, compiled kernel alike; so greedy answers are the same tokens. Besides: the rounding
stays within half a step per weight, a head tied to the embedding gets its own int8 copy while the
embedding stays float, a compile failure falls back to the dequantized product, and unknown schemes
are refused with the choices.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import FakeTokenizer, build_model, make_prompt

import kvsieve.kernels.products as products
from kvsieve import KvsieveError, Sampling, method, run
from kvsieve.engine.pipeline import prefill
from kvsieve.kernels.products import int8_linear, kernel_product
from kvsieve.quantize import Int8Linear, quantize


def dequantized_twin(model: torch.nn.Module, quantized: torch.nn.Module) -> torch.nn.Module:
    """A float copy of `model` whose linear weights are `quantized`'s dequantized int8 ones."""
    twin = copy.deepcopy(model)
    linears = {name: m for name, m in quantized.named_modules() if isinstance(m, Int8Linear)}
    for name, module in twin.named_modules():
        if name in linears:
            module.weight = torch.nn.Parameter(linears[name].dequantized(), requires_grad=False)
    return twin


@pytest.mark.parametrize("arch", ["llama", "phi3"])  # separate q/k/v projections, and Phi-3's fused qkv
def test_an_int8_model_computes_what_its_dequantized_weights_compute(arch, single_thread, monkeypatch):
    model = build_model(arch, num_layers=2)
    quantized = quantize(copy.deepcopy(model), "int8")
    linears = [m for m in quantized.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * (7 if arch == "llama" else 4) + 1  # every projection and the head
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    assert quantized.dtype == torch.float32  # int8 weights are buffers; the activations keep the dtype
    twin = dequantized_twin(model, quantized)
    prompt, spec, sampling = make_prompt(60), method("snapkv", {"compress.budget": 32}), Sampling(max_new_tokens=6)

    # the prefill: 60 rows, the dequantized product
    ours = prefill(quantized, prompt, method=spec).prefilled.last_logits
    torch.testing.assert_close(ours, prefill(twin, prompt, method=spec).prefilled.last_logits, rtol=1e-5, atol=1e-5)
    # decoding: one row per step, the C++ kernel
    calls = []
    monkeypatch.setattr(products, "kernel_product", lambda *args: calls.append(args) or kernel_product(*args))
    answer = run(quantized, FakeTokenizer(), prompt, method=spec, sampling=sampling)
    assert calls and all(scale is not None for _, _, scale in calls)
    assert answer.tokens == run(twin, FakeTokenizer(), prompt, method=spec, sampling=sampling).tokens
    float_logits = prefill(model, prompt, method=spec).prefilled.last_logits
    assert not torch.allclose(ours, float_logits, rtol=1e-5, atol=1e-5)  # int8 did change the weights
    assert (ours - float_logits).abs().max() < 0.05 * float_logits.abs().max()  # ... by little


def test_the_fused_product_equals_the_dequantized_one_for_a_few_rows(single_thread):
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(48, 40, bias=True))
    for rows in (1, 3, 8, 9):  # 9 rows: past KERNEL_ROWS, the dequantized product
        x = torch.randn(2, rows, 48)
        expected = torch.nn.functional.linear(x, layer.dequantized(), layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    x = torch.randn(1, 48, dtype=torch.bfloat16)  # bfloat16 activations: computed in float32, returned in bf16
    out = int8_linear(x, layer.weight, layer.scale, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ layer.dequantized().T, rtol=2e-2, atol=2e-2)


def test_rounding_stays_within_half_a_step_per_weight():
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        linear.weight[3] = 0  # an all-zero row: a tiny scale, no NaN
        linear.weight[5, 7] = 50.0  # an outlier sets its row's scale
    layer = Int8Linear(linear)
    assert layer.weight.dtype == torch.int8 and layer.weight.abs().max() == 127
    error = (layer.dequantized() - linear.weight).abs()
    assert torch.all(error <= layer.scale[:, None] / 2 + 1e-7)
    assert torch.isfinite(layer.dequantized()).all() and layer.dequantized()[3].abs().max() == 0


def test_a_head_tied_to_the_embedding_gets_its_own_int8_copy(single_thread):
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight.detach().clone()
    quantize(model, "int8")
    assert isinstance(model.lm_head, Int8Linear) and not model.config.tie_word_embeddings
    assert model.model.embed_tokens.weight.dtype == torch.float32
    torch.testing.assert_close(model.model.embed_tokens.weight, embedding)  # the embedding is left as it was
    torch.testing.assert_close(model.lm_head.dequantized(), embedding, rtol=0, atol=embedding.abs().max() / 254)


def test_unknown_schemes_are_refused_with_the_choices(tmp_path):
    from kvsieve import load_model

    with pytest.raises(KvsieveError, match="none, int8"):
        quantize(build_model("llama"), "int4")
    with pytest.raises(KvsieveError, match="none, int8"):
        load_model(str(tmp_path), quantize="fp4")  # checked before anything loads


def test_result_files_record_int8_weights_so_runs_never_mix():
    """A niah/ppl run file's model settings name int8 weights, so rerunning without them does not resume it (and a
    float model's settings stay as files written before quantization existed have them)."""
    from kvsieve.eval.records import model_settings

    model = build_model("llama")
    assert model_settings(model, None) == {"model": None, "dtype": "float32", "device": "cpu"}
    assert model_settings(quantize(model, "int8"), None)["quantize"] == "int8"
