"""A2SF's evaluation protocol: eviction replayed at every position of a teacher-forced pass."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_prompt

from kvsieve import A2SF, H2O, LocalWindow, SnapKV, StreamingLLM
from kvsieve.attention.dense import bottom_right_causal_mask, repeat_kv
from kvsieve.errors import KvsieveError
from kvsieve.eval.simulate import SimulatedEviction, sequence_nll


def banded_attention(q, k, v, keep_mask):
    n_rep = q.shape[1] // k.shape[1]
    logits = q[0] @ repeat_kv(k, n_rep)[0].transpose(-1, -2) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~keep_mask, float("-inf"))
    return (logits.softmax(-1) @ repeat_kv(v, n_rep)[0])[None]


def band(n, window, sinks=0):
    causal = bottom_right_causal_mask(n, n)
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None]
    return causal & ((cols > rows - window) | (cols < sinks))


@pytest.fixture
def qkv():
    torch.manual_seed(0)
    return torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)


def test_local_window_is_a_sliding_band(qkv):
    q, k, v = qkv
    out = SimulatedEviction(LocalWindow(), 6, chunk=7)(0, q, k, v, None)
    torch.testing.assert_close(out, banded_attention(q, k, v, band(20, 7)))  # 6 kept + the new token


def test_streaming_keeps_sinks_and_a_band(qkv):
    q, k, v = qkv
    out = SimulatedEviction(StreamingLLM(sinks=2), 6)(0, q, k, v, None)
    torch.testing.assert_close(out, banded_attention(q, k, v, band(20, 5, sinks=2)))


def test_large_budget_is_dense_attention(qkv):
    q, k, v = qkv
    kernel = SimulatedEviction(H2O(), 20)
    torch.testing.assert_close(kernel(0, q, k, v, None), banded_attention(q, k, v, bottom_right_causal_mask(20, 20)))
    assert math.isnan(kernel.cosine)  # no row was ever pruned


def test_h2o_evicts_lowest_accumulated_score():
    # All keys are zero except token 1's, which no query attends to. Rows spread attention
    # uniformly over what is held. Budget 4, H2O protects the 2 newest. Row 4 must evict
    # token 1 (score ~0); row 5 evicts token 3, whose accumulated score is lowest only because
    # it has been seen by fewer rows (H2O's bias that A2SF's forgetting factor addresses).
    q = torch.zeros(1, 2, 6, 4)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 6, 4)
    k[0, 0, 1, 0] = -30.0
    kernel = SimulatedEviction(H2O(), 4)
    kernel(0, q, k, torch.randn(1, 1, 6, 4), 1.0)
    assert kernel.kept[0].nonzero().flatten().tolist() == [0, 2, 4, 5]
    assert 0.0 < kernel.cosine <= 1.0


@pytest.mark.parametrize("method", [H2O(), A2SF(alpha=0.1), StreamingLLM(), LocalWindow()], ids=lambda m: m.name)
def test_budget_covering_sequence_reproduces_full_nll(make_model, method):
    model = make_model("llama")
    ids = make_prompt(40).ids
    torch.testing.assert_close(sequence_nll(model, ids, SimulatedEviction(method, 40)), sequence_nll(model, ids))


def test_small_budget_changes_nll_and_reports_cosine(make_model):
    model = make_model("qwen2")
    ids = make_prompt(40).ids
    kernel = SimulatedEviction(A2SF(alpha=0.1), 8)
    pruned = sequence_nll(model, ids, kernel)
    full = sequence_nll(model, ids)
    assert not torch.allclose(pruned, full)
    torch.testing.assert_close(pruned[:8], full[:8])  # the first rows never exceed the budget
    assert 0.0 < kernel.cosine < 1.0


def test_simulation_refuses_one_shot_methods():
    with pytest.raises(KvsieveError, match="per-step"):
        SimulatedEviction(SnapKV(), 16)
