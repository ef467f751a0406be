"""H2O's and A2SF's scores taken from the attention itself equal the plain second-pass reference.

`accumulating_attention` computes causal attention in row blocks and, from the same softmax rows,
A2SF eq. 5's accumulated scores. Its output must equal SDPA's and its scores
`accumulated_attention`'s (the reference kept as the oracle), for any block size, GQA, queries
that are the last q of n keys (a chunk after a memory), alphas whose weights underflow, and every
dtype. Through the model, a prefill with an H2O / A2SF stage takes this path (no second pass)
and stores exactly the reference scores; decoding steps take their new row from the step's attention
(`AttentionRows`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FakeTokenizer, make_prompt

import kvsieve.attention.accumulate as accumulate
from kvsieve import Sampling, run
from kvsieve.attention import attention_hooks
from kvsieve.attention.accumulate import accumulating_attention
from kvsieve.attention.dense import dense_attention
from kvsieve.compress.policies.a2sf import A2SF
from kvsieve.compress.policies.h2o import H2O
from kvsieve.compress.scorers import accumulated_attention, attention_probs
from kvsieve.compress.stages import Compress, Evict
from kvsieve.engine.pipeline import prefill
from kvsieve.spec import MethodSpec


def _qkv(q_len: int, n: int, dtype=torch.float32, heads: int = 6, kv_heads: int = 2, dim: int = 8):
    generator = torch.Generator().manual_seed(q_len * 1000 + n)
    query = torch.randn(1, heads, q_len, dim, generator=generator).to(dtype)
    key = torch.randn(1, kv_heads, n, dim, generator=generator).to(dtype)
    value = torch.randn(1, kv_heads, n, dim, generator=generator).to(dtype)
    return query, key, value


@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize(("q_len", "n"), [(40, 40), (17, 50), (1, 30)])
def test_output_and_scores_equal_sdpa_and_the_reference(monkeypatch, rows, q_len, n):
    monkeypatch.setattr(accumulate, "MAX_ROWS", rows)  # blocks of 1, 3 or all rows
    query, key, value = _qkv(q_len, n)
    alphas = [1.0, 0.5, 0.2, 0.0]
    out, scores, _ = accumulating_attention(query, key, value, 0.3, alphas)
    torch.testing.assert_close(out, dense_attention(query, key, value, 0.3), atol=1e-5, rtol=1e-5)
    for alpha, got in zip(alphas, scores, strict=True):
        expected = accumulated_attention(query[0], key[0], 0.3, alpha)
        assert got.shape == (2, n) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize(("q_len", "n"), [(40, 40), (17, 50), (1, 30)])
def test_maxima_equal_the_largest_probability_of_the_reference_softmax(monkeypatch, rows, q_len, n):
    """KVzip's score from the attention's own rows: each key's largest probability over the queries and the KV
    head's query heads, beside the sums, every row read (the maxima need the rows no alpha weighs)."""
    monkeypatch.setattr(accumulate, "MAX_ROWS", rows)
    query, key, value = _qkv(q_len, n)
    out, (sums,), maxima = accumulating_attention(query, key, value, 0.3, [0.01], maxima=True)
    probs = attention_probs(query[0], key[0], 0.3)  # (h, q, n), the reference softmax
    torch.testing.assert_close(maxima, probs.view(2, 3 * q_len, n).amax(1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, dense_attention(query, key, value, 0.3), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums, accumulated_attention(query[0], key[0], 0.3, 0.01), atol=1e-5, rtol=1e-5)
    assert accumulating_attention(query, key, value, 0.3, [1.0])[2] is None


@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize(("q_len", "n"), [(20, 50), (1, 30)])
def test_maxima_within_some_keys_are_those_of_the_softmax_over_them(monkeypatch, rows, q_len, n):
    """KVzip's score as its authors compute it: the softmax over the sinks, the repeated chunk and the pass's own
    keys only (`AttentionMaxima.within`), the output still attending to every key. The fused rows and the observer's
    own computation (`AttentionMaxima.__call__`, where no dense pass runs) both equal the reference softmax over
    those keys, and a key outside scores 0."""
    monkeypatch.setattr(accumulate, "MAX_ROWS", rows)
    query, key, value = _qkv(q_len, n)
    cached = torch.zeros(n - q_len, dtype=torch.bool)
    cached[:2] = cached[5:12] = True  # two sinks and a chunk
    received = {}
    observer = accumulate.AttentionMaxima(lambda layer, m: received.update({layer: m}), reference, cached)
    allowed = observer.columns(n, q_len)
    assert allowed is not None and allowed[n - q_len :].all() and allowed[: n - q_len].equal(cached)
    out, _, maxima = accumulating_attention(query, key, value, 0.3, [], maxima=True, within=allowed)
    over = attention_probs(query[0], key[0][:, allowed], 0.3)  # (h, q, k): the reference softmax over those keys
    expected = torch.zeros(2, n)
    expected[:, allowed] = over.view(2, 3 * q_len, -1).amax(1)
    torch.testing.assert_close(maxima, expected, atol=1e-6, rtol=1e-5)
    assert not maxima[:, ~allowed].any()
    torch.testing.assert_close(out, dense_attention(query, key, value, 0.3), atol=1e-5, rtol=1e-5)
    observer(0, query * 0.3 / 8**-0.5, key)  # the observer's own path (it scales by head_dim ** -0.5)
    torch.testing.assert_close(received[0], expected, atol=1e-5, rtol=1e-5)


def test_a_row_whose_keys_within_underflow_adds_nothing_to_the_maxima():
    """The one limit of the maxima within some keys (taken as the whole softmax divided by their share): a row whose
    attention goes all to a key outside (a logit gap past float32's exp range) adds nothing, never NaN or inf; the
    other rows' maxima are the softmax over those keys."""
    query, key, value = _qkv(6, 30)
    key[0, :, 3] = 0.0
    key[0, :, 3, 0] = 50.0  # a cached key outside the mask ...
    query[0, :, 0] = 0.0
    query[0, :, 0, 0] = 50.0  # ... that the first query's logits favour by some 700
    allowed = torch.ones(30, dtype=torch.bool)
    allowed[3] = False
    _, _, maxima = accumulating_attention(query, key, value, 0.3, [], maxima=True, within=allowed)
    over = attention_probs(query[0], key[0][:, allowed], 0.3)[:, 1:]  # (h, 5, 29): the other rows
    expected = torch.zeros(2, 30)
    expected[:, allowed] = over.reshape(2, 15, -1).amax(1)
    assert torch.isfinite(maxima).all()
    torch.testing.assert_close(maxima, expected, atol=1e-6, rtol=1e-5)


def reference(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """The largest probability per key of the plain softmax (KVzip's `prompt_scores` without a policy)."""
    kv_heads, n = key.shape[0], key.shape[1]
    return attention_probs(query, key, scaling).view(kv_heads, -1, n).amax(1)


def test_rows_whose_weights_underflow_go_through_sdpa_and_still_match(monkeypatch):
    """alpha = 0.01: only the last ~20 rows carry weight; the 480 before them are plain SDPA."""
    calls = []
    monkeypatch.setattr(accumulate, "dense_attention", lambda q, *a: calls.append(q.shape[2]) or dense_attention(q, *a))
    query, key, value = _qkv(500, 500)
    out, (scores,), _ = accumulating_attention(query, key, value, None, [0.01])
    assert len(calls) == 1 and 450 < calls[0] < 500
    torch.testing.assert_close(out, dense_attention(query, key, value, None), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores, accumulated_attention(query[0], key[0], 8**-0.5, 0.01), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-10), (torch.bfloat16, 2e-2)])
