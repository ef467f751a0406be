"""The IMDC authors' pruner (Collie's ConvPruner) as a KV policy: exact invariants on random tensors and tiny models.

The reference below is written the slow, obvious way: the full attention matrix query by query
(keys repeated per query head), column sums per KV head, an explicit average over each key's
kernel neighbourhood that stops at the sink boundary, and a count of the queries that see each key.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FakeTokenizer, build_model, make_prompt

from kvsieve import Compress, Evict, Sampling, run
from kvsieve.attention import attention_hooks
from kvsieve.compress.policies.collie import Collie
from kvsieve.compress.policy import LayerPass
from kvsieve.compress.scorers import accumulated_attention, keep_indices, visible_counts
from kvsieve.errors import KvsieveError
from kvsieve.feed.chunked import ChunkedPrefill, _recent
from kvsieve.feed.full import FullPrefill
from kvsieve.registry import method


def dense_probs(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """(h, q, n) float64 causal softmax of queries that are the last q of n positions, one row at a time."""
    heads, q_len, _ = query.shape
    kv_heads, n, _ = key.shape
    rep = heads // kv_heads
    probs = torch.zeros(heads, q_len, n, dtype=torch.float64)
    for h in range(heads):
        for i in range(q_len):
            visible = n - q_len + i + 1
            logits = query[h, i].double() @ key[h // rep, :visible].double().T * scaling
            probs[h, i, :visible] = torch.softmax(logits, dim=-1)
    return probs


def naive_collie(query: torch.Tensor, key: torch.Tensor, scaling: float, kernel: int, sinks: int) -> torch.Tensor:
    """ConvPruner's score: column sums per KV head, pooled over keys >= sinks only, / queries that see the key."""
    heads, q_len, _ = query.shape
    kv_heads, n, _ = key.shape
    rep = heads // kv_heads
    probs = dense_probs(query, key, scaling)
    sums = torch.stack([probs[g * rep : (g + 1) * rep].sum(dim=(0, 1)) for g in range(kv_heads)])  # (g, n)
    pooled = sums.clone()
    half = kernel // 2
    for k in range(sinks, n):
        neighbours = [j for j in range(k - half, k + half + 1) if sinks <= j < n]  # zero padding elsewhere
        pooled[:, k] = sums[:, neighbours].sum(1) / kernel
    counts = torch.tensor([sum(1 for i in range(q_len) if n - q_len + i >= k) for k in range(n)], dtype=torch.float64)
    return pooled / counts


@pytest.fixture
def qk():
    torch.manual_seed(0)
    return torch.randn(6, 9, 8), torch.randn(3, 20, 8)  # 6 query heads, 3 KV heads (n_rep 2), 9 of 20 positions


@pytest.mark.parametrize(("kernel", "sinks"), [(5, 4), (5, 0), (3, 2), (1, 4), (7, 19), (5, 30)])
def test_scores_equal_the_dense_reference(qk, kernel, sinks):
    query, key = qk
    got = Collie(pool_size=kernel, sinks=sinks).prompt_scores(LayerPass(query, key, scale=0.35))
    assert got.dtype == torch.float32 and got.shape == (3, 20)
    torch.testing.assert_close(got.double(), naive_collie(query, key, 0.35, kernel, sinks), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("q_len", "rows"), [(1, 64), (20, 64), (20, 3), (13, 4)])
def test_query_blocks_change_nothing(q_len, rows):
    """All queries vote (a whole prompt, one decoding-like query, or a chunk), whatever the row blocks."""
    torch.manual_seed(1)
    query, key = torch.randn(4, q_len, 16), torch.randn(2, 20, 16)
    expected = naive_collie(query, key, 0.25, 5, 4)
    torch.testing.assert_close(
        Collie().prompt_scores(LayerPass(query, key, scale=0.25)).double(), expected, atol=1e-6, rtol=1e-5
    )
    blocked = Collie().from_sums(accumulated_attention(query, key, 0.25, alpha=1.0, chunk=rows), q_len)
    torch.testing.assert_close(blocked.double(), expected, atol=1e-6, rtol=1e-5)


