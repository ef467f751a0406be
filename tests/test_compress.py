"""KV scorers, the compress stage and decode eviction: exact invariants on tiny models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FakeTokenizer, make_prompt

from kvsieve import (
    A2SF,
    H2O,
    TOVA,
    Compress,
    Evict,
    GemFilter,
    KNorm,
    LocalWindow,
    Sampling,
    SnapKV,
    StreamingLLM,
    run,
)
from kvsieve.attention import attention_hooks
from kvsieve.compress.policy import LayerPass
from kvsieve.compress.scorers import accumulated_attention, keep_indices, window_attention
from kvsieve.errors import KvsieveError
from kvsieve.kv.cache import resolve_budget
from kvsieve.models import with_cache
from kvsieve.registry import method

ALL_METHODS = [SnapKV(window=4), H2O(), A2SF(alpha=0.3), StreamingLLM(sinks=2), LocalWindow(), TOVA(), KNorm()]
DECODE_METHODS = [H2O(), A2SF(alpha=0.3), StreamingLLM(sinks=2), LocalWindow(), TOVA(), KNorm()]


def reference_attention(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """(h, q, n) causal softmax, bottom-right aligned, keys repeated per head the slow way."""
    heads, q_len, _ = query.shape
    kv_heads, n, _ = key.shape
    out = torch.zeros(heads, q_len, n)
    for h in range(heads):
        k = key[h // (heads // kv_heads)]
        for i in range(q_len):
            visible = n - q_len + i + 1
            out[h, i, :visible] = torch.softmax(query[h, i] @ k[:visible].T * scaling, dim=-1)
    return out


def per_group(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    heads = x.shape[0]
    return torch.stack([x[[h for h in range(heads) if h // (heads // kv_heads) == g]].sum(0) for g in range(kv_heads)])


@pytest.fixture
def qk():
    torch.manual_seed(0)
    return torch.randn(6, 12, 8), torch.randn(3, 12, 8)  # 6 query heads, 3 KV heads (n_rep 2)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_accumulated_attention_matches_eq5(qk, alpha):
    query, key = qk
    probs = reference_attention(query, key, 0.5)  # (h, n, n)
    n = query.shape[1]
    weights = torch.tensor([alpha ** (n - 1 - q) for q in range(n)])
    expected = per_group((probs * weights[None, :, None]).sum(1), 3)
    torch.testing.assert_close(accumulated_attention(query, key, 0.5, alpha), expected)
    torch.testing.assert_close(accumulated_attention(query, key, 0.5, alpha, chunk=5), expected)


def test_accumulated_attention_over_a_long_prompt_with_small_alpha():
    """0.2^k underflows to 0 in fp32 long before 200 queries: skipping those queries must not change eq. 5."""
    torch.manual_seed(1)
    query, key = torch.randn(6, 200, 8), torch.randn(3, 200, 8)
    probs = reference_attention(query, key, 0.5)
    weights = torch.tensor([0.2 ** (199 - q) for q in range(200)], dtype=torch.float64)
    expected = per_group((probs.double() * weights[None, :, None]).sum(1), 3).float()
    torch.testing.assert_close(accumulated_attention(query, key, 0.5, 0.2, chunk=16), expected)


def test_alpha_one_is_h2o_and_alpha_zero_is_last_row(qk):
    query, key = qk
    probs = reference_attention(query, key, 0.5)
    torch.testing.assert_close(accumulated_attention(query, key, 0.5, 1.0), per_group(probs.sum(1), 3))
    torch.testing.assert_close(accumulated_attention(query, key, 0.5, 0.0), per_group(probs[:, -1], 3))


def test_accumulated_attention_with_queries_as_suffix(qk):
    query, key = qk
    probs = reference_attention(query[:, -4:], key, 0.5)  # the last 4 positions' queries
    torch.testing.assert_close(accumulated_attention(query[:, -4:], key, 0.5, 1.0, chunk=3), per_group(probs.sum(1), 3))


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_window_attention_matches_snapkv(qk, pool):
    query, key = qk
    window, kernel = 3, 3
    votes = per_group(reference_attention(query[:, -window:], key, 0.5).sum(1), 3)[:, :-window]
    padded = F.pad(votes, (1, 1), value=0.0 if pool == "avg" else float("-inf"))
    windows = padded.unfold(1, kernel, 1)
    pooled = windows.mean(-1) if pool == "avg" else windows.max(-1).values
    scores = window_attention(query, key, 0.5, window, kernel, pool)
    torch.testing.assert_close(scores[:, :-window], pooled)
    assert torch.isinf(scores[:, -window:]).all()


def test_gqa_scores_use_h_div_n_rep(qk):
    query, key = qk
    # Only query head 3 is non-zero: its mass must land on KV head 3 // 2 = 1 beyond the uniform part.
    uniform = accumulated_attention(torch.zeros_like(query), key, 0.5, 1.0)
    only3 = torch.zeros_like(query)
    only3[3] = query[3]
    diff = accumulated_attention(only3, key, 0.5, 1.0) - uniform
    assert diff[1].abs().sum() > 0 and diff[0].abs().sum() == 0 and diff[2].abs().sum() == 0


def test_keep_indices_protects_sinks_and_recent():
    scores = torch.tensor([[5.0, 0.0, 9.0, 1.0, 0.5, 0.1, 0.2, 0.3], [0.0, 8.0, 0.0, 7.0, 0.0, 0.0, 0.0, 0.0]])
    kept = keep_indices(scores, 4, sinks=1, recent=1)
    assert kept.tolist() == [[0, 2, 3, 7], [0, 1, 3, 7]]
    assert keep_indices(scores, 8).tolist() == [list(range(8))] * 2


@pytest.mark.parametrize("method", ALL_METHODS, ids=lambda m: m.name)
def test_budget_covering_prompt_reproduces_full_generation(make_model, method):
    model = make_model("mistral")
    prompt = make_prompt(40)
    full = run(model, FakeTokenizer(), prompt, sampling=Sampling(8))
    kept = run(model, FakeTokenizer(), prompt, compress=Compress(method, 40), sampling=Sampling(8))
    assert kept.tokens == full.tokens
    assert "everything kept" in kept.stages[1].details["note"]
    if method.name != "snapkv":
        evicted = run(model, FakeTokenizer(), prompt, evict=Evict(method, 48), sampling=Sampling(8))
        assert evicted.tokens == full.tokens


@pytest.mark.parametrize("method", ALL_METHODS, ids=lambda m: m.name)
def test_compress_physically_shrinks_every_layer(make_model, method):
    model = make_model("qwen2", num_layers=3)
    seen = []

    def lengths(layer, query, key):
        if query.shape[2] == 1:
            seen.append(key.shape[2])

    with attention_hooks(observers=[lengths]):
        result = run(model, FakeTokenizer(), make_prompt(40), compress=Compress(method, 12), sampling=Sampling(3))
    # Decoding step 1 sees the 12 kept entries plus the new token, step 2 one more.
    assert seen == [13, 13, 13, 14, 14, 14]
    assert result.kv_cache_length == 14


def test_decoding_continues_from_the_logical_position(make_model):
    model = make_model("llama")
    prompt = make_prompt(30)
    result = run(model, FakeTokenizer(), prompt, compress=Compress(LocalWindow(), 10), sampling=Sampling(4))
    # Reference: full prefill, keep the last 10 entries by hand, decode at positions 30, 31, ...
    with torch.no_grad():
        out = model(input_ids=prompt.ids, use_cache=True)
        cache = out.past_key_values
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, -10:], layer.values[:, :, -10:]
        tokens = [int(out.logits[0, -1].argmax())]
        for step in range(3):
            out = model(
                input_ids=torch.tensor([[tokens[-1]]]),
                position_ids=torch.tensor([[30 + step]]),
                **with_cache(model, cache),
            )
            tokens.append(int(out.logits[0, -1].argmax()))
    assert result.tokens == tokens


@pytest.mark.parametrize("method", DECODE_METHODS, ids=lambda m: m.name)
def test_eviction_keeps_cache_at_budget(make_model, method):
    model = make_model("llama")
    seen = []
    with attention_hooks(observers=[lambda layer, q, k: seen.append(k.shape[2]) if q.shape[2] == 1 else None]):
        result = run(model, FakeTokenizer(), make_prompt(30), evict=Evict(method, 16), sampling=Sampling(10))
    assert max(seen) == 17 and result.kv_cache_length == 16


def test_eviction_interval_lets_cache_grow_between_evictions(make_model):
    model = make_model("llama")
    result = run(model, FakeTokenizer(), make_prompt(30), evict=Evict(H2O(), 16, interval=4), sampling=Sampling(7))
    # Steps 1..6 run forwards; evictions after steps 4 only: 16 -> 20 -> 16 -> 18.
    assert result.kv_cache_length == 18


def test_evict_running_score_follows_a2sf_recurrence():
    torch.manual_seed(0)
    evict = Evict(A2SF(alpha=0.5), 100).begin()
    query, key = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    evict.observers()[0](0, query, key)  # prompt of 5 tokens
    s0 = evict.scores[0].clone()
    q1, k1 = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 6, 8)
    evict.observe(0, q1, k1)
    row = per_group(reference_attention(q1[0], k1[0], 8**-0.5)[:, 0], 2)
    torch.testing.assert_close(evict.scores[0], 0.5 * torch.cat([s0, torch.zeros(2, 1)], 1) + row)


def test_tova_scores_are_the_last_querys_attention_averaged_over_heads(qk):
    query, key = qk
    expected = reference_attention(query, key, 0.5)[:, -1].mean(0)  # (n,): one ranking for the layer
    scores = TOVA().prompt_scores(LayerPass(query, key, scale=0.5))
    assert scores.shape == (3, 12)
    for g in range(3):
        torch.testing.assert_close(scores[g], expected)
    # Per step, the newest row replaces the old scores entirely (no accumulation).
    q1, k1 = torch.randn(6, 1, 8), torch.randn(3, 13, 8)
    step = TOVA().step_scores(torch.full((3, 12), 100.0), q1, k1, 0.5)
    torch.testing.assert_close(step[0], reference_attention(q1, k1, 0.5)[:, 0].mean(0))


def test_knorm_keeps_the_keys_with_the_smallest_norms(make_model):
    key = torch.ones(2, 6, 4) * torch.tensor([3.0, 1.0, 5.0, 0.5, 2.0, 4.0])[None, :, None]
    key[1] = key[1].flip(0)
    scores = KNorm().prompt_scores(LayerPass(torch.randn(4, 6, 4), key))
    assert keep_indices(scores, 3).tolist() == [[1, 3, 4], [1, 2, 4]]
    # End to end: the compressed cache holds exactly each KV head's lowest-norm keys.
    model = make_model("llama")
    prompt = make_prompt(30)
    with torch.no_grad():
        keys = model(input_ids=prompt.ids, use_cache=True).past_key_values.layers[0].keys[0]  # (kv, n, d)
    expected = keys.norm(dim=-1).topk(8, largest=False).indices.sort().values
    result = run(model, FakeTokenizer(), prompt, compress=Compress(KNorm(), 8), sampling=Sampling(1))
    assert torch.equal(result.state.compress.kept_positions[0], expected)


def test_tova_and_knorm_registered_everywhere():
    """Adding a method is one module + one registry line: it is then a preset, a policy and a pruner."""
    assert method("tova").evict.policy == TOVA() and method("knorm").compress.policy == KNorm()
    assert method("imdc", {"feed.pruner": "knorm"}).feed.pruner == KNorm()
    assert method("snapkv", {"compress.policy": "tova"}).compress.policy == TOVA()


def test_stages_compose(make_model):
    model = make_model("qwen2", num_layers=3)
    result = run(
        model,
        FakeTokenizer(),
        make_prompt(48),
        select=GemFilter(k=32, layer=1),
        compress=Compress(SnapKV(window=4), 20),
        evict=Evict(A2SF(alpha=0.2), 12),
        sampling=Sampling(6),
    )
    stages = {s.stage: s.details for s in result.stages}
    assert stages["select"]["kept"] == 32 and stages["compress"]["budget"] == 20 and stages["decode"]["budget"] == 12
    assert result.kv_cache_length == 12


def test_budget_fractions_and_errors():
    assert resolve_budget(0.25, 100) == (25, None)
    assert resolve_budget(200, 100)[0] == 200 and "everything kept" in resolve_budget(200, 100)[1]
    for bad in (0, -3, 1.5, 0.0):
        with pytest.raises(KvsieveError, match="[Bb]udget"):
            resolve_budget(bad, 100)
    with pytest.raises(KvsieveError, match="alpha"):
        A2SF(alpha=1.5)
    with pytest.raises(KvsieveError, match="odd"):
        A2SF(pool_size=4)
    with pytest.raises(KvsieveError, match="window 32 exceeds the budget 16"):
        SnapKV().protected(16)
    with pytest.raises(KvsieveError, match="odd"):
        SnapKV(pool_size=4)
    with pytest.raises(KvsieveError, match="odd"):
        SnapKV(pool_size=0)
    with pytest.raises(KvsieveError, match="sink"):
        StreamingLLM(sinks=8).protected(4)
    with pytest.raises(KvsieveError, match="per-step"):
        Evict(SnapKV(), 64)
    with pytest.raises(KvsieveError, match="interval"):
        Evict(H2O(), 64, interval=0)
    with pytest.raises(KvsieveError, match="Budget"):
        Compress(H2O(), 0)
    with pytest.raises(KvsieveError, match="unknown policy 'pyramid'"):
        method("snapkv", {"compress.policy": "pyramid"})


@pytest.mark.parametrize("alpha", [0.0, 0.01, 0.2, 0.5, 0.9, 0.99, 1.0])
def test_the_accumulation_weights_leave_out_exactly_the_weights_below_float32(alpha):
    """`accumulation_weights` decides on the host, from alpha and q_len alone, which queries weigh 0 (alpha^k below
    2^-149); the others are float32 powers, and the first one kept weighs more than 0."""
    from kvsieve.attention.accumulate import accumulation_weights

    for q_len in (2, 40, 3000, 20000):
        weights, first = accumulation_weights(alpha, q_len)
        alpha32 = float(torch.tensor(alpha, dtype=torch.float32))  # the float32 alpha the powers are taken of
        exact = torch.tensor([alpha32**k for k in range(q_len - 1, -1, -1)], dtype=torch.float64)
        assert bool((weights[:first] == 0).all()) and float(weights[first]) > 0
        assert bool((exact[first:] >= 2**-149).all()) and bool((exact[:first] < 2**-149).all())
        torch.testing.assert_close(weights[first:].double(), exact[first:], rtol=1e-5, atol=2**-148)  # 2 subnormals
