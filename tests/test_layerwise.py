"""Compression layer by layer during a one-pass prefill, and scoring a chunked feed's last pass only.

Pruning layer j right after its attention (the pipeline's finisher) must give exactly the cache,
kept positions and logits of pruning every layer after the prefill, while the uncompressed cache
of all layers never exists at once. A chunked feed's compress / evict observers see only its
last chunk's pass.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_prompt

from kvsieve.attention import PassReader, attention_hooks
from kvsieve.compress.policies.a2sf import A2SF
from kvsieve.compress.policies.h2o import H2O
from kvsieve.compress.policies.snapkv import SnapKV
from kvsieve.compress.policies.streaming import StreamingLLM
from kvsieve.compress.stages import Compress, Evict
from kvsieve.engine.pipeline import prefill
from kvsieve.feed.chunked import ChunkedPrefill
from kvsieve.feed.full import FullPrefill
from kvsieve.spec import MethodSpec

LAYERS = 3


def _after_the_prefill(model, prompt, stage):
    """Reference: the whole prefill first, then every layer pruned (the pipeline before layer-by-layer)."""
    run = stage.begin()
    with attention_hooks(observers=run.observers()):
        prefilled = FullPrefill().prefill(model, prompt.ids)
    if isinstance(stage, Compress):
        run.compress(prefilled.cache)
        return prefilled, run.kept_positions
    run.start(prefilled.cache, None)
    return prefilled, None


@pytest.mark.parametrize(
    "stage",
    [Compress(SnapKV(window=4), 20), Compress(H2O(), 0.5), Evict(A2SF(alpha=0.5), 24), Evict(StreamingLLM(), 16)],
    ids=["snapkv", "h2o-fraction", "a2sf-evict", "streaming-evict"],
)
def test_layer_by_layer_equals_pruning_after_the_prefill(make_model, stage):
    model = make_model("qwen2", num_layers=LAYERS)
    prompt = make_prompt(60)
    reference, reference_kept = _after_the_prefill(model, prompt, stage)
    key = "compress" if isinstance(stage, Compress) else "evict"
    done = prefill(model, prompt, MethodSpec("custom", **{key: stage}))
    torch.testing.assert_close(done.prefilled.last_logits, reference.last_logits)
    for ours, theirs in zip(done.prefilled.cache.layers, reference.cache.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    if reference_kept is not None:
        assert all(torch.equal(a, b) for a, b in zip(done.state.compress.kept_positions, reference_kept, strict=True))
        assert done.stages[-1].details["layer_by_layer"] and done.stages[-1].details["from"] == 60


def test_uncompressed_cache_of_all_layers_never_exists(make_model, monkeypatch):
    """When layer j attends, layers before it already hold only the budget."""
    model = make_model("llama", num_layers=4)
    prompt = make_prompt(80)
    held = []
    cache_of = {}

    def count(layer, query, key):
        cache = cache_of["cache"]
        held.append(sum(entry.keys.shape[2] for entry in cache.layers[:layer]))

    original = FullPrefill.prefill

    def spy(self, model, ids, cache=None, position=None, every_logit=False):
        cache_of["cache"] = cache
        with attention_hooks(observers=[count]):
            return original(self, model, ids, cache=cache, position=position, every_logit=every_logit)

    monkeypatch.setattr(FullPrefill, "prefill", spy)
    prefill(model, prompt, MethodSpec("custom", compress=Compress(SnapKV(window=4), 16)))
    assert held == [0, 16, 32, 48]  # never 80 per earlier layer


def test_chunked_feed_stages_score_only_its_last_pass(make_model, monkeypatch):
    model = make_model("llama", num_layers=2)
    prompt = make_prompt(100)
    passes = []
    original = Compress.begin

    def begin(self):
        run = original(self)
        inner = run.observers()

        def observers(**kwargs):
            def spy(layer, q, k, v):
                passes.append(q.shape[2])
                for observer in inner:  # the policy's own: a PassReader, handed the values too
                    observer.receive(layer, q, k, v)

            return [PassReader(spy)]

        run.observers = observers
        return run

    monkeypatch.setattr(Compress, "begin", begin)
    spec = MethodSpec("custom", feed=ChunkedPrefill(chunk=32, memory=24), compress=Compress(SnapKV(window=4), 16))
    done = prefill(model, prompt, spec)
    chunks = done.prefilled.details["chunk_sizes"]
    assert len(chunks) == 4 and passes == [chunks[-1]] * 2  # the last chunk, once per layer
    assert done.kv_length == 16