def test_other_dtypes(dtype, tol):
    query, key, value = _qkv(24, 30, dtype)
    out, (scores,), _ = accumulating_attention(query, key, value, None, [1.0])
    assert out.dtype == dtype
    reference = F.scaled_dot_product_attention(
        query.double(),
        key.double().repeat_interleave(3, 1),
        value.double().repeat_interleave(3, 1),
        attn_mask=torch.ones(24, 30, dtype=torch.bool).tril(6),
    )
    torch.testing.assert_close(out.double(), reference, atol=tol, rtol=tol)
    # Scores are float32 in both (the reference scores in float32 whatever the model's dtype).
    score_tol = max(tol, 1e-5)
    expected = accumulated_attention(query[0], key[0], 8**-0.5, 1.0)
    torch.testing.assert_close(scores, expected, atol=score_tol, rtol=score_tol)


def test_block_memory_is_bounded(monkeypatch):
    """Rows per block shrink as the keys grow: heads x rows x keys stays within BLOCK_ELEMENTS."""
    monkeypatch.setattr(accumulate, "BLOCK_ELEMENTS", 6 * 200 * 10)
    shapes = []
    real_softmax = torch.Tensor.softmax
    monkeypatch.setattr(torch.Tensor, "softmax", lambda t, dim: shapes.append(t.shape) or real_softmax(t, dim))
    query, key, value = _qkv(200, 200)
    accumulating_attention(query, key, value, None, [1.0])
    assert max(s.numel() for s in shapes) <= 6 * 200 * 10 and len(shapes) == 20


