"""Decoding under eviction in preallocated buffers, in place.

The engine's decoding batch moves the cache into `DecodeBuffer` layers (`EvictRun.in_place`); each
step writes its entry in place and an eviction moves at most `interval` entries per KV head. The result must be exactly
the eviction of the plain path (gathering the kept entries into new tensors, in time order):
the same tokens and the same set of cached entries, for every policy with a per-step rule
(their protected sinks and recent windows included) and several intervals, without ever
reallocating the buffers.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Decoder, FakeTokenizer, make_prompt
from transformers import DynamicCache

from kvsieve import Sampling, method, run
from kvsieve.attention import attention_hooks
from kvsieve.compress.policies.a2sf import A2SF
from kvsieve.compress.policies.h2o import H2O
from kvsieve.compress.policies.knorm import KNorm
from kvsieve.compress.policies.local import LocalWindow
from kvsieve.compress.policies.streaming import StreamingLLM
from kvsieve.compress.policies.tova import TOVA
from kvsieve.compress.stages import Evict
from kvsieve.decode import extend, next_token
from kvsieve.engine.pipeline import prefill
from kvsieve.errors import KvsieveError
from kvsieve.kv.cache import DecodeBuffer, compaction
from kvsieve.spec import MethodSpec

POLICIES = [H2O(), A2SF(alpha=0.5), A2SF(alpha=0.2, recent=4), StreamingLLM(), LocalWindow(), TOVA(), KNorm()]


def test_compaction_keeps_exactly_the_survivors():
    generator = torch.Generator().manual_seed(0)
    for m in (1, 2, 5):
        length = 12
        victims = torch.stack([torch.randperm(length, generator=generator)[:m] for _ in range(3)])
        entries = torch.arange(length).expand(3, -1).clone()
        sources, targets = compaction(victims, length)
        entries.scatter_(1, targets, entries.gather(1, sources))
        for head in range(3):
            survivors = sorted(set(range(length)) - set(victims[head].tolist()))
            assert sorted(entries[head, : length - m].tolist()) == survivors


def _plain_decode(model, prompt, evict, steps):
    """The reference: eviction on an ordinary cache (new tensors per step, time order)."""
    done = prefill(model, prompt, MethodSpec("custom", evict=evict), reserve=steps)
    cache, run_state = done.prefilled.cache, done.state.evict
    tokens = [next_token(done.prefilled.last_logits, Sampling(), None)]
    position = done.prefilled.next_position
    with torch.no_grad(), attention_hooks(observers=[run_state.observe]):
        for _ in range(steps - 1):
            logits = extend(model, cache, torch.tensor([[tokens[-1]]]), position)[-1]
            position += 1
            run_state.after_step(cache)
            tokens.append(next_token(logits, Sampling(), None))
    return tokens, cache


def _same_entries(ours, theirs) -> bool:
    """Whether each KV head caches the same keys (the buffered cache is not in time order). The step's
    attention differs from SDPA's in the last float bits, so later layers' keys match to 1e-4."""
    if ours.keys.shape != theirs.keys.shape:
        return False
    distances = [torch.cdist(a, b) for a, b in zip(ours.keys[0], theirs.keys[0], strict=True)]
    return all(d.min(0).values.max() < 1e-4 and d.min(1).values.max() < 1e-4 for d in distances)


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.name}-{getattr(p, 'recent', '')}")
def test_buffered_eviction_equals_the_plain_path(make_model, policy, interval):
    model = make_model("llama", num_layers=2)
    prompt = make_prompt(40)
    evict = Evict(policy, 16, interval=interval)
    tokens, cache = _plain_decode(model, prompt, evict, 12)
    buffered = run(model, FakeTokenizer(), prompt, evict=evict, sampling=Sampling(12))
    assert buffered.tokens == tokens
    assert buffered.kv_cache_length == cache.get_seq_length()
    for ours, theirs in zip(buffered.state.prefilled.cache.layers, cache.layers, strict=True):
        assert isinstance(ours, DecodeBuffer)
        assert _same_entries(ours, theirs)


def test_steps_never_reallocate_the_buffers(make_model):
    model = make_model("qwen2", num_layers=2)
    addresses, storages = set(), set()

    def watch(layer, query, key):
        if query.shape[2] == 1:
            addresses.add(key.data_ptr())
            storages.add(key.untyped_storage().data_ptr())

    with attention_hooks(observers=[watch]):
        result = run(model, FakeTokenizer(), make_prompt(40), evict=Evict(H2O(), 16, 4), sampling=Sampling(20))
    assert len(addresses) == 2 and result.kv_cache_length <= 16 + 3  # one buffer per layer, whatever the step
    assert len(storages) == 1  # both layers' buffers are slices of one table


@pytest.mark.parametrize("name", ["full", "snapkv"])
def test_decoding_without_eviction_writes_in_place_and_equals_the_plain_cache(make_model, name):
    """Full attention (and a compressed cache) decode in one preallocated table too: no step copies the cache
    (a growing DynamicCache concatenates every layer every step), and the tokens are the plain cache's."""
    model = make_model("llama", num_layers=2)
    prompt, steps = make_prompt(40), 12
    done = prefill(model, prompt, method=method(name), reserve=steps)
    cache, position = done.prefilled.cache, done.prefilled.next_position
    tokens = [next_token(done.prefilled.last_logits, Sampling(), None)]
    with torch.no_grad():  # the plain cache: a DynamicCache that concatenates every step
        for _ in range(steps - 1):
            logits = extend(model, cache, torch.tensor([[tokens[-1]]]), position)[-1]
            position += 1
            tokens.append(next_token(logits, Sampling(), None))
    storages = set()

    def watch(layer, query, key):
        if query.shape[2] == 1:
            storages.add(key.untyped_storage().data_ptr())

    with attention_hooks(observers=[watch]):
        ours = run(model, FakeTokenizer(), prompt, method=name, sampling=Sampling(steps, ignore_eos=True))
    assert ours.tokens == tokens
    assert len(storages) == 1 and all(isinstance(layer, DecodeBuffer) for layer in ours.state.prefilled.cache.layers)


