"""StreamingLLM's positions: kept (kvpress, the default) or re-encoded by place in the cache (the paper).

With `reencode`, after any number of evictions the cache must be what a fresh model run on
[sinks + window tokens] at positions 0 .. n-1 builds, and the next token (fed at position n)
must get that run's logits. Only layer 0's keys depend on nothing but a token and its position
(later layers' keys carry the context each token once attended to), so keys are compared at
layer 0 and logits on one-layer models, where the whole forward pass is determined by the cache.
Without `reencode` every entry keeps the key of its position in the stream, as before.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, Decoder, FakeTokenizer, make_prompt, tiny_config
from transformers import AutoModelForCausalLM

import kvsieve
from kvsieve import Sampling, run
from kvsieve.attention import attention_hooks
from kvsieve.compress.policies.snapkv import SnapKV
from kvsieve.compress.policies.streaming import StreamingLLM
from kvsieve.compress.stages import Compress, Evict
from kvsieve.decode import extend
from kvsieve.engine.pipeline import prefill
from kvsieve.errors import KvsieveError
from kvsieve.feed.chunked import ChunkedPrefill
from kvsieve.kv.cache import DecodeBuffer
from kvsieve.prompt import Prompt
from kvsieve.spec import MethodSpec

SINKS, BUDGET = 4, 16


def _model(arch: str, num_layers: int = 1, max_positions: int = 64, partial: float | None = None):
    """A tiny GQA model (4 query / 2 KV heads); `partial` sets Phi-3's partial rotary factor."""
    config = tiny_config(arch, num_layers, max_positions)
    if partial is not None:
        config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": partial}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return kvsieve.prepare(model.eval())


def _stream(model, ids: torch.Tensor, prompt: int, evict: Evict):
    """Prefill ids[:, :prompt], then feed the rest but the last token one at a time (teacher forcing)
    through the engine's in-place decoding. Returns (decoder, cache, run, logical position of the last token)."""
    with torch.no_grad():
        done = prefill(model, Prompt(ids[:, :prompt], 0, prompt), MethodSpec("custom", evict=evict))
        cache, state = done.prefilled.cache, done.state.evict
        decoder = Decoder(model, cache, prompt, state)
        for i in range(prompt, ids.shape[1] - 1):
            decoder.feed(ids[0, i])
    return decoder, cache, state, ids.shape[1] - 1


def _in_time_order(cache, state, layer: int = 0) -> torch.Tensor:
    """Layer `layer`'s keys (kv_heads, n, d), entries sorted by age (the buffer is not in time order)."""
    keys = cache.layers[layer].keys[0]
    order = state.buffers.stamps[layer].argsort(dim=1)
    return keys.gather(1, order[:, :, None].expand(-1, -1, keys.shape[-1]))


def _cached_tokens(ids: torch.Tensor, fed: int, length: int) -> torch.Tensor:
    """The stream tokens a StreamingLLM cache of `length` entries holds after `fed` tokens: sinks + newest."""
    return torch.cat([ids[:, :SINKS], ids[:, fed - (length - SINKS) : fed]], dim=1)


def _fresh(model, tokens: torch.Tensor, positions: torch.Tensor):
    """Keys of layer 0 (kv_heads, n, d) and the last logits of a fresh run on `tokens` at `positions`."""
    with torch.no_grad():
        out = model(input_ids=tokens, position_ids=positions[None], use_cache=True)
    return out.past_key_values.layers[0].keys[0], out.logits[0, -1]