@pytest.mark.parametrize(
    "policy", [H2O(), A2SF(alpha=0.5), A2SF(alpha=0.5, pool_size=5)], ids=["h2o", "a2sf", "a2sf-pooled"]
)
@pytest.mark.parametrize("stage", ["compress", "evict"])
def test_prefill_takes_scores_from_its_own_attention(make_model, monkeypatch, policy, stage):
    """No second pass over the prompt, and the stored scores are the reference's (pooled once when
    the policy pools its prompt scores)."""
    model = make_model("qwen2", num_layers=3)
    prompt = make_prompt(60)
    seen = {}
    with torch.no_grad(), attention_hooks(observers=[lambda j, q, k: seen.setdefault(j, (q[0], k[0]))]):
        model(input_ids=prompt.ids)
    second_passes = []
    real = accumulated_attention
    for second_pass in ("prompt_scores", "accumulated_scores"):
        monkeypatch.setattr(policy.__class__, second_pass, lambda self, *a: second_passes.append(a))
    budget = 1000  # covers the prompt: the scores stay aligned with the prompt's keys
    done = prefill(
        model, prompt, MethodSpec("custom", **{stage: (Compress if stage == "compress" else Evict)(policy, budget)})
    )
    assert second_passes == []
    scores = getattr(done.state, stage).scores
    for layer, (query, key) in seen.items():
        expected = real(query, key, query.shape[-1] ** -0.5, policy.step_alpha)
        if getattr(policy, "pool_size", 1) > 1:
            expected = F.avg_pool1d(expected[:, None], policy.pool_size, stride=1, padding=policy.pool_size // 2)[:, 0]
        torch.testing.assert_close(scores[layer], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [1, 5])
def test_decoding_rows_come_from_the_step_attention(make_model, monkeypatch, kernel):
    """The per-step rule (eq. 6) gets the step's attention row from the step itself; the tokens and
    scores equal the reference observer's (which computes the row in a second pass). Pooling
    applies to the prompt scores only, never to a step's row."""
    model = make_model("llama", num_layers=2)
    prompt = make_prompt(40)
    policy = A2SF(alpha=0.5, pool_size=kernel)
    fused = run(model, FakeTokenizer(), prompt, evict=Evict(policy, 24), sampling=Sampling(8))
    monkeypatch.setattr(
        "kvsieve.compress.stages.EvictRun.step_observers", lambda self: [self.observe]
    )  # the plain observer: a second QK^T per step
    plain = run(model, FakeTokenizer(), prompt, evict=Evict(policy, 24), sampling=Sampling(8))
    assert fused.tokens == plain.tokens
    for layer in range(2):
        torch.testing.assert_close(fused.state.evict.scores[layer], plain.state.evict.scores[layer])


@pytest.mark.parametrize("dim", [8, 16], ids=["pytorch", "kernel"])  # the CPU kernel serves 16, not 8
def test_a_decoding_step_hands_attention_rows_its_probabilities(dim):
    """A one-query step gives `AttentionRows` the probabilities it attends with (each head's softmax over the keys)
    and the layer's KV heads; an `AccumulatedScores` observer beside it still gets that row summed per KV head (in
    a pass of its own); more than one query is refused."""
    from functools import partial
    from types import SimpleNamespace

    from kvsieve.attention import AccumulatedScores, AttentionRows, Hooks, kvsieve_attention
    from kvsieve.compress.scorers import per_kv_head

    query, key, value = _qkv(1, 30, dim=dim)
    rows, sums = {}, {}
    observers = (
        AttentionRows(lambda layer, probs, kv_heads: rows.update({layer: (probs, kv_heads)})),
        AccumulatedScores(1.0, lambda layer, s, q: sums.update({layer: s}), partial(accumulated_attention, alpha=1.0)),
    )
    hooks = Hooks(observers=observers)
    out, _ = kvsieve_attention(SimpleNamespace(layer_idx=3), query, key, value, None, kvsieve_hooks=hooks)
    torch.testing.assert_close(out.transpose(1, 2), dense_attention(query, key, value, None), rtol=1e-5, atol=1e-5)
    probs, kv_heads = rows[3]
    assert kv_heads == 2 and probs.shape == (1, 6, 30)
    logits = (query[0] @ key[0].repeat_interleave(3, 0).transpose(1, 2))[:, 0] * dim**-0.5
    torch.testing.assert_close(probs[0], logits.softmax(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums[3], per_kv_head(probs[0], 2), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one query per row"):
        kvsieve_attention(SimpleNamespace(layer_idx=0), *_qkv(2, 30, dim=dim), None, kvsieve_hooks=hooks)
