"""Expected Attention: the score equals the paper's formula computed by hand from pre-RoPE queries."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import VOCAB, FakeTokenizer, make_prompt
from transformers import DynamicCache

import kvsieve
from kvsieve import Sampling, run
from kvsieve.attention import attention_hooks
from kvsieve.compress.policies.expected_attention import ExpectedAttention
from kvsieve.compress.scorers import keep_indices
from kvsieve.compress.stages import Compress, score_observers
from kvsieve.engine.prefix_cache import PrefixCache
from kvsieve.errors import KvsieveError
from kvsieve.models import architecture, with_cache


def _pre_rope_queries(model, layer: int, ids: torch.Tensor) -> torch.Tensor:
    """(h, n, d) queries of `layer` before RoPE, recomputed from the hidden states its attention receives."""
    module = model.model.layers[layer].self_attn
    seen = {}
    hook = module.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        model(ids)
    hook.remove()
    hidden = seen["hidden_states"][0]  # (n, hidden)
    query = module.q_proj(hidden).view(hidden.shape[0], -1, module.head_dim)
    if hasattr(module, "q_norm"):  # Qwen 3 and Gemma 3 normalise the query before rotating it
        query = module.q_norm(query)
    return query.transpose(0, 1).float()


def _by_hand(model, layer: int, ids: torch.Tensor, keys, values, policy: ExpectedAttention) -> torch.Tensor:
    """The paper's eqs. 5-8 with explicit matrices: statistics of the pre-RoPE queries after the sinks, the average
    rotation matrix of positions n .. n + future - 1 built from the layer's cos/sin, the Gaussian's expected logits,
    softmax after the sinks, mean over each KV head's query heads, times ||v||."""
    query = _pre_rope_queries(model, layer, ids).double()
    heads, n, dim = query.shape
    kept = query[:, policy.sinks :]
    mean = kept.mean(1)
    centred = kept - mean[:, None]
    cov = centred.transpose(1, 2) @ centred / kept.shape[1]
    rotary = architecture(model).rotary(layer)
    positions = torch.arange(n, n + policy.future)[None]
    cos, sin = rotary(torch.empty(0), positions)
    cos, sin = cos[0].double() / rotary.attention_scaling, sin[0].double() / rotary.attention_scaling
    swap = torch.zeros(dim, dim, dtype=torch.float64)  # rotate_half(x) = swap @ x
    half = dim // 2
    swap[:half, half:], swap[half:, :half] = -torch.eye(half), torch.eye(half)
    turn = (cos[:, :, None] * torch.eye(dim) + sin[:, :, None] * swap).mean(0)  # R_bar (d, d)
    mean, cov = mean @ turn.T, turn @ cov @ turn.T
    key, value = keys[0, :, policy.sinks :].double(), values[0, :, policy.sinks :].double()
    rep = heads // key.shape[0]
    scale = dim**-0.5
    scores = []
    for h in range(heads):
        k = key[h // rep]
        logits = k @ mean[h] * scale + 0.5 * scale**2 * torch.einsum("md,de,me->m", k, cov[h], k)
        scores.append(logits.softmax(-1))
    by_kv_head = torch.stack(scores).view(key.shape[0], rep, -1).mean(1)
    return by_kv_head * value.norm(dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_expected_attention_equals_the_papers_formula_computed_by_hand(make_model, arch):
    model = make_model(arch, num_layers=3)
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    policy = ExpectedAttention(future=24)
    scores: dict[int, torch.Tensor] = {}
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), attention_hooks(observers=score_observers(policy, scores, arch=architecture(model))):
        model(ids, **with_cache(model, cache), use_cache=True)
    layers = architecture(model).global_layers
    assert sorted(scores) == list(layers)  # a hybrid model's sliding layers are never scored
    for layer in layers:
        expected = _by_hand(model, layer, ids, cache.layers[layer].keys, cache.layers[layer].values, policy)
        got = scores[layer]
        assert torch.isinf(got[:, : policy.sinks]).all()  # the sinks are kept whatever the rest scores
        torch.testing.assert_close(got[:, policy.sinks :].double(), expected, rtol=2e-4, atol=1e-7)


def test_expected_attention_without_the_covariance_or_value_norms_is_the_mean_alone(make_model):
    model = make_model("llama")
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    runs = {}
    for name, policy in {
        "full": ExpectedAttention(),
        "plain": ExpectedAttention(covariance=False, value_norm=False),
    }.items():
        runs[name] = {}
        with torch.no_grad(), attention_hooks(observers=score_observers(policy, runs[name], arch=architecture(model))):
            model(ids)
    plain = runs["plain"][0][:, 4:]
    torch.testing.assert_close(plain.sum(-1), torch.ones(2))  # a softmax over the keys after the sinks
    assert not torch.allclose(plain, runs["full"][0][:, 4:])


def test_expected_attention_compresses_to_its_budget_by_its_scores(make_model):
    model = make_model("llama")
    result = run(
        model, FakeTokenizer(), make_prompt(96), compress=Compress(ExpectedAttention(), 32), sampling=Sampling(2)
    )
    scores = result.state.compress.scores
    for layer, kept in enumerate(result.state.compress.kept_positions):
        assert torch.equal(kept, keep_indices(scores[layer], 32, sinks=4))


def test_a_context_kept_compressed_by_expected_attention_serves_every_question(make_model):
    """Question-agnostic reuse: the context is compressed once by its own queries, and each question continues from
    those entries (its pass saw the budget's entries, not the document)."""
    model = make_model("llama")
    first = make_prompt(96, tail_len=6)
    ids = first.ids.clone()
    ids[0, -6:] = torch.arange(10, 16)
    second = replace(first, ids=ids)
    cache = PrefixCache(model, 10**9, 32)
    spec = kvsieve.method("expected-attention", {"compress.budget": 40})
    results = run(model, FakeTokenizer(), [first, second], method=spec, prefix_cache=cache, sampling=Sampling(2))
    feeds = [r.stages[0].details for r in results]
    assert [f["context_entries"] for f in feeds] == [32, 32]
    assert feeds[1]["reused_tokens"] == first.context_start + first.context_len


def test_a_scorer_that_reads_the_rotary_embedding_is_refused_without_the_model():
    with pytest.raises(KvsieveError, match="rotary embedding"):
        score_observers(ExpectedAttention(), {})


@pytest.mark.parametrize("field,value", [("future", 0), ("sinks", -1), ("future", True)])
def test_expected_attention_refuses_bad_settings(field, value):
    with pytest.raises(KvsieveError, match=field):
        ExpectedAttention(**{field: value})


@pytest.mark.parametrize("name", ["expected-attention", "kvzip", "snapkv"])
def test_a_document_kept_compressed_holds_its_budgets_share_of_the_bytes(make_model, name):
    """The prefix cache's bytes for a document stored at reuse budget 0.25, measured from its tensors: within 1.05 x
    0.25 x the bytes of the same document stored whole."""
    model = make_model("llama")
    prompt = make_prompt(200, tail_len=6)
    whole, kept = PrefixCache(model, 10**9), PrefixCache(model, 10**9, 0.25)
    run(model, FakeTokenizer(), prompt, method="full", prefix_cache=whole, sampling=Sampling(1))
    run(model, FakeTokenizer(), prompt, method=name, prefix_cache=kept, sampling=Sampling(1))
    assert len(whole) == len(kept) == 1
    assert 0 < kept.bytes <= 1.05 * 0.25 * whole.bytes


def test_expected_attention_prunes_a_chunked_feeds_memory(make_model):
    """As IMDC's pruner it scores each chunk's pass (and the question's, guided) with the layers' rotary embeddings."""
    model = make_model("gemma3", num_layers=3)
    spec = kvsieve.method("imdc", {"feed.pruner": "expected-attention", "feed.chunk": 32, "feed.memory": 40})
    result = run(model, FakeTokenizer(), make_prompt(150), method=spec, sampling=Sampling(2))
    feed = result.stages[0].details
    assert feed["pruner"] == "expected-attention" and len(feed["chunk_sizes"]) > 1 and max(feed["memory_sizes"]) <= 40