CASES = [("llama", None), ("qwen3", None), ("phi3", 0.5)]


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize(("arch", "partial"), CASES, ids=lambda v: str(v))
def test_reencoded_cache_equals_a_fresh_run_on_sinks_and_window(single_thread, arch, partial, interval):
    model = _model(arch, partial=partial)
    ids = torch.randint(3, VOCAB, (1, 90), generator=torch.Generator().manual_seed(3))
    decoder, cache, state, fed = _stream(
        model, ids, 40, Evict(StreamingLLM(SINKS, reencode=True), BUDGET, interval=interval)
    )
    length = cache.get_seq_length()
    assert BUDGET <= length < BUDGET + interval
    assert isinstance(cache.layers[0], DecodeBuffer)
    # Every entry sits at its rank in time order.
    assert torch.equal(state.reencoding.positions[0], state.buffers.stamps[0].argsort(1).argsort(1))
    tokens = _cached_tokens(ids, fed, length)
    keys, logits = _fresh(model, torch.cat([tokens, ids[:, fed : fed + 1]], 1), torch.arange(length + 1))
    torch.testing.assert_close(_in_time_order(cache, state), keys[:, :length], atol=2e-5, rtol=1e-4)
    # The next token goes at position = cache length and sees what the fresh run sees.
    assert state.position(cache.get_seq_length(), fed) == length
    with torch.no_grad():
        ours = decoder.feed(ids[0, fed])
    torch.testing.assert_close(ours, logits, atol=1e-4, rtol=1e-4)


def test_reencoded_layer_zero_of_a_deeper_model(make_model):
    model = make_model("mistral", num_layers=3)
    ids = torch.randint(3, VOCAB, (1, 70), generator=torch.Generator().manual_seed(4))
    _, cache, state, fed = _stream(model, ids, 30, Evict(StreamingLLM(SINKS, reencode=True), BUDGET))
    tokens = _cached_tokens(ids, fed, BUDGET)
    keys, _ = _fresh(model, tokens, torch.arange(BUDGET))
    torch.testing.assert_close(_in_time_order(cache, state), keys, atol=2e-5, rtol=1e-4)
    for layer in range(3):  # the same places in every layer
        assert torch.equal(state.reencoding.positions[layer], state.reencoding.positions[0])


def test_kept_positions_are_unchanged(single_thread):
    """Without reencode an entry keeps the key of its stream position and decoding goes on at the logical one."""
    model = _model("llama", max_positions=256)
    ids = torch.randint(3, VOCAB, (1, 90), generator=torch.Generator().manual_seed(5))
    evict = Evict(StreamingLLM(SINKS), BUDGET)
    assert not evict.reencodes
    _, cache, state, fed = _stream(model, ids, 40, evict)
    assert state.reencoding is None
    assert state.position(cache.get_seq_length(), fed) == fed
    tokens = _cached_tokens(ids, fed, BUDGET)
    positions = torch.cat([torch.arange(SINKS), torch.arange(fed - (BUDGET - SINKS), fed)])
    keys, _ = _fresh(model, tokens, positions)
    torch.testing.assert_close(_in_time_order(cache, state), keys, atol=2e-5, rtol=1e-4)
    # ... and those keys are not the re-encoded ones.
    reencoded, _ = _fresh(model, tokens, torch.arange(BUDGET))
    assert not torch.allclose(_in_time_order(cache, state), reencoded, atol=1e-3)


def test_reencode_gives_other_tokens_than_kept(make_model):
    model = make_model("llama")
    prompt = make_prompt(40)
    kept = run(model, FakeTokenizer(), prompt, evict=Evict(StreamingLLM(SINKS), BUDGET), sampling=Sampling(24))
    default = run(model, FakeTokenizer(), prompt, evict=Evict(StreamingLLM(), BUDGET), sampling=Sampling(24))
    moved = run(model, FakeTokenizer(), prompt, evict=Evict(StreamingLLM(reencode=True), BUDGET), sampling=Sampling(24))
    assert default.tokens == kept.tokens  # the default keeps positions
    assert moved.tokens != kept.tokens


@pytest.mark.parametrize("interval", [1, 2])
def test_plain_cache_path_reencodes_like_the_buffers(make_model, interval):
    """Eviction on an ordinary cache (new tensors in time order, the reference of the in-place path) re-encodes
    too, with the tokens of the engine's in-place decoding."""
    model = make_model("qwen2")
    prompt = make_prompt(40)
    evict = Evict(StreamingLLM(SINKS, reencode=True), BUDGET, interval=interval)
    buffered = run(model, FakeTokenizer(), prompt, evict=evict, sampling=Sampling(20))
    with torch.no_grad():
        done = prefill(model, prompt, MethodSpec("custom", evict=evict))
        cache, state = done.prefilled.cache, done.state.evict
        tokens = [int(done.prefilled.last_logits.argmax())]
        position = done.prefilled.next_position
        for _ in range(19):
            with attention_hooks(observers=state.step_observers()):
                fed_at = state.position(cache.get_seq_length(), position)
                logits = extend(model, cache, torch.tensor([[tokens[-1]]]), fed_at)[-1]
                state.after_step(cache)
            position += 1
            tokens.append(int(logits.argmax()))
    assert not isinstance(cache.layers[0], DecodeBuffer)
    assert tokens == buffered.tokens
    assert torch.equal(state.reencoding.positions[0], torch.arange(cache.get_seq_length()).expand(2, -1))