def test_steps_write_the_stamps_in_one_preallocated_table(make_model):
    """Each step writes its entries' stamps into the table `in_place` allocated; no step reallocates it."""
    model = make_model("qwen2", num_layers=2)
    done = prefill(model, make_prompt(40), MethodSpec("custom", evict=Evict(H2O(), 16, 4)), reserve=12)
    cache, state, position = done.prefilled.cache, done.state.evict, done.prefilled.next_position
    decoder = Decoder(model, cache, position, state)
    table = state.buffers.stamp_table.data_ptr()
    with torch.no_grad():
        for token in range(12):
            decoder.feed(token + 3)
            assert state.buffers.stamps.data_ptr() == table
            assert state.buffers.stamps.shape[0] == 2 and state.buffers.stamps.shape[2] == cache.get_seq_length()
    assert state.buffers.clock == 16 + 12  # every step's entry got the next stamp
    stamps = state.buffers.stamps
    assert stamps.max() == 16 + 11 and len(set(stamps[0, 0].tolist())) == stamps.shape[2]


def test_in_place_eviction_refuses_layers_of_different_lengths(make_model):
    model = make_model("llama", num_layers=2)
    cache = DynamicCache()
    for layer, length in enumerate((20, 18)):
        cache.update(torch.zeros(1, 2, length, 8), torch.zeros(1, 2, length, 8), layer)
    with pytest.raises(KvsieveError, match=r"one length, but they hold \[18, 20\]"):
        Decoder(model, cache, 20, Evict(H2O(), 16).begin())


def _steady_case(dtype: torch.dtype, scored: bool, seed: int) -> tuple:
    """Three layers, three rows, two KV heads, a budget of 20: each row-1 head's 20 entries hold distinct stamps
    below the clock (50) in shuffled columns, the new entry at column 20; scores with many ties (quarters)."""
    generator = torch.Generator().manual_seed(seed)
    layers, rows, heads, capacity, dim, budget = 3, 3, 2, 32, 8, 20
    keys = torch.randn(layers, rows, heads, capacity, dim, generator=generator).to(dtype)
    values = torch.randn(layers, rows, heads, capacity, dim, generator=generator).to(dtype)
    stamps = torch.full((layers, heads, capacity), -7, dtype=torch.long)
    for layer in range(layers):
        for head in range(heads):
            stamps[layer, head, :budget] = torch.randperm(50, generator=generator)[:budget]
    scores = (
        [torch.randint(0, 4, (heads, budget + 1), generator=generator) / 4 for _ in range(layers)] if scored else []
    )
    carried = [torch.full((heads, budget), -1.0) for _ in range(len(scores))]
    return keys, values, 1, scores, carried, stamps, torch.tensor(50), budget


