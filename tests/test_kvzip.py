"""KVzip: the reconstruction prompt and its chunks, the scores against attention computed by transformers' own eager
attention, and the cache left as it was."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from conftest import VOCAB, FakeTokenizer, make_prompt
from transformers import DynamicCache

import kvsieve
from kvsieve import Sampling, run
from kvsieve.compress.policies.kvzip import KVzip
from kvsieve.compress.scorers import keep_indices
from kvsieve.compress.stages import Compress
from kvsieve.engine.prefix_cache import PrefixCache
from kvsieve.errors import KvsieveError
from kvsieve.feed import PromptState
from kvsieve.feed.chunked import ChunkedPrefill
from kvsieve.feed.reconstruction import second_pass_scores
from kvsieve.kv.cache import kv_entries
from kvsieve.models import architecture, with_cache

fake_encode = FakeTokenizer().encode  # the tiny models' tokenizer: one id per word


def test_the_reconstruction_repeats_the_context_in_chunks_each_after_its_prompt():
    policy = KVzip(chunk=10, overlap=3, sinks=2)
    ids = torch.arange(100, 125)[None]  # 25 tokens: chunks of 10, 10 and 5
    rereads = policy.second_pass(ids, fake_encode)
    passes = [reread.tokens for reread in rereads]
    first, later = fake_encode(policy.first), fake_encode(policy.later)
    assert [p.shape[1] for p in passes] == [len(first) + 10, len(later) + 3 + 10, len(later) + 3 + 5]
    assert passes[0][0].tolist() == first + list(range(100, 110))
    assert passes[1][0].tolist() == later + [107, 108, 109] + list(range(110, 120))  # "starting with" the last 3
    assert passes[2][0].tolist() == later + [117, 118, 119] + list(range(120, 125))
    repeated = [p[0, -min(10, 25 - 10 * i) :].tolist() for i, p in enumerate(passes)]
    assert sum(repeated, []) == ids[0].tolist()  # every token repeated once, in order
    # each pass is scored within the sinks and the chunk it repeats (the authors' code and kvpress alike)
    assert [torch.nonzero(r.within)[:, 0].tolist() for r in rereads] == [
        list(range(10)),
        [0, 1, *range(10, 20)],
        [0, 1, *range(20, 25)],
    ]


def _eager_scores(model, ids: torch.Tensor, rereads: list, layer: int) -> torch.Tensor:
    """By transformers' eager attention: each pass appended to the context in one plain forward, the attention
    weights its tokens pay the context's keys, renormalised over the keys the pass is scored within (a softmax over
    fewer keys is the full one divided by their share), maxed over those queries, the KV head's query heads and the
    passes."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    n, kv_heads = ids.shape[1], model.config.num_key_value_heads
    best = torch.zeros(kv_heads, n)
    for reread in rereads:
        with torch.no_grad():
            out = eager(torch.cat([ids, reread.tokens], dim=1), output_attentions=True)
        weights = out.attentions[layer][0, :, n:, :]  # (h, m, n + m): the pass's queries over every key
        allowed = torch.cat([reread.within, torch.ones(reread.tokens.shape[1], dtype=torch.bool)])
        weights = weights * allowed / (weights * allowed).sum(-1, keepdim=True)
        per_kv = weights[..., :n].reshape(kv_heads, -1, n).amax(1)
        best = torch.maximum(best, per_kv)
    return best


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_kvzip_scores_are_the_largest_attention_the_repeating_queries_pay(make_model, arch):
    model = make_model(arch)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(5))
    policy = KVzip(chunk=12, overlap=4)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **with_cache(model, cache), use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    scores = second_pass_scores(model, cache, ids, policy, fake_encode)
    for layer in architecture(model).global_layers:
        expected = _eager_scores(model, ids, policy.second_pass(ids, fake_encode), layer)
        torch.testing.assert_close(scores[layer], expected, rtol=1e-4, atol=1e-6)
    for (keys, values), layer in zip(before, cache.layers, strict=True):  # the passes were dropped again
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_pooled_kvzip_scores_an_entry_by_its_neighbours_best(make_model):
    """`pool_size` 3: each entry's score is the best of its own and its two neighbours' eager scores (the ends see
    one neighbour), over the passes."""
    model = make_model("llama")
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(7))
    policy = KVzip(chunk=12, overlap=4, pool_size=3)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **with_cache(model, cache), use_cache=True)
    scores = second_pass_scores(model, cache, ids, policy, fake_encode)
    for layer in architecture(model).global_layers:
        plain = _eager_scores(model, ids, policy.second_pass(ids, fake_encode), layer)
        expected = torch.stack([plain[:, max(0, i - 1) : i + 2].amax(1) for i in range(30)], dim=1)
        torch.testing.assert_close(scores[layer], expected, rtol=1e-4, atol=1e-6)


def test_kvzip_compresses_a_prompt_by_its_second_pass(make_model):
    model = make_model("llama")
    result = run(model, FakeTokenizer(), make_prompt(80), compress=Compress(KVzip(chunk=32), 24), sampling=Sampling(2))
    scores = result.state.compress.scores
    for layer, kept in enumerate(result.state.compress.kept_positions):
        assert torch.equal(kept, keep_indices(scores[layer], 24, sinks=4))
    record = next(s for s in result.stages if s.stage == "compress")
    assert record.details["budget"] == 24 and not record.details["layer_by_layer"]  # pruned after its second pass