def test_reencode_after_a_compress_stage_places_each_heads_kept_tokens(single_thread):
    """SnapKV keeps other tokens per KV head; re-encoding places each head's own kept tokens at 0 .. n-1."""
    model = _model("llama", max_positions=256)
    prompt = make_prompt(60)
    with torch.no_grad():
        done = prefill(
            model,
            prompt,
            MethodSpec(
                "custom",
                compress=Compress(SnapKV(window=4), 24),
                evict=Evict(StreamingLLM(SINKS, reencode=True), BUDGET),
            ),
        )
    state = done.state
    kept = state.compress.kept_positions[0].gather(1, _start_kept(state.compress.kept_positions[0], BUDGET))
    keys = done.prefilled.cache.layers[0].keys[0]
    for head in range(keys.shape[0]):
        fresh, _ = _fresh(model, prompt.ids[:, kept[head]], torch.arange(BUDGET))
        torch.testing.assert_close(keys[head], fresh[head], atol=2e-5, rtol=1e-4)
    assert state.evict.position(done.prefilled.cache.get_seq_length(), done.prefilled.next_position) == BUDGET


def _start_kept(compressed: torch.Tensor, budget: int) -> torch.Tensor:
    """The entries StreamingLLM keeps of a cache in time order: the first SINKS and the newest."""
    n = compressed.shape[1]
    index = torch.cat([torch.arange(SINKS), torch.arange(n - (budget - SINKS), n)])
    return index.expand(compressed.shape[0], -1)


def test_a_reencoded_stream_outlasts_the_models_positions(single_thread):
    model = _model("llama", max_positions=32)
    prompt = make_prompt(20)
    evict = Evict(StreamingLLM(SINKS, reencode=True), BUDGET)
    result = run(model, FakeTokenizer(), prompt, evict=evict, sampling=Sampling(100))
    assert len(result.tokens) == 100 and result.kv_cache_length == BUDGET
    assert int(result.state.evict.reencoding.positions[0].max()) == BUDGET - 1
    ids = torch.randint(3, VOCAB, (1, 120), generator=torch.Generator().manual_seed(6))
    decoder, cache, state, fed = _stream(model, ids, 8, evict)  # 4x the model's positions, token by token
    with torch.no_grad():
        logits = decoder.feed(ids[0, fed])
    assert torch.isfinite(logits).all()
    with pytest.raises(KvsieveError, match="trained for 32") as refused:  # kept positions would run past them
        run(model, FakeTokenizer(), prompt, evict=Evict(StreamingLLM(SINKS), BUDGET), sampling=Sampling(100))
    assert "evict.policy.reencode=true" in str(refused.value)  # the way out is named


def test_reencode_is_refused_where_it_cannot_be_honoured(make_model):
    policy = StreamingLLM(reencode=True)
    with pytest.raises(KvsieveError, match="evict stage"):
        Compress(policy, 16)
    with pytest.raises(KvsieveError, match="true or false"):
        StreamingLLM(reencode="yes")
    model = make_model("llama")
    feed = ChunkedPrefill(chunk=16, memory=16)
    with pytest.raises(KvsieveError, match="one-pass prefill"):
        prefill(model, make_prompt(40), MethodSpec("custom", feed=feed, evict=Evict(policy, 16)))
    state = Evict(policy, 16).begin()
    with pytest.raises(KvsieveError, match="pass the model"):
        state.start(_prefilled_cache(model), None)


def _prefilled_cache(model):
    with torch.no_grad():
        return model(input_ids=make_prompt(20).ids, use_cache=True).past_key_values