def test_each_key_is_averaged_over_the_queries_that_see_it(qk):
    """kernel 1: the score of a key is the mean attention of the queries that see it (sum over the
    KV head's query heads), so the chunk's key at offset j is divided by q - j, earlier keys by q."""
    query, key = qk
    assert visible_counts(4, 10).tolist() == [4, 4, 4, 4, 4, 4, 4, 3, 2, 1]
    assert visible_counts(3, 3).tolist() == [3, 2, 1]
    probs = dense_probs(query, key, 0.35)  # (6, 9, 20): the 9 queries sit at positions 11..19
    got = Collie(pool_size=1, sinks=0).prompt_scores(LayerPass(query, key, scale=0.35)).double()
    for g in range(3):
        heads = probs[2 * g : 2 * g + 2]
        for k in (0, 5, 11, 14, 19):
            seeing = [i for i in range(9) if 11 + i >= k]
            expected = heads[:, seeing, k].sum() / len(seeing)
            torch.testing.assert_close(got[g, k], expected, atol=1e-6, rtol=1e-5)
    # Not the plain column sum: the chunk's last keys would lose to every earlier key.
    plain = accumulated_attention(query, key, 0.35, alpha=1.0)
    assert not torch.allclose(got[:, 12:].float(), plain[:, 12:])


def test_pooling_never_mixes_sink_scores():
    """Sinks draw most of the attention; the first memory keys must be pooled from keys >= sinks only,
    and the sinks keep their own unpooled scores."""
    torch.manual_seed(2)
    n, q_len, sinks = 16, 6, 4
    key = torch.randn(2, n, 8) * 0.1
    key[:, :sinks, 0] = 4.0
    query = torch.randn(4, q_len, 8) * 0.1
    query[..., 0] = 4.0  # every query looks at the sinks
    sums = accumulated_attention(query, key, 1.0, alpha=1.0)  # (2, n)
    counts = visible_counts(q_len, n)
    got = Collie(pool_size=5, sinks=sinks).prompt_scores(LayerPass(query, key, scale=1.0))
    torch.testing.assert_close(got[:, :sinks], sums[:, :sinks] / counts[:sinks])
    torch.testing.assert_close(got[:, 4], (sums[:, 4] + sums[:, 5] + sums[:, 6]) / 5 / counts[4])
    torch.testing.assert_close(got[:, 5], sums[:, 4:8].sum(1) / 5 / counts[5])
    across = (sums[:, 2:7].sum(1) / 5) / counts[4]  # what pooling across the boundary would give
    assert bool((across > 10 * got[:, 4]).all())
    # Pooling every position (sinks=0) lets the sink mass leak into key 4.
    leaky = Collie(pool_size=5, sinks=0).prompt_scores(LayerPass(query, key, scale=1.0))
    torch.testing.assert_close(leaky[:, 4], across)


def test_gqa_query_head_h_votes_for_kv_head_h_div_n_rep():
    """4 query heads, 2 KV heads: heads 0-1 look at token 2, heads 2-3 at token 5 (h % kv_heads would mix them)."""
    n, dim = 10, 8
    key = torch.zeros(1, 2, n, dim)
    key[0, :, 2, 0] = 1.0
    key[0, :, 5, 1] = 1.0
    query = torch.zeros(1, 4, 3, dim)
    query[0, 0:2, :, 0] = 50.0
    query[0, 2:4, :, 1] = 50.0
    scores = Collie(pool_size=1, sinks=0).prompt_scores(LayerPass(query[0], key[0], scale=dim**-0.5))
    assert scores.shape == (2, n)
    assert int(scores[0].argmax()) == 2 and int(scores[1].argmax()) == 5