def test_kvzip_is_refused_where_no_whole_cache_is_there_to_repeat():
    with pytest.raises(KvsieveError, match="second pass"):
        ChunkedPrefill(pruner=KVzip())


@pytest.mark.parametrize("field,value", [("chunk", 0), ("overlap", -1), ("sinks", 1.5), ("pool_size", 2)])
def test_kvzip_refuses_bad_settings(field, value):
    with pytest.raises(KvsieveError, match=field):
        KVzip(**{field: value})


def test_a_context_kept_compressed_by_kvzip_serves_every_question(make_model):
    """Question-agnostic reuse: the stored context is compressed by its own reconstruction, and each question
    continues from its entries."""
    model = make_model("llama")
    first = make_prompt(80, tail_len=6)
    ids = first.ids.clone()
    ids[0, -6:] = torch.arange(10, 16)
    cache = PrefixCache(model, 10**9, 24)
    spec = kvsieve.method("kvzip", {"compress.budget": 40, "compress.policy.chunk": 32})
    results = run(model, FakeTokenizer(), [first, replace(first, ids=ids)], method=spec, prefix_cache=cache,
                  sampling=Sampling(2))  # fmt: skip
    feeds = [r.stages[0].details for r in results]
    assert [f["context_entries"] for f in feeds] == [24, 24]
    assert feeds[1]["reused_tokens"] == first.context_start + first.context_len


def test_kvzip_across_layers_ranks_every_layers_entries_together(make_model):
    """The paper's selection across layers: each layer keeps its share of the best entries of all layers, the
    budget on average (within a head's rounding per layer), each layer its own best by its scores."""
    model = make_model("llama", num_layers=4)
    policy = KVzip(chunk=32, across_layers=True)
    result = run(model, FakeTokenizer(), make_prompt(120), compress=Compress(policy, 30), sampling=Sampling(1))
    scores, kept = result.state.compress.scores, result.state.compress.kept_positions
    entries = [int(k.shape[-1]) for k in kept]
    assert len(set(entries)) > 1 and abs(sum(entries) - 4 * 30) <= 4  # budgets differ, 30 a layer on average
    record = next(s for s in result.stages if s.stage == "compress")
    assert record.details["layer_entries"] == entries
    pooled = torch.cat([scores[j][:, 4:].flatten() for j in range(4)])
    threshold = pooled.topk((30 - 4) * 4 * 2).values[-1]
    for j in range(4):  # the layer's share of the pooled best, per head, sinks on top
        assert entries[j] == 4 + max(1, round(float((scores[j][:, 4:] >= threshold).sum()) / 2))
        assert torch.equal(kept[j], keep_indices(scores[j], entries[j], sinks=4))


GLOBAL = {"compress.policy.across_layers": True, "compress.head_budgets": True, "compress.head_floor": 0.0}


def test_kvzip_across_layers_and_heads_keeps_the_best_entries_of_all_together(make_model):
    """The paper's selection (`across_layers` with per-head budgets and no floor): one ranking of every layer's and
    KV head's entries (sinks apart), each head holding its own count. Each layer keeps the best of its heads' entries
    pooled, and across layers the kept set is the global best up to a layer's rounding to whole entries per head."""
    model = make_model("llama", num_layers=4)
    spec = kvsieve.method("kvzip", {"compress.budget": 30, "compress.policy.chunk": 32, **GLOBAL})
    result = run(model, FakeTokenizer(), make_prompt(120), method=spec, sampling=Sampling(1))
    scores, kept = result.state.compress.scores, result.state.compress.kept_positions
    layers, heads, sinks, n = 4, model.config.num_key_value_heads, 4, scores[0].shape[1]
    chosen = torch.zeros(layers, heads, n, dtype=torch.bool)
    for j in range(layers):
        for g in range(heads):
            chosen[j, g, kept[j][g][kept[j][g] >= 0]] = True
    assert chosen[..., :sinks].all()  # sinks kept by every head
    pooled = torch.stack([scores[j].float() for j in range(layers)])[..., sinks:]
    picked = chosen[..., sinks:]
    assert abs(int(picked.sum()) - (30 - sinks) * layers * heads) <= layers * heads // 2
    for j in range(layers):  # a layer's entries: the best of its heads pooled (not a count per head)
        worst_kept = pooled[j][picked[j]].min()
        assert bool((pooled[j][~picked[j]] <= worst_kept).all())
    counts = picked.sum(-1)
    assert len(set(counts.flatten().tolist())) > 1  # heads and layers hold different counts
    threshold = pooled.flatten().topk(int(picked.sum())).values[-1]  # the global ranking's cut
    assert int((picked != (pooled >= threshold)).sum()) <= layers * heads


def test_a_context_kept_across_layers_is_compressed_though_a_layer_keeps_every_entry(make_model):
    """Budgets chosen across layers may leave a layer all of its entries while others drop theirs: such a stored
    state is still compressed (whole or not at all, never cut to a shorter prefix, and a question's pass prunes
    nothing more), which the longest layer's count alone would not tell."""
    model = make_model("llama")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.arange(3, 43)[None], **with_cache(model, cache), use_cache=True)
    last = cache.layers[-1]
    last.keys, last.values = last.keys[:, :, :10], last.values[:, :, :10]  # one layer dropped entries, one did not
    state = PromptState(cache, 40, 40)
    assert kv_entries(cache) == 40 and kv_entries(cache, least=True) == 10
    assert state.compressed and not state.cuttable
