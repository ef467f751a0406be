"""kvsieve's registered attention function, its bottom-right mask and its hooks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import make_prompt

from kvsieve.attention import (
    ATTENTION_NAME,
    NO_HOOKS,
    StopForward,
    attention_hooks,
    bottom_right_causal_mask,
    dense_attention,
    kvsieve_attention,
    repeat_kv,
)
from kvsieve.attention import dense as dense_module
from kvsieve.models import with_cache

pytestmark = pytest.mark.usefixtures("single_thread")


def reference_attention(query, key, value, scaling=None):
    """Eager softmax attention, bottom-right causal, GQA by index (head h reads KV head h // n_rep)."""
    b, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    n_rep = heads // kv_heads
    scale = 1 / math.sqrt(dim) if scaling is None else scaling
    out = torch.zeros_like(query)
    for batch in range(b):
        for h in range(heads):
            k, v = key[batch, h // n_rep], value[batch, h // n_rep]
            for i in range(q_len):
                visible = k_len - q_len + i + 1  # query i sits at position k_len - q_len + i
                weights = torch.softmax((k[:visible] @ query[batch, h, i]) * scale, dim=0)
                out[batch, h, i] = weights @ v[:visible]
    return out


def test_prepare_routes_attention_through_kvsieve(tiny_model):
    assert tiny_model.config._attn_implementation == ATTENTION_NAME
    calls = []
    with torch.no_grad(), attention_hooks(observers=[lambda layer, q, k: calls.append(layer)]):
        tiny_model(make_prompt(12).ids)
    assert calls == [0, 1]


@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_full_prompt_logits_match_transformers_attention(tiny_model, reference):
    ids = make_prompt(40).ids
    with torch.no_grad():
        ours = tiny_model(ids).logits
        tiny_model.set_attn_implementation(reference)
        theirs = tiny_model(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_cached_chunks_and_steps_match_one_full_pass(tiny_model):
    """Chunked prefill (q_len < k_len, bottom-right mask) and 1-token steps reproduce a full pass."""
    ids = make_prompt(30).ids
    with torch.no_grad():
        full = tiny_model(ids).logits[0]
        first = tiny_model(ids[:, :17], use_cache=True)
        chunk = tiny_model(
            ids[:, 17:26], position_ids=torch.arange(17, 26)[None], **with_cache(tiny_model, first.past_key_values)
        )
        steps = []
        cache = chunk.past_key_values
        for pos in range(26, 30):
            out = tiny_model(ids[:, pos : pos + 1], position_ids=torch.tensor([[pos]]), **with_cache(tiny_model, cache))
            steps.append(out.logits[0, -1])
    torch.testing.assert_close(first.logits[0], full[:17], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunk.logits[0], full[17:26], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(steps), full[26:30], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("q_len", "k_len"), [(1, 1), (1, 7), (5, 5), (3, 8), (6, 7), (4, 20)])
def test_bottom_right_causal_mask_matches_loop(q_len, k_len):
    expected = torch.zeros(q_len, k_len, dtype=torch.bool)
    for i in range(q_len):
        for j in range(k_len):
            expected[i, j] = j <= k_len - q_len + i
    mask = bottom_right_causal_mask(q_len, k_len)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)
    # The last query always sees every key; the first sees exactly k_len - q_len + 1 of them.
    assert mask[-1].all()
    assert int(mask[0].sum()) == k_len - q_len + 1


def test_repeat_kv_maps_query_head_to_kv_head_by_integer_division():
    x = torch.arange(3).float().view(1, 3, 1, 1).expand(1, 3, 2, 4)
    repeated = repeat_kv(x, 2)
    assert repeated.shape == (1, 6, 2, 4)
    assert [int(repeated[0, h, 0, 0]) for h in range(6)] == [0, 0, 1, 1, 2, 2]
    assert repeat_kv(x, 1) is x


@pytest.mark.parametrize(("q_len", "k_len"), [(3, 9), (1, 9), (9, 9), (8, 9)])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_dense_attention_matches_eager_reference_with_gqa(q_len, k_len, scaling):
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 6, 2, 8
    query = torch.randn(1, heads, q_len, dim, generator=generator)
    key = torch.randn(1, kv_heads, k_len, dim, generator=generator)
    value = torch.randn(1, kv_heads, k_len, dim, generator=generator)
    out = dense_attention(query, key, value, scaling)
    assert out.shape == (1, heads, q_len, dim)
    torch.testing.assert_close(out, reference_attention(query, key, value, scaling), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("takes_groups", [True, False])
@pytest.mark.parametrize(("q_len", "k_len"), [(3, 9), (8, 9), (5, 40)])
def test_cudas_lower_right_attention_equals_the_masked_one(q_len, k_len, dtype, takes_groups, monkeypatch):
    """CUDA's path for fewer queries than keys (PyTorch's lower-right causal bias, grouped heads as they are in half
    precision or repeated, and repeated on releases whose bias takes no groups), run here on CPU tensors (where
    PyTorch builds the mask itself), gives the masked path's attention: the same alignment, the same heads."""
    monkeypatch.setattr(dense_module, "_BIAS_TAKES_GROUPS", takes_groups)
    generator = torch.Generator().manual_seed(q_len)
    query = torch.randn(1, 6, q_len, 8, generator=generator).to(dtype)
    key = torch.randn(1, 2, k_len, 8, generator=generator).to(dtype)
    value = torch.randn(1, 2, k_len, 8, generator=generator).to(dtype)
    out = dense_module.lower_right_attention(query, key, value, 0.3)
    masked = dense_module.masked_attention(query, key, value, bottom_right_causal_mask(q_len, k_len), 0.3)
    torch.testing.assert_close(out, masked, atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)
    expected = reference_attention(query.float(), key.float(), value.float(), 0.3)
    torch.testing.assert_close(out.float(), expected, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_attention_on_cuda_runs_the_lower_right_bias(dtype):
    """On CUDA fewer queries than keys go through the lower-right causal bias (flash in bfloat16, memory-efficient in
    float32) and give the masked path's attention on the same device."""
    assert torch.cuda.is_available(), "the gpu tests need CUDA (run them with `make test-gpu` on a GPU machine)"
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 32, 256, 128, generator=generator).to("cuda", dtype)
    key, value = (torch.randn(1, 8, 1024, 128, generator=generator).to("cuda", dtype) for _ in range(2))
    out = dense_attention(query, key, value, None)
    masked = dense_module.masked_attention(query, key, value, bottom_right_causal_mask(256, 1024, "cuda"), None)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out, masked, atol=tol, rtol=tol)


def test_masked_attention_reads_grouped_heads_as_repeated_ones():
    """On a CPU the KV heads go to SDPA as they are (enable_gqa), bit for bit what repeating them gives."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 6, 16, 8, generator=generator)
    key, value = torch.randn(2, 1, 2, 40, 8, generator=generator)
    mask = bottom_right_causal_mask(16, 40) & (torch.rand(16, 40, generator=generator) > 0.3)
    mask[:, -1] = True  # every query sees a key
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, 3), repeat_kv(value, 3), attn_mask=mask, scale=0.3
    )
    assert torch.equal(dense_module.masked_attention(query, key, value, mask, 0.3), repeated)


def test_dense_attention_is_not_top_left_causal():
    """With q_len < k_len the first query must see the whole prefix, not just key 0."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 2, 2, 4, generator=generator)
    key = torch.randn(1, 1, 6, 4, generator=generator)
    value = torch.randn(1, 1, 6, 4, generator=generator)
    out = dense_attention(query, key, value, None)
    top_left_first_row = value[0, 0, 0]  # what a top-left mask would give query 0 (only key 0 visible)
    assert not torch.allclose(out[0, 0, 0], top_left_first_row)


def _call(query, key, value, layer_idx=3):
    return kvsieve_attention(SimpleNamespace(layer_idx=layer_idx), query, key, value, None, scaling=None)


def _qkv(q_len, k_len=6):
    generator = torch.Generator().manual_seed(q_len)
    return (
        torch.randn(1, 4, q_len, 8, generator=generator),
        torch.randn(1, 2, k_len, 8, generator=generator),
        torch.randn(1, 2, k_len, 8, generator=generator),
    )


def test_kvsieve_attention_without_hooks_is_dense_and_transposed():
    query, key, value = _qkv(4)
    out, weights = _call(query, key, value)
    assert weights is None
    assert out.shape == (1, 4, 4, 8)  # (b, q, h, d)
    torch.testing.assert_close(out, reference_attention(query, key, value).transpose(1, 2))


def test_a_forward_given_no_hooks_reads_none_of_the_contexts():
    """What the compiled decoding step passes (`kvsieve_hooks=NO_HOOKS`): the active observers and kernel are not
    called; without the argument the same call runs them."""
    seen = []

    def kernel(layer, q, k, v, scaling):
        seen.append("kernel")
        return torch.full_like(q, 2.0)

    query, key, value = _qkv(4)
    module = SimpleNamespace(layer_idx=0)
    with attention_hooks(observers=[lambda *args: seen.append("observer")], prefill=kernel):
        out, _ = kvsieve_attention(module, query, key, value, None, kvsieve_hooks=NO_HOOKS)
        assert seen == []
        torch.testing.assert_close(out, reference_attention(query, key, value).transpose(1, 2))
        out, _ = kvsieve_attention(module, query, key, value, None)
        assert seen == ["observer", "kernel"] and torch.all(out == 2.0)


def test_nested_hooks_keep_outer_observers_and_kernel():
    seen = []
    kernel_calls = []

    def outer_kernel(layer, q, k, v, scaling):
        kernel_calls.append(("outer", layer))
        return torch.full_like(q, 1.0)

    def inner_kernel(layer, q, k, v, scaling):
        kernel_calls.append(("inner", layer))
        return torch.full_like(q, 2.0)

    def observer(name):
        return lambda layer, q, k: seen.append((name, layer, q.shape[2], k.shape[2]))

    query, key, value = _qkv(4)
    with attention_hooks(observers=[observer("outer")], prefill=outer_kernel):
        with attention_hooks(observers=[observer("inner")]):
            out, _ = _call(query, key, value, layer_idx=1)
            assert torch.all(out == 1.0)  # outer kernel kept
        assert seen == [("outer", 1, 4, 6), ("inner", 1, 4, 6)]
        assert kernel_calls == [("outer", 1)]

        with attention_hooks(prefill=inner_kernel):
            out, _ = _call(query, key, value, layer_idx=2)
            assert torch.all(out == 2.0)  # inner kernel replaces the outer one inside
        assert kernel_calls[-1] == ("inner", 2)

        # Back in the outer block: the inner observer is gone, the outer kernel is back.
        seen.clear()
        out, _ = _call(query, key, value, layer_idx=0)
        assert torch.all(out == 1.0)
        assert seen == [("outer", 0, 4, 6)]

        # One-token queries (decoding) never use the prefill kernel.
        q1, k1, v1 = _qkv(1)
        out, _ = _call(q1, k1, v1)
        torch.testing.assert_close(out, reference_attention(q1, k1, v1).transpose(1, 2))

    # Outside every block: no observers, no kernel.
    seen.clear()
    calls_before = len(kernel_calls)
    out, _ = _call(query, key, value)
    torch.testing.assert_close(out, reference_attention(query, key, value).transpose(1, 2))
    assert seen == [] and len(kernel_calls) == calls_before


def test_observer_stop_forward_ends_the_pass(make_model):
    model = make_model("llama", num_layers=4)
    layers_seen = []

    def stop_at_two(layer, q, k):
        layers_seen.append(layer)
        if layer == 2:
            raise StopForward

    with torch.no_grad(), attention_hooks(observers=[stop_at_two]), pytest.raises(StopForward):
        model.model(input_ids=make_prompt(10).ids, use_cache=False)
    assert layers_seen == [0, 1, 2]


def test_kernel_is_used_inside_a_real_model(make_model):
    model = make_model("qwen2")
    ids = make_prompt(12).ids

    def zero_kernel(layer, q, k, v, scaling):
        return torch.zeros_like(q)

    with torch.no_grad():
        plain = model(ids).logits
        with attention_hooks(prefill=zero_kernel):
            zeroed = model(ids).logits
    assert not torch.allclose(plain, zeroed, atol=1e-3)