def test_protects_nothing_and_has_no_step_rule():
    policy = Collie()
    assert policy.protected(1) == (0, 0) and policy.protected(4096) == (0, 0)
    assert _recent(policy, 64) == 0  # the chunked feed keeps no window for it
    assert not policy.decodes and not policy.position_only and not policy.accumulates
    with pytest.raises(KvsieveError, match="no per-step eviction rule"):
        Evict(Collie())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"pool_size": 4}, "odd whole number"),
        ({"pool_size": 0}, "odd whole number"),
        ({"pool_size": True}, "odd whole number"),
        ({"sinks": -1}, r"sinks .* must be a whole number >= 0, got -1; use the feed's sink count"),
        ({"sinks": 2.5}, "must be a whole number >= 0"),
    ],
)
def test_clear_errors(fields, message):
    with pytest.raises(KvsieveError, match=message):
        Collie(**fields)


def test_registered_as_a_policy_and_a_pruner():
    assert method("imdc", {"feed.pruner": "collie"}).feed.pruner == Collie()
    assert method("fm", {"feed.pruner": "collie", "feed.pruner.pool_size": 3}).feed.pruner == Collie(pool_size=3)
    assert method("snapkv", {"compress.policy": "collie", "compress.policy.sinks": 0}).compress.policy == Collie(
        sinks=0
    )
    with pytest.raises(KvsieveError, match="odd whole number"):
        method("imdc", {"feed.pruner": "collie", "feed.pruner.pool_size": 4})


def test_compress_keeps_the_reference_top_k(make_model):
    """As a compress policy: every query of the prompt votes; the kept entries are the reference's top-k."""
    model = make_model("mistral", num_layers=3)
    prompt = make_prompt(40)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    compress = Compress(Collie(), 12).begin()
    with torch.no_grad(), attention_hooks(observers=[*compress.observers(), lambda j, q, k: seen.update({j: (q, k)})]):
        cache = model(input_ids=prompt.ids, use_cache=True).past_key_values
    compress.compress(cache)
    for layer, (query, key) in seen.items():
        reference = naive_collie(query[0], key[0], query.shape[-1] ** -0.5, 5, 4)
        assert torch.equal(compress.kept_positions[layer], keep_indices(reference.float(), 12))
        assert cache.layers[layer].keys.shape[2] == 12
    full = run(model, FakeTokenizer(), prompt, sampling=Sampling(6))
    everything = run(model, FakeTokenizer(), prompt, compress=Compress(Collie(), 40), sampling=Sampling(6))
    assert everything.tokens == full.tokens  # a budget that keeps everything is full attention
    small = run(model, FakeTokenizer(), prompt, compress=Compress(Collie(), 12), sampling=Sampling(3))
    assert small.kv_cache_length == 14


@pytest.mark.parametrize(("schedule", "decremental"), [("fixed", False), ("linear", False), ("linear", True)])
def test_chunked_feed_prunes_by_the_reference_scores(schedule, decremental, single_thread):
    """As feed.pruner (FM / IM / IMDC, GQA): at every step and layer the feed keeps the sinks and the
    top of the reference scores of [sinks | memory | chunk] from all the chunk's queries, no window."""
    model = build_model("qwen2", num_layers=3)
    ids = make_prompt(90).ids
    seen: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []

    def capture(layer, query, key):
        if layer == 0:
            seen.append({})
        seen[-1][layer] = (query.clone(), key.clone())

    feed = ChunkedPrefill(chunk=16, memory=20, schedule=schedule, decremental=decremental, pruner=Collie(), trace=True)
    with attention_hooks(observers=[capture]):
        out = feed.prefill(model, ids)
    assert len(seen) == len(out.history) and out.details["pruner"] == "collie"
    pruned = 0
    for step, record in enumerate(out.history):
        sinks = min(4, record["start"] + record["chunk"])
        for layer, (query, key) in seen[step].items():
            n, budget = key.shape[2], sinks + record["memory"][layer]
            assert query.shape[2] == record["chunk"]  # every query of the chunk votes
            if n <= budget:
                continue
            reference = naive_collie(query[0], key[0], query.shape[-1] ** -0.5, 5, 4).float()
            assert torch.equal(record["kept"][layer], keep_indices(reference, budget, sinks=sinks)), (step, layer)
            pruned += 1
    assert pruned >= 6


