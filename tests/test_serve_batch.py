"""The server's engine: batched decoding gives each request exactly the tokens it gets alone.

Requests with different prompt lengths, methods and budgets (full attention, SnapKV compression,
A2SF and StreamingLLM eviction at every step, IMDC with per-layer memory sizes) are queued
before the engine starts, so they join the batch one by one between steps and leave at
different steps (different max_tokens). `FakeTokenizer` writes token 17 as "<17>", so the
answer text is the token sequence itself.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import FakeTokenizer, build_model, make_prompt

from kvsieve import Sampling, method, run
from kvsieve.serve.batch import DecodeBatch
from kvsieve.serve.engine import Engine, Failed, Finished, Job, Started, Text
from kvsieve.serve.metrics import Metrics

CASES = [
    ("full", {}, 40, 12),
    ("snapkv", {"compress.budget": 24, "compress.policy.window": 4}, 70, 9),
    ("a2sf", {"evict.budget": 30}, 50, 14),  # the cache exceeds 30 while decoding: evicts every step
    ("streaming", {"evict.budget": 20}, 33, 12),
    ("imdc", {"feed.chunk": 16, "feed.memory": 24, "feed.schedule": "square-sqrt"}, 90, 10),  # per-layer sizes
    ("full", {}, 7, 3),
    ("gemfilter", {"select.k": 24}, 60, 8),
    ("tova", {"evict.budget": 20}, 45, 10),
    ("critiprefill", {"attention.segment": 16, "attention.block": 4, "attention.budget": 16}, 80, 11),
]


class Collector:
    """The events of one job, complete once Finished or Failed arrives."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def emit(self, event):
        self.events.append(event)
        if isinstance(event, Finished | Failed):
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.piece for e in self.events if isinstance(e, Text))


@pytest.fixture
def engine(single_thread, monkeypatch):
    sizes = []
    step = DecodeBatch.step
    monkeypatch.setattr(DecodeBatch, "step", lambda self: sizes.append(len(self.rows)) or step(self))
    model = build_model("llama", num_layers=3, max_positions=512)
    engine = Engine(model, FakeTokenizer(), Metrics(), max_batch=16)
    engine.batch_sizes = sizes
    yield engine
    engine.stop()


def test_batched_greedy_decoding_equals_each_request_alone(engine):
    jobs = []
    for i, (name, settings, length, new_tokens) in enumerate(CASES):
        spec = method(name, settings)
        prompt = make_prompt(length, seed=10 + i)
        sink = Collector()
        job = Job(prompt.ids[0].tolist(), spec, Sampling(max_new_tokens=new_tokens), sink.emit, tail=prompt.tail_len)
        engine.submit(job)
        jobs.append((prompt, spec, new_tokens, sink))
    engine.start()
    for _, _, _, sink in jobs:
        assert sink.done.wait(60)
    assert max(engine.batch_sizes) >= 6  # most requests really decoded together
    for prompt, spec, new_tokens, sink in jobs:
        alone = run(engine.model, FakeTokenizer(), prompt, method=spec, sampling=Sampling(max_new_tokens=new_tokens))
        started, finished = sink.events[0], sink.events[-1]
        assert isinstance(started, Started) and isinstance(finished, Finished), sink.events
        assert sink.text == alone.text, spec.name
        assert finished.completion_tokens == len(alone.tokens) == new_tokens
        assert started.info["kv_entries"] == alone.prefill_kv_length
        if spec.evict is not None:  # the request's own eviction ran on its row of the batch
            assert finished.info["kv_entries_at_end"] == alone.kv_cache_length
    assert len(engine.batch) == 0 and engine.kv_entries() == 0  # every cache freed


def test_cancelled_request_leaves_the_batch_and_others_go_on(engine):
    long, short = Collector(), Collector()
    ids = make_prompt(30).ids[0].tolist()
    doomed = Job(ids, method("full"), Sampling(max_new_tokens=400), long.emit)
    engine.submit(doomed)
    engine.submit(Job(ids, method("a2sf", {"evict.budget": 16}), Sampling(max_new_tokens=20), short.emit))
    engine.start()
    while not any(isinstance(e, Text) for e in long.events):
        threading.Event().wait(0.01)
    doomed.cancelled.set()
    assert short.done.wait(30)
    for _ in range(200):
        if len(engine.batch) == 0:
            break
        threading.Event().wait(0.01)
    assert len(engine.batch) == 0 and not long.done.is_set()  # freed without finishing
    assert sum(isinstance(e, Text) for e in long.events) < 400


def test_a_method_the_model_cannot_run_fails_alone(engine):
    bad, good = Collector(), Collector()
    ids = make_prompt(40).ids[0].tolist()
    # A GemFilter layer beyond the model's 3 layers is only detectable with the model: a 400 from the engine.
    engine.submit(Job(ids, method("gemfilter", {"select.layer": 7, "select.k": 8}), Sampling(), bad.emit))
    engine.submit(Job(ids, method("full"), Sampling(max_new_tokens=4), good.emit))
    engine.start()
    assert bad.done.wait(30) and good.done.wait(30)
    assert isinstance(bad.events[0], Failed) and bad.events[0].error.status == 400
    assert "out of range" in bad.events[0].error.message
    assert isinstance(good.events[-1], Finished)


def test_padded_attention_masks_each_rows_padding():
    from kvsieve.attention import dense_attention, padded_attention

    torch.manual_seed(0)
    query = torch.randn(3, 4, 1, 8)
    keys = [torch.randn(1, 2, n, 8) for n in (5, 9, 1)]
    values = [torch.randn(1, 2, n, 8) for n in (5, 9, 1)]
    width = 9
    padded_k = torch.cat([torch.nn.functional.pad(k, (0, 0, width - k.shape[2], 0), value=7.0) for k in keys])
    padded_v = torch.cat([torch.nn.functional.pad(v, (0, 0, width - v.shape[2], 0), value=7.0) for v in values])
    starts = torch.tensor([width - k.shape[2] for k in keys])
    out = padded_attention(query, padded_k, padded_v, None, starts)
    for b in range(3):
        alone = dense_attention(query[b : b + 1], keys[b], values[b], None)
        torch.testing.assert_close(out[b : b + 1], alone)