def _lowest_oldest_by_hand(score: list[float], ages: list[int], clock: int, sinks: int, recent: int) -> int:
    """The column a steady eviction drops: the lowest score, oldest among equal ones, protected entries aside."""
    kept = [age < sinks or age >= clock + 1 - recent for age in ages]
    key = [(float("inf") if k else s, age) for s, age, k in zip(score, ages, kept, strict=True)]
    return min(range(len(key)), key=key.__getitem__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scored", [True, False], ids=["scored", "position-only"])
@pytest.mark.parametrize("protected", [(0, 0), (4, 0), (0, 6), (3, 21)])
def test_a_steady_eviction_in_pytorch_and_in_the_cpu_kernel_drop_the_same_entries(
    single_thread, dtype, scored, protected
):
    """`steady_eviction` (PyTorch's operators: a GPU's, captured in its step) and `torch.ops.kvsieve.evict_lowest`
    (a CPU's, one pass) on the same steady row: each drops, per layer and KV head, the entry a by-hand reading of
    the rule picks (lowest score, oldest among ties, sinks and the recent tail protected; every entry protected:
    the oldest), moves the new entry's key and value (float32 or bfloat16) and stamp into its slot, leaves the
    other rows alone, writes the surviving scores into `carried` and advances the clock."""
    from unittest import mock

    from kvsieve.kernels import native
    from kvsieve.kernels.eviction import steady_eviction

    assert native.load()

    def in_pytorch(*args):  # the dispatch's other branch, as on a GPU
        with mock.patch.object(native, "load", return_value=False):
            return steady_eviction(*args)

    sinks, recent = protected
    case = _steady_case(dtype, scored, seed=sum(protected) + scored)
    keys, values, row, scores, carried, stamps, clock, budget = case
    results = []
    for evict in (in_pytorch, torch.ops.kvsieve.evict_lowest):
        args = [t.clone() for t in (keys, values)] + [row, [s.clone() for s in scores], [c.clone() for c in carried]]
        args += [stamps.clone(), clock.clone(), budget, sinks, recent]
        victims = evict(*args)
        results.append((victims, *args))
    for layer in range(keys.shape[0]):
        for head in range(keys.shape[2]):
            ages = stamps[layer, head, :budget].tolist() + [50]
            score = scores[layer][head].tolist() if scored else [0.0] * (budget + 1)
            victim = _lowest_oldest_by_hand(score, ages, 50, sinks, recent)
            for victims, k, v, _, _, c, st, _, *_ in results:
                assert victims[layer, head] == victim
                assert torch.equal(k[layer, row, head, victim], keys[layer, row, head, budget])
                assert torch.equal(v[layer, row, head, victim], values[layer, row, head, budget])
                assert st[layer, head, victim] == 50
                if scored:
                    expected = (
                        score[:victim] + [score[budget]] + score[victim + 1 : budget]
                        if victim < budget
                        else score[:budget]
                    )
                    assert c[layer][head].tolist() == expected
    (_, *first), (_, *second) = results
    for a, b in zip(first, second, strict=True):
        if isinstance(a, list):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    assert int(first[6]) == 51  # the clock, advanced once
    for other in (0, 2):  # the other rows untouched
        assert torch.equal(first[0][:, other], keys[:, other]) and torch.equal(first[1][:, other], values[:, other])


def test_the_cpu_kernel_reads_scores_shared_by_the_kv_heads(single_thread):
    """TOVA scores every KV head with one row (`expand`: a stride of 0 between heads); the kernel reads such scores
    as they are and drops the entries it drops for the same scores laid out in full."""
    from kvsieve.kernels import native

    assert native.load()
    keys, values, row, _, _, stamps, clock, budget = _steady_case(torch.float32, False, seed=11)
    rows = [torch.rand(budget + 1, generator=torch.Generator().manual_seed(layer)) for layer in range(keys.shape[0])]
    results = []
    for scores in ([r.expand(2, -1) for r in rows], [r.expand(2, -1).contiguous() for r in rows]):
        carried = [torch.zeros(2, budget) for _ in rows]
        args = (keys.clone(), values.clone(), row, scores, carried, stamps.clone(), clock.clone(), budget, 0, 0)
        results.append((torch.ops.kvsieve.evict_lowest(*args), *args))
    assert results[0][4][0].stride(0) == 0  # the shared layout reached the kernel
    for a, b in zip(results[0], results[1], strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(results[0][5], results[1][5], strict=True))  # carried