def test_a_guided_feed_prunes_by_the_questions_reference_scores_alone(single_thread):
    """question_guided: every step but the last keeps the sinks and the top of the reference scores from the
    question's queries alone (run after the chunk, over [sinks | memory | chunk | question], the question's own
    keys then dropped); the chunk's votes no longer count. The last step ranks by its own chunk, question included."""
    model = build_model("qwen2", num_layers=3)
    prompt = make_prompt(90, tail_len=6)
    passes: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []

    def capture(layer, query, key):
        if layer == 0:
            passes.append({})
        passes[-1][layer] = (query.clone(), key.clone())

    feed = ChunkedPrefill(chunk=16, memory=20, schedule="linear", decremental=True, pruner=Collie(), trace=True)
    with attention_hooks(observers=[capture]):
        out = feed.prefill(model, prompt.ids, question=6)
    steps = len(out.history)
    assert out.details["question_tokens"] == 6 and len(passes) == 2 * steps - 1  # a question pass per step but the last
    pruned = 0
    for step, record in enumerate(out.history):
        last = step == steps - 1
        sinks = min(4, record["start"] + record["chunk"])
        for layer, (query, key) in passes[2 * step if last else 2 * step + 1].items():
            assert query.shape[2] == (record["chunk"] if last else 6)
            reference = naive_collie(query[0], key[0], query.shape[-1] ** -0.5, 5, 4).float()
            reference = reference if last else reference[:, : key.shape[2] - 6]
            budget = sinks + record["memory"][layer]
            if reference.shape[1] <= budget:
                continue
            assert torch.equal(record["kept"][layer], keep_indices(reference, budget, sinks=sinks)), (step, layer)
            pruned += not last
    assert pruned >= 6


def test_chunked_feed_with_room_for_everything_is_full_attention(single_thread):
    model = build_model("llama")
    ids = make_prompt(70).ids
    full = FullPrefill().prefill(model, ids).last_logits
    for decremental in (False, True):
        feed = ChunkedPrefill(chunk=16, memory=70 * 6, schedule="linear", decremental=decremental, pruner=Collie())
        torch.testing.assert_close(feed.prefill(model, ids).last_logits, full, atol=1e-4, rtol=1e-4)


def test_chunked_feed_takes_the_column_sums_from_its_attention_pass(monkeypatch, single_thread):
    """No second pass over the chunk's queries under the dense attention; under another prefill kernel
    (no dense pass to take them from) the second pass gives the same pruning."""
    from kvsieve.attention.dense import dense_attention

    model = build_model("mistral", num_layers=3)
    ids = make_prompt(80).ids
    feed = ChunkedPrefill(chunk=16, memory=20, schedule="linear", decremental=True, pruner=Collie(), trace=True)
    calls = []
    second_pass = Collie.accumulated_scores
    monkeypatch.setattr(Collie, "accumulated_scores", lambda *args: calls.append(1) or second_pass(*args))
    fused = feed.prefill(model, ids)
    assert calls == []
    with attention_hooks(prefill=lambda layer, q, k, v, scaling: dense_attention(q, k, v, scaling)):
        separate = feed.prefill(model, ids)
    assert len(calls) == 3 * len(separate.history)
    for a, b in zip(fused.history, separate.history, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a["kept"], b["kept"], strict=True))
    torch.testing.assert_close(fused.last_logits, separate.last_logits, atol=1e-4, rtol=1e-4)
